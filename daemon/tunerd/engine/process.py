"""The vLLM child: spawn, watch, stop, reap — an explicit state machine driven by the main loop.

`Engine` owns at most one `EngineRun` (one spawned process tree). It has no threads and never sleeps:
the supervisor calls `poll(now)` every tick and gets back what happened (log events, the exit, the
tree gone); it decides what to do and calls `spawn`, `mark_ready`, `begin_stop`, `settle`. Every state
change goes through `_change_state`, which checks the transition table and tells the listener.

Stopping follows gunicorn/supervisor: SIGTERM to the process group, wait the grace the caller chose,
SIGKILL the group, reap (`stopper.Escalation`). vLLM's processes share one group (fixture
ok_start.json); a process that left the group is still found by tunerd's marker in its environment, so
no process of the tree survives. Only the engine's own group is reaped (`OsCalls.reap_group`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tunerd.core.exits import ExitStatus
from tunerd.core.failures import EngineFailure, FailureKind, more_specific
from tunerd.core.machine import MachineFacts
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState, check_transition
from tunerd.engine.logfiles import BoundedLogFollower, LogCap, prune_runs
from tunerd.engine.logwatch import (
    CaptureSizes,
    InitEngineTook,
    KvCacheSize,
    LogEvent,
    LogFollower,
    StartReportReader,
    classify_line,
)
from tunerd.engine.oscalls import SIGKILL, SIGTERM, OsCalls
from tunerd.engine.stopper import Escalation

MARKER_ENV = "TUNERD_INSTANCE"


@dataclass
class EngineRun:
    """One spawned vLLM process tree and what has been learned about it."""

    run_id: int
    pid: int  # the API server; also the process-group id (new session)
    params: EngineParams
    argv: list[str]
    log_path: Path
    started_mono: float
    started_wall: datetime
    follower: LogFollower
    ready_mono: float | None = None
    exit: ExitStatus | None = None
    failure: EngineFailure | None = None
    kv_cache: KvCacheSize | None = None
    init_seconds: float | None = None
    stop_reason: str | None = None
    stop: Escalation | None = None  # set once the stop began
    health_failures: int = 0
    base_url: str = ""  # where this run's vLLM listens (set by the supervisor at spawn)
    predicted_kv_tokens: int | None = None  # the planner's prediction for this start
    # The batch sizes vLLM captured CUDA graphs for (its config line; empty: none; None: not logged).
    capture_sizes: tuple[int, ...] | None = None
    machine: MachineFacts | None = None  # what the start's plan was made against (for the calibration)
    tail: list[str] = field(default_factory=list)
    report: StartReportReader = field(default_factory=StartReportReader)  # fed until it serves

    @property
    def pgid(self) -> int:
        return self.pid

    @property
    def kill_sent(self) -> bool:
        return self.stop is not None and self.stop.killed

    def uptime(self, now: float) -> float:
        return now - (self.ready_mono if self.ready_mono is not None else self.started_mono)


@dataclass(frozen=True, slots=True)
class Exited:
    """The API server (main process) exited and was reaped."""

    status: ExitStatus


@dataclass(frozen=True, slots=True)
class TreeGone:
    """After a stop: no process of the group, and none carrying the marker, is left."""

    killed: bool  # SIGKILL was needed
    seconds: float  # from the stop's start
    survivors: tuple[int, ...] = ()  # still there KILL_WAIT_S after SIGKILL (e.g. stuck in D state)


EngineEvent = LogEvent | Exited | TreeGone

TransitionListener = Callable[[EngineState, EngineState, "EngineRun | None"], None]


class Engine:
    """State machine around the current run. Single-threaded: only the main loop calls it."""

    TAIL_LINES = 40  # last output lines kept as evidence for the journal
    TICK_S = 0.1  # how often a stop in progress wants looking at

    def __init__(
        self,
        *,
        oscalls: OsCalls,
        marker: str,
        log_dir: Path,
        logs_kept: int,
        on_transition: TransitionListener,
        log_cap: LogCap | None = None,
    ) -> None:
        self.os = oscalls
        self.marker = marker
        self.log_dir = log_dir
        self.logs_kept = logs_kept  # runs whose logs are kept, this one included
        self.log_cap = log_cap  # None: the log of a run is not bounded
        self.state = EngineState.STOPPED
        self.run: EngineRun | None = None
        self._on_transition = on_transition
        self._next_run_id = 1

    # -- transitions ---------------------------------------------------------------------------

    def _change_state(self, new: EngineState) -> None:
        old = self.state
        check_transition(old, new)
        self.state = new
        self._on_transition(old, new, self.run)

    def enter(self, new: EngineState) -> None:
        """A transition that involves no process (BACKOFF → STOPPED, → FATAL, FATAL → STOPPED)."""
        self._change_state(new)

    # -- starting ------------------------------------------------------------------------------

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        params: EngineParams,
        now: float,
        wall: datetime,
    ) -> EngineRun:
        """Start the child; STOPPED/BACKOFF/FATAL → STARTING. Raises OSError when it cannot start."""
        run_id = self._next_run_id
        self._next_run_id += 1
        log_path = self._new_log_path(wall, run_id)
        child_env = {**env, MARKER_ENV: self.marker}
        pid = self.os.spawn(argv, child_env, str(log_path))
        self.run = EngineRun(
            run_id=run_id,
            pid=pid,
            params=params,
            argv=list(argv),
            log_path=log_path,
            started_mono=now,
            started_wall=wall,
            follower=self._follower(log_path),
        )
        self._change_state(EngineState.STARTING)
        return self.run

    def _follower(self, log_path: Path) -> LogFollower:
        if self.log_cap is None:
            return LogFollower(log_path)
        return BoundedLogFollower(log_path, self.log_cap)

    def _new_log_path(self, wall: datetime, run_id: int) -> Path:
        """engine-<time>-<run>.log under the log dir; `engine.log` links to it; the logs of runs
        beyond `logs_kept` (with their rotated copies) pruned."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"engine-{wall.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{run_id}.log"
        link = self.log_dir / "engine.log"
        tmp_link = self.log_dir / ".engine.log.tmp"
        try:
            tmp_link.unlink(missing_ok=True)
            tmp_link.symlink_to(path.name)
            tmp_link.replace(link)
        except OSError:
            pass  # the link is a convenience for operators
        prune_runs(self.log_dir, self.logs_kept - 1)
        return path

    def mark_ready(self, now: float) -> None:
        """STARTING → RUNNING (the caller saw /health answer 200)."""
        assert self.run is not None
        self.run.ready_mono = now
        self._change_state(EngineState.RUNNING)

    # -- watching ------------------------------------------------------------------------------

    def poll(self, now: float) -> list[EngineEvent]:
        """Read new output, reap exited children of the engine's group, escalate a stop past its grace.

        Returns what happened since the last call, in order. Log events are returned in every state
        (the caller decides whether a fatal line matters; during STOPPING it does not: vLLM 0.32 prints
        EngineDeadError even on a clean SIGTERM stop, fixture ok_start.log).
        """
        run = self.run
        events: list[EngineEvent] = []
        if run is None:
            return events
        events.extend(self._read_output(run, final=False))
        for pid, status in self.os.reap_group(run.pgid):
            if pid == run.pid and run.exit is None:
                run.exit = status
                events.extend(self._read_output(run, final=True))
                events.append(Exited(status))
        if self.state is EngineState.STOPPING:
            assert run.stop is not None
            alive = self.tree_pids() or ([] if run.exit is not None else [run.pid])
            progress = run.stop.step(now, alive)
            if progress.send_kill:
                self._signal_tree(SIGKILL)
            if progress.done:
                events.append(TreeGone(progress.killed, progress.elapsed, progress.survivors))
        return events

    def _read_output(self, run: EngineRun, *, final: bool) -> list[LogEvent]:
        lines = run.follower.read_rest() if final else run.follower.read_lines()
        events: list[LogEvent] = []
        starting = run.ready_mono is None
        for line in lines:
            if starting:
                run.report.feed(line)
            event = classify_line(line)
            if event is None:
                continue
            if isinstance(event, KvCacheSize):
                run.kv_cache = event
            elif isinstance(event, InitEngineTook):
                run.init_seconds = event.seconds
            elif isinstance(event, CaptureSizes):
                run.capture_sizes = event.sizes
            events.append(event)
        if lines:
            run.tail = (run.tail + lines)[-self.TAIL_LINES :]
        return events

    def note_failure(self, failure: EngineFailure) -> EngineFailure:
        """Record a failure for the current run; returns the one that stands (the most specific)."""
        assert self.run is not None
        self.run.failure = more_specific(self.run.failure, failure)
        return self.run.failure

    # -- stopping ------------------------------------------------------------------------------

    def begin_stop(self, now: float, reason: str, grace_s: float) -> None:
        """STARTING/RUNNING → STOPPING: SIGTERM to the group (and marked strays); SIGKILL after `grace_s`.

        Idempotent: a stop already under way keeps its reason; a shorter grace shortens it.
        """
        run = self.run
        assert run is not None
        if self.state is EngineState.STOPPING:
            assert run.stop is not None
            run.stop.hasten(grace_s)
            return
        run.stop_reason = reason
        run.stop = Escalation(now, grace_s)
        self._signal_tree(SIGTERM)
        self._change_state(EngineState.STOPPING)

    def settle(self, new: EngineState) -> EngineRun:
        """STOPPING → STOPPED / BACKOFF / FATAL once the tree is gone. Returns the finished run."""
        run = self.run
        assert run is not None and self.state is EngineState.STOPPING
        self._change_state(new)
        self.run = None
        self.os.reap_group(run.pgid)  # a process of the group that died since the last look
        return run

    def tree_pids(self) -> list[int]:
        """Live processes of the current run: its group plus any process carrying the marker."""
        if self.run is None:
            return []
        pids = set(self.os.group_pids(self.run.pgid))
        pids.update(self.os.marked_pids(MARKER_ENV, self.marker))
        return sorted(pids)

    def kill_tree(self) -> None:
        """SIGKILL the current run's group and marked strays now (last resort; no state change)."""
        self._signal_tree(SIGKILL)

    def _signal_tree(self, sig: int) -> None:
        assert self.run is not None
        self.os.signal_group(self.run.pgid, sig)
        for pid in self.os.marked_pids(MARKER_ENV, self.marker):
            self.os.signal_pid(pid, sig)


def failure_from_exit(status: ExitStatus, *, phase: EngineState) -> EngineFailure:
    """The failure an unexpected exit stands for when no log line said more."""
    if status.signal is not None:
        return EngineFailure(FailureKind.KILLED, status.describe())
    detail = status.describe()
    if status.code == 0:
        # fixture engine_killed_run2: after its engine core dies, vLLM's API server exits with 0.
        detail += f" while {phase.name} (not a clean stop: vLLM exits 0 when its engine core dies)"
    return EngineFailure(FailureKind.EXITED, detail)
