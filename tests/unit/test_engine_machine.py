"""The engine state machine in-process: `Engine` over a fake process table, and every transition of
TRANSITIONS that the lifecycle reaches, with the processes and signals behind each."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.unit.fakes import (
    BAD_MODEL_LINE,
    BLOCK_SIZE_LINE,
    FIXED_WALL,
    EngineScript,
    FakeOsCalls,
    Rig,
    make_rig,
)
from tunerd.core.exits import ExitStatus
from tunerd.core.machine import GpuFacts
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState, InvalidTransition
from tunerd.engine.logwatch import InitEngineTook, KvCacheSize
from tunerd.engine.process import MARKER_ENV, Engine, EngineRun, Exited, TreeGone
from tunerd.engine.stopper import KILL_WAIT_S
from tunerd.records.state import DaemonState

S = EngineState
TERM, KILL = signal.SIGTERM, signal.SIGKILL


class EngineBench:
    """An `Engine` alone over the fake process table, its transitions recorded."""

    def __init__(self, tmp_path: Path) -> None:
        self.os = FakeOsCalls(str(tmp_path / "proc"))
        self.transitions: list[tuple[S, S]] = []
        self.engine = Engine(
            oscalls=self.os,
            marker="marker-1",
            log_dir=tmp_path / "logs",
            logs_kept=3,
            on_transition=lambda old, new, _run: self.transitions.append((old, new)),
        )

    def spawn(self, script: EngineScript | None = None, now: float = 100.0) -> EngineRun:
        if script is not None:
            self.os.scripts.append(script)
        return self.engine.spawn(["vllm", "serve"], {"PATH": "/bin"}, EngineParams(), now, FIXED_WALL)


@pytest.fixture
def bench(tmp_path: Path) -> EngineBench:
    return EngineBench(tmp_path)


# -- Engine alone ------------------------------------------------------------------------------------


def test_spawn_marks_the_child_and_reads_its_start_up_lines(bench: EngineBench) -> None:
    run = bench.spawn()
    assert bench.engine.state is S.STARTING
    assert bench.transitions == [(S.STOPPED, S.STARTING)]
    (spawn,) = bench.os.spawns
    assert spawn.env[MARKER_ENV] == "marker-1"
    assert spawn.log_path == str(run.log_path) and run.pgid == spawn.pid

    events = bench.engine.poll(100.5)
    assert events == [InitEngineTook(36.72), KvCacheSize(1952, 3.81, 512)]
    assert run.kv_cache == KvCacheSize(1952, 3.81, 512) and run.init_seconds == 36.72
    assert bench.engine.tree_pids() == list(spawn.tree)


def test_a_clean_stop_is_sigterm_to_the_group_then_tree_gone_then_settled(bench: EngineBench) -> None:
    run = bench.spawn()
    bench.engine.mark_ready(101.0)
    bench.engine.begin_stop(110.0, "test", grace_s=30.0)
    assert bench.os.sent == [("group", run.pgid, TERM)]
    assert bench.engine.state is S.STOPPING

    events = bench.engine.poll(110.1)
    assert Exited(ExitStatus(code=0, signal=None)) in events
    assert events[-1] == TreeGone(killed=False, seconds=pytest.approx(0.1), survivors=())
    finished = bench.engine.settle(S.STOPPED)
    assert finished is run and bench.engine.run is None
    assert not any(p.alive for p in bench.os.processes.values())
    assert bench.transitions == [
        (S.STOPPED, S.STARTING),
        (S.STARTING, S.RUNNING),
        (S.RUNNING, S.STOPPING),
        (S.STOPPING, S.STOPPED),
    ]


@pytest.mark.parametrize(
    ("old", "new"),
    [(S.STOPPED, S.RUNNING), (S.BACKOFF, S.RUNNING), (S.STOPPED, S.STOPPING), (S.FATAL, S.RUNNING)],
    ids=lambda s: s.name,
)
def test_an_illegal_transition_raises_and_changes_nothing(bench: EngineBench, old: S, new: S) -> None:
    bench.engine.state = old
    with pytest.raises(InvalidTransition, match=f"{old.name} -> {new.name}"):
        bench.engine.enter(new)
    assert bench.engine.state is old
    assert bench.transitions == []


def test_running_cannot_go_back_to_starting(bench: EngineBench) -> None:
    bench.spawn()
    bench.engine.mark_ready(101.0)
    with pytest.raises(InvalidTransition, match="RUNNING -> STARTING"):
        bench.engine.enter(S.STARTING)
    assert bench.engine.state is S.RUNNING


# -- stop escalation ---------------------------------------------------------------------------------


def test_sigkill_follows_sigterm_once_the_grace_is_over(bench: EngineBench) -> None:
    run = bench.spawn(EngineScript(lines=(), ignores_sigterm=True))
    bench.engine.begin_stop(100.0, "test", grace_s=5.0)
    assert bench.engine.poll(104.9) == []
    assert bench.os.group_signals(run.pgid) == [TERM]
    assert bench.os.alive(run.pid)

    assert bench.engine.poll(105.0) == []  # the kill goes out now; the tree is reaped at the next look
    assert bench.os.group_signals(run.pgid) == [TERM, KILL]
    events = bench.engine.poll(105.1)
    assert Exited(ExitStatus(code=None, signal=KILL)) in events
    assert events[-1] == TreeGone(killed=True, seconds=pytest.approx(5.1), survivors=())
    assert run.kill_sent
    assert ExitStatus(None, KILL).describe(killed_by_us=run.kill_sent) == "killed by SIGKILL"


def test_processes_alive_after_the_kill_wait_are_reported_as_survivors(bench: EngineBench) -> None:
    run = bench.spawn(EngineScript(lines=(), ignores_sigterm=True, survives_sigkill=True, workers=2))
    bench.engine.begin_stop(100.0, "test", grace_s=2.0)
    bench.engine.poll(102.0)
    assert bench.engine.poll(102.0 + KILL_WAIT_S - 0.1) == []
    events = bench.engine.poll(102.0 + KILL_WAIT_S)
    survivors = tuple(sorted(p.pid for p in bench.os.tree(run.pid)))
    assert events == [TreeGone(killed=True, seconds=pytest.approx(2.0 + KILL_WAIT_S), survivors=survivors)]
    assert bench.os.group_signals(run.pgid) == [TERM, KILL]  # SIGKILL said once


def test_a_marked_process_outside_the_group_is_signalled_and_keeps_the_stop_open(bench: EngineBench) -> None:
    run = bench.spawn(EngineScript(lines=(), strays=1, ignores_sigterm=True))
    (stray,) = [p.pid for p in bench.os.tree(run.pid) if p.role == "stray"]
    bench.engine.begin_stop(100.0, "test", grace_s=30.0)
    assert bench.os.sent[0] == ("group", run.pgid, TERM)
    assert ("pid", stray, TERM) in bench.os.sent  # found by its marker, not its group
    assert bench.os.processes[stray].signals == [TERM]

    for proc in bench.os.tree(run.pid):
        if proc.role != "stray":
            bench.os.exit(proc.pid, 0)
    events = bench.engine.poll(101.0)
    assert Exited(ExitStatus(0, None)) in events
    assert not any(isinstance(e, TreeGone) for e in events)  # the stray still runs
    assert bench.engine.tree_pids() == [stray]

    bench.os.exit(stray, 0)
    assert bench.engine.poll(102.0) == [TreeGone(killed=False, seconds=pytest.approx(2.0), survivors=())]


def test_a_shorter_grace_hastens_a_stop_already_under_way(bench: EngineBench) -> None:
    run = bench.spawn(EngineScript(lines=(), ignores_sigterm=True))
    bench.engine.begin_stop(100.0, "planned", grace_s=30.0)
    bench.engine.begin_stop(100.5, "emergency", grace_s=2.0)
    assert run.stop_reason == "planned"
    assert bench.os.group_signals(run.pgid) == [TERM]  # no second SIGTERM
    bench.engine.poll(101.9)
    assert bench.os.group_signals(run.pgid) == [TERM]
    bench.engine.poll(102.0)
    assert bench.os.group_signals(run.pgid) == [TERM, KILL]


# -- the transitions the lifecycle makes -------------------------------------------------------------


def test_serve_then_shutdown_goes_stopped_starting_running_stopping_stopped(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    run = rig.serve()
    assert rig.sample("tunerd_engine_state") == S.RUNNING.value
    assert rig.sample("tunerd_engine_up") == 1.0
    rig.lifecycle.shutdown()
    rig.settle()
    assert rig.transitions == [
        (S.STOPPED, S.STARTING),
        (S.STARTING, S.RUNNING),
        (S.RUNNING, S.STOPPING),
        (S.STOPPING, S.STOPPED),
    ]
    assert rig.sample("tunerd_engine_state") == S.STOPPED.value
    assert rig.sample("tunerd_engine_up") == 0.0
    assert not any(p.alive for p in rig.os.tree(run.pid))
    assert rig.last("engine.stopped")["reason"] == "daemon shutdown"


def test_a_failure_during_start_stops_backs_off_and_starts_again(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.os.scripts.append(EngineScript(lines=(BLOCK_SIZE_LINE,)))
    first = rig.start()
    rig.step()  # the log line: engine.failed, SIGTERM
    assert rig.transitions[-1] == (S.STARTING, S.STOPPING)
    assert rig.os.group_signals(first.pgid) == [TERM]
    rig.settle()
    assert rig.transitions[-1] == (S.STOPPING, S.BACKOFF)
    assert rig.sample("tunerd_engine_state") == S.BACKOFF.value

    rig.step(9.9)
    assert len(rig.os.spawns) == 1
    rig.step(0.1)
    assert len(rig.os.spawns) == 2
    assert rig.transitions[-1] == (S.BACKOFF, S.STARTING)


def test_a_crash_while_running_stops_the_rest_of_the_tree_and_backs_off(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    run = rig.serve()
    rig.os.exit(run.pid, 0)  # vLLM's API server exits 0 when its engine core dies
    rig.step()
    assert rig.transitions[-1] == (S.RUNNING, S.STOPPING)
    (worker,) = [p for p in rig.os.tree(run.pid) if p.role == "worker"]
    assert worker.signals == [TERM] and not worker.alive
    rig.settle()
    assert rig.transitions[-1] == (S.STOPPING, S.BACKOFF)
    assert rig.last("engine.failed")["failure"]["kind"] == "exited"


def test_an_unfixable_failure_ends_in_fatal(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.os.scripts.append(EngineScript(lines=(BAD_MODEL_LINE,)))
    rig.start()
    rig.step()
    rig.settle()
    assert rig.state is S.FATAL
    # TRANSITIONS allows STOPPING -> FATAL; the lifecycle passes through BACKOFF on its way.
    assert rig.transitions[-3:] == [(S.STARTING, S.STOPPING), (S.STOPPING, S.BACKOFF), (S.BACKOFF, S.FATAL)]
    assert rig.sample("tunerd_engine_state") == S.FATAL.value


def test_a_first_start_that_cannot_execute_goes_from_stopped_to_fatal(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.os.spawn_error = FileNotFoundError(2, "program 'vllm' not found on PATH", "vllm")
    rig.lifecycle.guards.gpu = GpuFacts()
    rig.schedule_first_start()
    rig.step()
    assert rig.transitions == [(S.STOPPED, S.FATAL)]
    failed = rig.last("engine.failed")
    assert failed["phase"] == "spawn" and failed["failure"]["kind"] == "spawn_failed"
    assert rig.last("engine.fatal")["reason"].startswith("spawn_failed: retrying cannot help")
    assert rig.os.spawns == []


def test_resume_leaves_fatal_through_stopped_and_starts(tmp_path: Path) -> None:
    rig = fatal_rig(tmp_path)
    assert rig.lifecycle.resume("operator resume")
    assert rig.transitions[-1] == (S.FATAL, S.STOPPED)
    rig.os.scripts.clear()
    rig.step()
    assert rig.transitions[-1] == (S.STOPPED, S.STARTING)
    assert len(rig.os.spawns) == 2
    assert rig.intents("start")[-1]["reason"] == "operator resume"


def test_an_operator_restart_in_backoff_goes_to_stopped_and_starts_at_once(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    run = rig.serve()
    rig.os.kill(run.pid)  # the OOM killer
    rig.step()
    rig.settle()
    assert rig.state is S.BACKOFF
    assert rig.lifecycle.restart(rig.lifecycle.params, "operator restart")
    assert rig.transitions[-1] == (S.BACKOFF, S.STOPPED)
    rig.step()  # no 10 s wait
    assert rig.transitions[-1] == (S.STOPPED, S.STARTING)
    assert len(rig.os.spawns) == 2


def test_a_planned_restart_of_a_serving_engine_stops_it_then_starts_the_new_parameters(
    tmp_path: Path,
) -> None:
    rig = make_rig(tmp_path)
    run = rig.serve()
    new = EngineParams(max_model_len=1024)
    assert rig.lifecycle.restart(new, "tuning trial", action="trial")
    assert rig.os.group_signals(run.pgid) == [TERM]
    rig.settle()
    assert rig.transitions[-4:] == [
        (S.STARTING, S.RUNNING),
        (S.RUNNING, S.STOPPING),
        (S.STOPPING, S.STOPPED),
        (S.STOPPED, S.STARTING),
    ]
    (trial,) = rig.intents("trial")
    assert trial["params"] == {"max_model_len": 1024} and trial["params_before"] == {}
    assert rig.os.spawns[-1].argv[-2:] == ["--max-model-len", "1024"]


def test_a_restart_in_fatal_goes_to_stopped(tmp_path: Path) -> None:
    rig = fatal_rig(tmp_path)
    assert rig.lifecycle.restart(EngineParams(max_model_len=1024), "config reload changed [engine]")
    assert rig.transitions[-1] == (S.FATAL, S.STOPPED)
    assert rig.lifecycle.fatal_reason is None


def test_a_first_start_whose_preflight_times_out_backs_off(tmp_path: Path) -> None:
    baseline = {
        "baseline_available_bytes": 60 << 30,
        "tolerance_bytes": 1 << 30,
        "baseline_gpu_free_bytes": None,
    }
    rig = make_rig(
        tmp_path, {"preflight": {"max_wait_s": 30.0}}, dstate=DaemonState(baseline=baseline), available_gib=20
    )
    rig.lifecycle.guards.gpu = GpuFacts()
    rig.schedule_first_start()
    rig.step()
    assert rig.lifecycle.waiting_reason is not None
    rig.step(30.1)  # the preflight gives up: a "preflight" failure, retried after the backoff
    assert rig.state is S.BACKOFF
    assert rig.transitions == [(S.STOPPED, S.BACKOFF)]


def fatal_rig(tmp_path: Path) -> Rig:
    rig = make_rig(tmp_path)
    rig.os.scripts.append(EngineScript(lines=(BAD_MODEL_LINE,)))
    rig.start()
    rig.step()
    rig.settle()
    assert rig.state is S.FATAL
    return rig
