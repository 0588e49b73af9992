"""The lifecycle in-process: the crash-loop breaker, known-good promotion, the stop graces and the
guards that run while vLLM serves — a real Lifecycle, Journal and Metrics over fake processes and a
fake clock."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fakes import (
    BAD_MODEL_LINE,
    ENGINE_DEAD_LINE,
    GIB,
    KV_TOO_SMALL_LINE,
    EngineScript,
    Rig,
    fixed_wall,
    make_rig,
)
from tunerd.core.machine import MemoryReading
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.observe.gpu import GpuSample
from tunerd.observe.health import HealthResult
from tunerd.observe.poller import PollSample
from tunerd.observe.vllm_metrics import EngineSample, ScrapeResult
from tunerd.records.state import DaemonState
from tunerd.supervise.lifecycle import Lifecycle

S = EngineState
TERM, KILL = signal.SIGTERM, signal.SIGKILL
PARAMS_4096 = {"engine": {"params": {"max_model_len": 4096}}}


def crash_start(rig: Rig, code: int = 1) -> None:
    """The run now starting exits by itself; the lifecycle stops the rest and decides."""
    assert rig.state is S.STARTING
    rig.os.exit(rig.run.pid, code)
    rig.step()
    rig.settle()


def backoffs(rig: Rig) -> list[tuple[str, float, int]]:
    return [(r["action"], r["delay_s"], r["failures"]) for r in rig.records("engine.backoff")]


# -- the crash-loop breaker ----------------------------------------------------------------------------


def test_consecutive_start_failures_back_off_10_then_20_s_then_go_fatal(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.start()
    crash_start(rig)
    assert backoffs(rig) == [("retry", 10.0, 1)]
    rig.step(9.9)
    assert len(rig.os.spawns) == 1
    rig.step(0.1)
    assert len(rig.os.spawns) == 2

    crash_start(rig)
    assert backoffs(rig)[-1] == ("retry", 20.0, 2)
    rig.step(19.9)
    assert len(rig.os.spawns) == 2
    rig.step(0.1)
    assert len(rig.os.spawns) == 3

    crash_start(rig)
    assert rig.state is S.FATAL
    assert len(rig.records("engine.backoff")) == 2
    fatal = rig.last("engine.fatal")["reason"]
    assert fatal.startswith("exited: 3 consecutive failures; last error: exited with code 1")
    assert rig.lifecycle.fatal_reason == fatal
    assert rig.restarts("exited") == 3.0


def test_fatal_starts_nothing_however_far_the_clock_moves(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {"backoff": {"max_failures": 1}})
    rig.start()
    crash_start(rig)
    assert rig.state is S.FATAL
    spawned, written, sent = len(rig.os.spawns), len(rig.records()), len(rig.os.sent)
    for _ in range(1000):
        rig.step(3600.0)
    assert rig.state is S.FATAL
    assert len(rig.os.spawns) == spawned  # no spawn call, ever
    assert len(rig.records()) == written  # and no journal spin either
    assert len(rig.os.sent) == sent
    assert rig.lifecycle.pending is None


def test_resume_leaves_fatal_and_starts_with_a_fresh_failure_count(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {"backoff": {"max_failures": 1}})
    rig.start()
    crash_start(rig)
    assert rig.state is S.FATAL and rig.lifecycle.failures == 1
    assert rig.dstate.baseline is not None
    assert rig.lifecycle.resume("operator resume")
    assert rig.lifecycle.failures == 0 and rig.lifecycle.fatal_reason is None
    assert rig.dstate.baseline is None  # measured afresh
    rig.step()
    assert rig.state is S.STARTING and len(rig.os.spawns) == 2
    assert rig.lifecycle.resume("again") is False  # only FATAL can be resumed


def test_after_max_failures_it_rolls_back_to_last_known_good_then_goes_fatal(tmp_path: Path) -> None:
    # The operator edited [engine.params] since the known-good set: the config's run first.
    state = DaemonState(last_known_good={"max_model_len": 2048}, base_params={"max_model_len": 8192})
    rig = make_rig(tmp_path, PARAMS_4096, dstate=state)
    rig.start()
    assert rig.os.spawns[0].argv[-2:] == ["--max-model-len", "4096"]
    for delay in (10.0, 20.0):
        crash_start(rig)
        rig.step(delay)
    crash_start(rig)  # third failure: roll back at once
    assert backoffs(rig)[-1] == ("rollback", 0.0, 0)
    (rollback,) = rig.intents("rollback")
    assert rollback["params"] == {"max_model_len": 2048}
    assert rollback["params_before"] == {"max_model_len": 4096}
    assert rig.state is S.STARTING
    assert rig.os.spawns[-1].argv[-2:] == ["--max-model-len", "2048"]

    for delay in (10.0, 20.0):  # the known-good set fails too: nothing left to roll back to
        crash_start(rig)
        rig.step(delay)
    crash_start(rig)
    assert rig.state is S.FATAL
    assert len(rig.intents("rollback")) == 1
    assert rig.last("engine.fatal")["params"] == {"max_model_len": 2048}
    assert len(rig.os.spawns) == 6
    assert rig.restarts("exited") == 6.0


def test_an_unfixable_failure_goes_fatal_without_a_retry(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.os.scripts.append(EngineScript(lines=(BAD_MODEL_LINE,)))
    run = rig.start()
    rig.step()
    failed = rig.last("engine.failed")
    assert failed["phase"] == "starting" and failed["failure"]["kind"] == "model_not_found"
    assert rig.os.group_signals(run.pgid) == [TERM]
    rig.settle()
    assert rig.state is S.FATAL
    assert rig.records("engine.backoff") == []
    reason = rig.last("engine.fatal")["reason"]
    assert reason == f"model_not_found: retrying cannot help; last error: {BAD_MODEL_LINE.strip()}"
    assert rig.restarts("model_not_found") == 1.0
    rig.step(3600.0)
    assert len(rig.os.spawns) == 1


def test_vllms_estimated_max_model_len_is_retried_at_once_as_a_correction(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, PARAMS_4096)
    rig.os.scripts.append(EngineScript(lines=(KV_TOO_SMALL_LINE,)))
    rig.start()
    rig.step()
    assert rig.last("engine.failed")["failure"]["estimated_max_model_len"] == 1920
    rig.settle()
    assert backoffs(rig) == [("correct", 0.0, 1)]
    (correct,) = rig.intents("correct")
    assert correct["params"] == {"max_model_len": 1920}
    assert correct["params_before"] == {"max_model_len": 4096}
    assert correct["after"] == "kv_cache_too_small"
    assert rig.state is S.STARTING
    assert rig.os.spawns[-1].argv[-2:] == ["--max-model-len", "1920"]
    assert rig.lifecycle.params == EngineParams(max_model_len=1920)
    assert rig.restarts("kv_cache_too_small") == 1.0
    assert len(rig.background) == 1  # the refusal calibrates the planner (a worker job)


# -- known-good and the failure count ------------------------------------------------------------------


def test_parameters_that_served_known_good_after_s_become_last_known_good(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, PARAMS_4096)
    rig.serve()
    rig.step(59.9)
    assert rig.records("known_good.updated") == []
    rig.step(0.1)
    assert rig.last("known_good.updated")["params"] == {"max_model_len": 4096}
    assert rig.lifecycle.known_good == EngineParams(max_model_len=4096)
    saved, _ = rig.store.load()
    assert saved.last_known_good == {"max_model_len": 4096}
    assert saved.base_params == {"max_model_len": 4096}
    rig.step(600.0)
    assert len(rig.records("known_good.updated")) == 1  # said once


def test_serving_known_good_after_s_forgets_earlier_failures(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, PARAMS_4096)
    rig.start()
    crash_start(rig)
    rig.step(10.0)
    crash_start(rig)
    rig.step(20.0)
    assert rig.lifecycle.failures == 2
    rig.step()
    rig.health(True)
    rig.step(60.0)
    assert rig.lifecycle.failures == 0
    rig.os.kill(rig.run.pid)
    rig.step()
    rig.settle()
    assert backoffs(rig)[-1] == ("retry", 10.0, 1)  # not the third failure in a row


@pytest.mark.parametrize(("served_s", "expected"), [(100.0, ("retry", 10.0, 1)), (99.0, None)])
def test_a_run_that_served_reset_after_s_resets_the_failure_count(
    tmp_path: Path, served_s: float, expected: tuple[str, float, int] | None
) -> None:
    # known_good_after_s above reset_after_s: only the policy's reset can forgive the failures.
    rig = make_rig(tmp_path, {"backoff": {"reset_after_s": 100.0, "known_good_after_s": 1000.0}})
    rig.start()
    crash_start(rig)
    rig.step(10.0)
    crash_start(rig)
    rig.step(20.0)
    rig.health(True)
    rig.step(served_s)
    rig.os.exit(rig.run.pid, 0)
    rig.step()
    rig.settle()
    if expected is None:
        assert rig.state is S.FATAL  # 99 s was not enough: the third failure in a row
    else:
        assert backoffs(rig)[-1] == expected


# -- how long a stop waits between SIGTERM and SIGKILL -------------------------------------------------


def stubborn(rig: Rig) -> None:
    rig.os.scripts.append(EngineScript(ignores_sigterm=True))


GRACES = {"timeouts": {"graceful_stop_s": 30.0, "unready_stop_s": 5.0}, "guard": {"emergency_grace_s": 2.0}}


def assert_killed_after(rig: Rig, grace: float) -> None:
    pgid = rig.run.pgid
    assert rig.os.group_signals(pgid) == [TERM]
    rig.step(grace - 0.1)
    assert rig.os.group_signals(pgid) == [TERM]
    rig.step(0.1)
    assert rig.os.group_signals(pgid) == [TERM, KILL]
    rig.settle()
    stopped = rig.last("engine.stopped")
    assert stopped["sigkill"] is True and stopped["seconds"] == pytest.approx(grace + 0.1)


def low_memory(available_gib: float = 1.0) -> MemoryReading:
    return MemoryReading(64 * GIB, int(available_gib * GIB), None, None)


def test_a_memory_emergency_stops_with_the_emergency_grace(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, GRACES)
    stubborn(rig)
    rig.serve()
    rig.lifecycle.on_memory(low_memory(2.5), rig.now)  # above the 2 GiB floor: nothing
    assert rig.records("guard.memory_emergency") == [] and rig.state is S.RUNNING
    rig.lifecycle.on_memory(low_memory(1.0), rig.now)
    emergency = rig.last("guard.memory_emergency")
    assert emergency["reason"] == "MemAvailable 1.00 GiB below the floor of 2.00 GiB"
    assert emergency["mem_available_bytes"] == GIB and emergency["mem_total_bytes"] == 64 * GIB
    assert rig.last("engine.failed")["failure"]["kind"] == "memory_emergency"
    assert_killed_after(rig, 2.0)
    assert rig.last("engine.stopped")["reason"] == "memory_emergency"
    assert rig.restarts("memory_emergency") == 1.0


def test_pressure_above_the_ceiling_is_an_emergency_too(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, GRACES)
    rig.serve()
    rig.lifecycle.on_memory(MemoryReading(64 * GIB, 30 * GIB, 90.0, 75.0), rig.now)
    assert rig.last("guard.memory_emergency")["reason"] == "memory pressure full avg10 75.0% above 60.0%"
    assert rig.state is S.STOPPING


def test_an_engine_that_never_served_is_stopped_with_the_unready_grace(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {**GRACES, "timeouts": {**GRACES["timeouts"], "startup_s": 60.0}})
    stubborn(rig)
    rig.start()
    rig.step(60.0)
    assert rig.state is S.STARTING  # the budget is not over yet
    rig.step(0.1)
    failed = rig.last("engine.failed")
    assert failed["failure"] == {"kind": "startup_timeout", "detail": "no /health 200 in 60 s"}
    assert_killed_after(rig, 5.0)


def test_a_serving_engine_is_stopped_with_the_graceful_timeout(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, GRACES)
    stubborn(rig)
    rig.serve()
    assert rig.lifecycle.restart(rig.lifecycle.params, "operator restart")
    assert_killed_after(rig, 30.0)
    assert rig.last("engine.stopped")["reason"] == "restart"


def test_a_serving_engine_whose_core_died_has_nothing_to_drain(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, GRACES)
    stubborn(rig)
    run = rig.serve()
    rig.os.write_log(run.pid, ENGINE_DEAD_LINE)
    rig.step()
    assert rig.last("engine.failed")["failure"]["kind"] == "engine_dead"
    assert_killed_after(rig, 5.0)


def test_survivors_of_the_kill_are_journaled_with_the_stop(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, GRACES)
    rig.os.scripts.append(EngineScript(ignores_sigterm=True, survives_sigkill=True))
    run = rig.serve()
    rig.lifecycle.shutdown()
    rig.step(30.0)
    rig.step(9.9)
    assert rig.records("engine.stopped") == []
    rig.step(0.1)
    stopped = rig.last("engine.stopped")
    assert stopped["survivors"] == sorted(p.pid for p in rig.os.tree(run.pid))
    assert stopped["sigkill"] is True
    assert rig.state is S.STOPPED


def test_a_memory_emergency_during_a_graceful_stop_shortens_the_grace(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, GRACES)
    stubborn(rig)
    rig.serve()
    assert rig.lifecycle.restart(rig.lifecycle.params, "operator restart")
    rig.step(1.0)
    rig.lifecycle.on_memory(low_memory(1.0), rig.now)
    rig.step(2.0)
    assert rig.os.group_signals(rig.run.pgid) == [TERM, KILL]


# -- the wedge guard -------------------------------------------------------------------------------------


def poll(rig: Rig, running: float | None, tokens: float | None, **readings: Any) -> None:
    scrape = ScrapeResult(
        EngineSample(requests_running=running, generation_tokens_total=tokens), None, 0.01, 1
    )
    sample = PollSample(
        rig.run.run_id, rig.now, scrape, None, GpuSample(False, "no NVML", rig.now), dict(readings)
    )
    rig.lifecycle.on_poll(sample, rig.now)


WEDGE = {"guard": {"wedge_after_s": 30.0}}


def test_requests_running_without_a_token_for_wedge_after_s_is_a_wedge(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, WEDGE)
    run = rig.serve()
    for _ in range(29):
        poll(rig, running=2, tokens=100)
        rig.step(1.0)
    poll(rig, running=2, tokens=100)  # 29 s stalled
    assert rig.records("guard.wedged") == [] and rig.state is S.RUNNING
    rig.step(1.0)
    poll(rig, running=2, tokens=100)
    wedged = rig.last("guard.wedged")
    assert wedged["running"] == 2 and wedged["generation_tokens_total"] == 100
    assert wedged["pid"] == run.pid
    assert wedged["reason"] == "2 request(s) running but generation_tokens_total stuck at 100 for 30 s"
    assert rig.last("engine.failed")["failure"]["kind"] == "wedged"
    assert rig.os.group_signals(run.pgid) == [TERM]
    rig.settle()
    assert rig.restarts("wedged") == 1.0
    assert rig.state is S.BACKOFF


def test_an_idle_engine_is_never_wedged(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, WEDGE)
    run = rig.serve()
    for _ in range(300):
        poll(rig, running=0, tokens=100)
        rig.step(1.0)
    assert rig.records("guard.wedged") == []
    assert rig.os.group_signals(run.pgid) == []
    assert rig.state is S.RUNNING


def test_tokens_moving_is_progress(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, WEDGE)
    run = rig.serve()
    for second in range(120):
        poll(rig, running=4, tokens=100 + second)
        rig.step(1.0)
    assert rig.records("guard.wedged") == []
    assert rig.os.group_signals(run.pgid) == []


def test_a_poll_of_an_earlier_run_is_not_judged(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, WEDGE)
    rig.serve()
    stale = ScrapeResult(EngineSample(requests_running=2, generation_tokens_total=1), None, 0.01, 1)
    for _ in range(60):
        rig.lifecycle.on_poll(
            PollSample(rig.run.run_id + 1, rig.now, stale, None, GpuSample(False, None, rig.now), {}), rig.now
        )
        rig.step(1.0)
    assert rig.records("guard.wedged") == []


# -- health -------------------------------------------------------------------------------------------


def test_health_200_makes_a_starting_engine_running_and_closes_its_intent(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    run = rig.start()
    rig.step(3.0)  # the start-up lines are read
    rig.lifecycle.on_health(
        HealthResult(run.run_id + 1, True, "200"), rig.now
    )  # a late answer about another run
    assert rig.state is S.STARTING
    rig.health(True)
    ready = rig.last("engine.ready")
    assert ready["pid"] == run.pid and ready["seconds"] == 3.0 and ready["kv_cache_tokens"] == 1952
    assert ready["init_engine_s"] == 36.72
    (start,) = rig.intents("start")
    outcome = rig.last("outcome")
    assert outcome["intent"] == start["seq"] and outcome["result"] == "ok"
    assert rig.sample("tunerd_engine_kv_cache_tokens") == 1952.0
    assert len(rig.background) == 2  # the identity probe and the calibration, off the loop


def test_a_health_answer_before_the_next_look_at_the_log_still_reads_the_kv_cache_size(
    tmp_path: Path,
) -> None:
    # CI: the worker's /health answer reached the loop before its next poll of vLLM's log, and
    # engine.ready said kv_cache_tokens None while the line was on disk.
    rig = make_rig(tmp_path)
    run = rig.start()  # its start-up lines are written at spawn, not yet read by the loop
    rig.lifecycle.on_health(HealthResult(run.run_id, True, "200"), rig.now)
    ready = rig.last("engine.ready")
    assert ready["kv_cache_tokens"] == 1952 and ready["init_engine_s"] == 36.72


def test_repeated_health_failures_while_running_fail_the_run(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {"timeouts": {"health_failures": 3}})
    rig.serve()
    rig.health(False)
    rig.health(False)
    rig.health(True)  # the count starts again
    rig.health(False)
    rig.health(False)
    assert rig.state is S.RUNNING
    rig.health(False)
    assert rig.last("engine.failed")["failure"] == {
        "kind": "health_failed",
        "detail": "/health failed 3 times in a row (last: 503)",
    }
    assert rig.state is S.STOPPING


def test_a_death_the_health_probe_sees_before_the_reap_is_called_by_its_exit(tmp_path: Path) -> None:
    # CI: the server was SIGKILLed, the /health answer reached the loop before its next reap, and the
    # failure said "health_failed" instead of "killed" (the OOM killer's signature).
    rig = make_rig(tmp_path, {"timeouts": {"health_failures": 1}})
    rig.serve()
    rig.os.kill(rig.run.pid)
    rig.health(False)
    failure = rig.last("engine.failed")["failure"]
    assert failure["kind"] == "killed", failure


def test_a_known_good_of_the_default_parameters_survives_a_daemon_restart(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.serve()
    rig.step(60.0)
    assert rig.lifecycle.known_good == EngineParams()
    saved, _ = rig.store.load()
    again = Lifecycle(
        rig.config,
        oscalls=rig.os,
        recorder=rig.recorder,
        store=rig.store,
        dstate=saved,
        metrics=rig.metrics,
        on_status_change=lambda: None,
        background=rig.background.append,
        post=rig.posted.append,
        monotonic=rig.clock,
        wallclock=fixed_wall,
    )
    assert again.known_good == EngineParams()
