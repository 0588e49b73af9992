"""The start preflight in-process: the memory-return gate, the wait limit, the planner's verdict through
`submit`, a held port, leftovers — alone over a fake process table, and through the lifecycle."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.unit.fakes import (
    GIB,
    EngineScript,
    FakeOsCalls,
    HeldJobs,
    Rig,
    make_config,
    make_rig,
    write_meminfo,
)
from tunerd.config import Config
from tunerd.core.failures import FailureKind
from tunerd.core.machine import GpuFacts
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.engine.leftovers import LeftoverReaper
from tunerd.engine.process import MARKER_ENV
from tunerd.policy.guards import MemoryGate
from tunerd.records.state import DaemonState
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.preflight import Preflight, PreflightStep, Submit, run_here

MARKER = "marker-pf"
GATE = MemoryGate(baseline_available_bytes=60 * GIB, tolerance_bytes=GIB)


class Bench:
    def __init__(self, tmp_path: Path, overrides: dict[str, object] | None = None) -> None:
        self.proc = tmp_path / "proc"
        write_meminfo(self.proc, 60)
        self.config: Config = make_config(tmp_path, self.proc, overrides)
        self.os = FakeOsCalls(str(self.proc))
        self.reaper = LeftoverReaper(self.os, MARKER)
        self.gpu: GpuFacts | None = GpuFacts()
        self.plans: list[EngineParams] = []

    def preflight(
        self,
        *,
        gate: MemoryGate | None = GATE,
        plan: Callable[[EngineParams], PlanOutcome] | None = None,
        submit: Submit = run_here,
        started: float = 0.0,
        known: PlanOutcome | None = None,
    ) -> Preflight:
        return Preflight(
            self.config,
            EngineParams(max_model_len=4096),
            oscalls=self.os,
            marker=MARKER,
            reaper=self.reaper,
            gate=gate,
            gpu=lambda: self.gpu,
            plan_check=plan,
            started=started,
            submit=submit,
            plan=known,
        )


@pytest.fixture
def bench(tmp_path: Path) -> Bench:
    return Bench(tmp_path, {"preflight": {"max_wait_s": 30.0}, "timeouts": {"graceful_stop_s": 10.0}})


def waits(step: PreflightStep) -> list[str]:
    return [r["check"] for r in step.records if r["event"] == "preflight.waiting"]


# -- the memory-return gate -------------------------------------------------------------------------


def test_the_gate_holds_the_start_until_memavailable_is_back(bench: Bench) -> None:
    write_meminfo(bench.proc, 50)
    preflight = bench.preflight()
    first = preflight.step(1.0)
    assert not first.clear and first.failure is None
    assert first.reason == (
        "memory not returned yet: MemAvailable 50.00 GiB, waiting for 59.00 GiB "
        "(baseline 60.00 GiB - 1.00 GiB)"
    )
    assert waits(first) == ["memory"]
    again = preflight.step(2.0)
    assert not again.clear and waits(again) == []  # journaled once, not every tick

    write_meminfo(bench.proc, 59.5)
    done = preflight.step(3.0)
    assert done.clear
    (passed,) = [r for r in done.records if r["event"] == "preflight.passed"]
    assert passed["seconds"] == 3.0
    assert list(passed["timings"]) == ["foreign", "leftovers", "port", "memory", "page_cache", "plan"]
    assert passed["timings"]["foreign"] == 1.0  # each check's time since the one before cleared
    assert passed["timings"]["leftovers"] == 0.0
    assert passed["timings"]["memory"] == 2.0


def test_a_start_held_longer_than_max_wait_fails_with_kind_preflight(bench: Bench) -> None:
    write_meminfo(bench.proc, 50)
    preflight = bench.preflight(started=100.0)
    assert preflight.step(130.0).failure is None  # 30 s: not over max_wait_s yet
    step = preflight.step(130.5)
    assert step.failure is not None
    assert step.failure.kind is FailureKind.PREFLIGHT
    assert step.failure.detail.startswith("waited 30 s: memory not returned yet: MemAvailable 50.00 GiB")


def test_the_first_start_takes_the_baseline_with_the_configured_tolerance(bench: Bench) -> None:
    preflight = bench.preflight(gate=None)
    step = preflight.step(0.0)
    assert step.clear
    (baseline,) = [r for r in step.records if r["event"] == "preflight.baseline"]
    assert baseline["mem_available_bytes"] == 60 * GIB
    assert baseline["tolerance_bytes"] == 3 * GIB  # 5 % of 60 GiB beats the 1 GiB floor
    assert preflight.baseline == MemoryGate(60 * GIB, 3 * GIB, None)


# -- the planner, through submit --------------------------------------------------------------------------


def test_the_plan_check_runs_as_a_submitted_job_and_a_refusal_fails_the_start(bench: Bench) -> None:
    jobs = HeldJobs()

    def refuse(params: EngineParams) -> PlanOutcome:
        bench.plans.append(params)
        return PlanOutcome("weights 9.00 GiB do not fit in 4.00 GiB", {"feasible": False})

    preflight = bench.preflight(plan=refuse, submit=jobs)
    step = preflight.step(1.0)  # the foreign-engine scan is a job the start waits for
    assert not step.clear and step.reason == "looking for vLLM processes this tunerd did not start"
    jobs.run_all()
    step = preflight.step(1.05)
    assert not step.clear and step.reason == "asking the capacity planner"
    assert bench.plans == []  # not run on the loop's thread
    assert len(jobs.queued) == 1  # the plan

    jobs.run_all()
    step = preflight.step(1.1)
    assert bench.plans == [EngineParams(max_model_len=4096)]
    assert step.failure is not None and step.failure.kind is FailureKind.PLAN_REFUSED
    assert step.failure.detail == "weights 9.00 GiB do not fit in 4.00 GiB"
    (refused,) = [r for r in step.records if r["event"] == "preflight.refused"]
    assert refused["reason"] == step.failure.detail and refused["feasible"] is False


def test_an_accepted_plan_is_journaled_and_kept_for_the_spawn(bench: Bench) -> None:
    outcome = PlanOutcome(None, {"feasible": True, "kv_cache_tokens": 1952}, predicted_kv_tokens=1952)
    preflight = bench.preflight(plan=lambda _params: outcome)
    step = preflight.step(0.0)
    assert step.clear and preflight.plan is outcome
    (plan,) = [r for r in step.records if r["event"] == "preflight.plan"]
    assert plan["kv_cache_tokens"] == 1952 and plan["params"] == EngineParams(max_model_len=4096)


def test_a_plan_asked_by_the_changes_owner_is_used_and_journaled_not_asked_again(bench: Bench) -> None:
    # Issue 20: a trial asked the planner in its planning step, then the start's preflight asked again.
    def asked(params: EngineParams) -> PlanOutcome:
        bench.plans.append(params)
        return PlanOutcome(None, {"feasible": True})

    known = PlanOutcome(None, {"feasible": True, "kv_cache_tokens": 1952}, predicted_kv_tokens=1952)
    preflight = bench.preflight(plan=asked, known=known)
    step = preflight.step(0.0)
    assert step.clear and preflight.plan is known and bench.plans == []
    (plan,) = [r for r in step.records if r["event"] == "preflight.plan"]
    assert plan["kv_cache_tokens"] == 1952


def test_a_planner_that_raises_does_not_stop_the_start(bench: Bench) -> None:
    def broken(_params: EngineParams) -> PlanOutcome:
        raise RuntimeError("boom")

    preflight = bench.preflight(plan=broken)
    assert preflight.step(0.0).clear
    assert preflight.plan == PlanOutcome(None, {"planner": "no plan: RuntimeError: boom"})


# -- the port ------------------------------------------------------------------------------------------


@pytest.fixture
def held_port(bench: Bench) -> Iterator[socket.socket]:
    holder = socket.socket()
    holder.bind((bench.config.engine.host, bench.config.engine.port))
    holder.listen()
    try:
        yield holder
    finally:
        holder.close()


def test_a_held_port_makes_the_start_wait_and_names_its_holder(
    bench: Bench, held_port: socket.socket
) -> None:
    port = bench.config.engine.port
    jobs = HeldJobs()
    preflight = bench.preflight(submit=jobs)
    preflight.step(0.9)
    jobs.run_all()  # the foreign-engine scan
    step = preflight.step(1.0)
    assert step.reason == f"port {port} is held (finding out by whom)"
    jobs.run_all()
    step = preflight.step(1.1)
    # The holder here is this very process, as when export.port = 0 drew vLLM's port (CI, stop 26).
    assert step.reason == (
        f"port {port} is held by this tunerd (pid {os.getpid()}: one of its own listeners; "
        "give vLLM another port)"
    )
    assert waits(step) == ["port"]

    held_port.close()
    assert preflight.step(1.2).clear


# -- leftovers --------------------------------------------------------------------------------------------


def test_leftovers_of_an_earlier_run_are_stopped_before_the_start(bench: Bench) -> None:
    leftover = bench.os.add_leftover({MARKER_ENV: MARKER})
    stranger = bench.os.add_leftover({MARKER_ENV: "another-tunerd"})
    preflight = bench.preflight()
    step = preflight.step(0.0)
    assert not step.clear and step.reason == "stopping 1 leftover engine process(es)"
    assert [r["event"] for r in step.records] == ["leftover.found", "preflight.waiting"]
    assert bench.os.processes[leftover].signals == [signal.SIGTERM]
    assert bench.os.processes[stranger].signals == []  # not ours: never touched

    step = preflight.step(0.1)
    assert step.clear
    (reaped,) = [r for r in step.records if r["event"] == "leftover.reaped"]
    assert reaped["sigkill"] is False and list(reaped["pids"]) == [leftover]


def test_a_leftover_that_ignores_sigterm_is_killed_after_the_graceful_timeout(bench: Bench) -> None:
    leftover = bench.os.add_leftover({MARKER_ENV: MARKER})
    bench.os.processes[leftover].script = EngineScript(ignores_sigterm=True)
    preflight = bench.preflight()
    preflight.step(0.0)
    assert preflight.step(9.9).reason == "waiting for 1 leftover engine process(es) to exit"
    preflight.step(10.0)
    assert bench.os.processes[leftover].signals == [signal.SIGTERM, signal.SIGKILL]
    step = preflight.step(10.1)
    assert step.clear
    assert [r["sigkill"] for r in step.records if r["event"] == "leftover.reaped"] == [True]


# -- through the lifecycle ---------------------------------------------------------------------------------


def refuse_plans(rig: Rig, reason: str = "weights 9.00 GiB do not fit in 4.00 GiB") -> None:
    # Lifecycle builds its Capacity itself: there is no seam to hand it a planner.
    rig.lifecycle.capacity.check = lambda _params: PlanOutcome(reason, {"feasible": False})  # type: ignore[method-assign]


def test_a_refused_plan_fails_the_start_without_a_spawn(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    refuse_plans(rig)
    rig.lifecycle.guards.gpu = GpuFacts()
    rig.schedule_first_start()
    rig.step()
    assert rig.os.spawns == []
    refused = rig.last("engine.start_refused")
    assert refused["failure"] == {"kind": "plan_refused", "detail": "weights 9.00 GiB do not fit in 4.00 GiB"}
    (start,) = rig.intents("start")
    outcome = rig.last("outcome")
    assert outcome["intent"] == start["seq"] and outcome["result"] == "failed"
    assert rig.state is EngineState.FATAL
    assert rig.restarts("plan_refused") == 1.0
    rig.step(3600.0)
    assert rig.os.spawns == []


def test_a_refused_plan_rolls_back_to_a_different_known_good(tmp_path: Path) -> None:
    state = DaemonState(last_known_good={"max_model_len": 2048}, base_params={"max_model_len": 8192})
    rig = make_rig(tmp_path, {"engine": {"params": {"max_model_len": 4096}}}, dstate=state)
    refuse_plans(rig)
    rig.lifecycle.guards.gpu = GpuFacts()
    rig.schedule_first_start()
    rig.step()
    assert rig.intents("rollback")[-1]["params"] == {"max_model_len": 2048}


def test_a_restart_waits_for_memory_to_come_back_then_starts(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.serve()
    assert rig.dstate.baseline == {
        "baseline_available_bytes": 60 * GIB,
        "tolerance_bytes": 3 * GIB,
        "baseline_gpu_free_bytes": None,
    }
    write_meminfo(rig.proc, 50)  # the old engine's memory is still on its way back
    rig.lifecycle.restart(rig.lifecycle.params, "operator restart")
    rig.settle()
    assert rig.state is EngineState.STOPPED and len(rig.os.spawns) == 1
    assert rig.lifecycle.waiting_reason is not None
    assert rig.lifecycle.status_line().startswith("engine STOPPED: start delayed: memory not returned yet")
    rig.step(5.0)
    assert len(rig.os.spawns) == 1
    write_meminfo(rig.proc, 58)
    rig.step(1.0)
    assert len(rig.os.spawns) == 2 and rig.state is EngineState.STARTING
    assert rig.lifecycle.waiting_reason is None
    assert len(rig.records("preflight.waiting")) == 1


def test_a_retry_held_past_max_wait_fails_as_preflight_and_backs_off_further(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {"preflight": {"max_wait_s": 30.0}})
    run = rig.serve()
    write_meminfo(rig.proc, 20)
    rig.os.kill(run.pid)
    rig.step()
    rig.settle()
    rig.step(10.0)  # the retry is due, the preflight holds it
    assert len(rig.os.spawns) == 1 and rig.lifecycle.waiting_reason is not None
    rig.step(30.0)
    assert rig.records("engine.start_refused") == []
    rig.step(0.5)
    refused = rig.last("engine.start_refused")
    assert refused["failure"]["kind"] == "preflight"
    assert refused["failure"]["detail"].startswith("waited 30 s: memory not returned yet")
    assert rig.restarts("preflight") == 1.0
    backoff = rig.last("engine.backoff")
    assert (backoff["action"], backoff["delay_s"], backoff["failures"]) == ("retry", 20.0, 2)
    assert rig.state is EngineState.BACKOFF and len(rig.os.spawns) == 1
