"""The loop guard in-process: an exception in the main loop is journaled, the engine's tree is stopped
(never left unsupervised), and `run()` returns 70 — a real Supervisor over a fake process table."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fakes import FakeOsCalls, make_config, write_meminfo
from tunerd.core.states import EngineState
from tunerd.faces.systemd import Notifier
from tunerd.records.journal import Record, read_records
from tunerd.records.state import DaemonState, StateStore
from tunerd.supervisor import EX_SOFTWARE, Supervisor

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SAFETY_S = 30.0  # a loop that never crashes is shut down rather than left to hang the suite


@pytest.fixture(autouse=True)
def keep_signal_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in HANDLED}  # run() installs its own
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def make_supervisor(tmp_path: Path, export: dict[str, Any]) -> tuple[Supervisor, FakeOsCalls]:
    proc = tmp_path / "proc"
    write_meminfo(proc, 60)
    socket_path = f"/tmp/tunerd-lg-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    config = make_config(
        tmp_path,
        proc,
        {
            "paths": {"socket": socket_path},
            "export": export,
            "timeouts": {"graceful_stop_s": 2.0, "unready_stop_s": 1.0},
        },
    )
    config_path = tmp_path / "tunerd.toml"
    config_path.write_text("# the config is passed parsed; the path is only named\n")
    # What `vllm serve --help` would have shown: no capability probe (a subprocess) at run().
    caps = {"command": list(config.engine.command), "shutdown_timeout": False}
    StateStore(config.paths.state_file).save(DaemonState(capabilities=caps))
    fake = FakeOsCalls(str(proc))
    supervisor = Supervisor(config, str(config_path), oscalls=fake, notifier=Notifier({}))
    supervisor.setup()
    assert fake.subreaper
    return supervisor, fake


def explode_once_engine_runs(supervisor: Supervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = supervisor.lifecycle
    assert lifecycle is not None
    original = lifecycle.step

    def step(now: float) -> None:
        original(now)
        if lifecycle.engine.run is not None and lifecycle.engine.state is EngineState.STARTING:
            raise RuntimeError("step exploded")

    monkeypatch.setattr(lifecycle, "step", step)


def run_bounded(supervisor: Supervisor) -> int:
    safety = threading.Timer(SAFETY_S, lambda: supervisor.events.put(signal.SIGTERM))
    safety.daemon = True
    safety.start()
    try:
        return supervisor.run()
    finally:
        safety.cancel()


def journal(supervisor: Supervisor) -> list[Record]:
    return list(read_records(supervisor.config.paths.journal_path))


def only(records: list[Record], event: str) -> Record:
    (found,) = [r for r in records if r["event"] == event]
    return found


def test_an_exception_in_the_loop_stops_the_engine_journals_it_and_exits_70(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    supervisor, fake = make_supervisor(tmp_path, {"port": 0})
    assert supervisor.exporter is not None and supervisor.exporter.address[1] > 0
    explode_once_engine_runs(supervisor, monkeypatch)

    assert run_bounded(supervisor) == EX_SOFTWARE

    (spawn,) = fake.spawns
    records = journal(supervisor)
    events = [r["event"] for r in records]
    crashed = only(records, "daemon.crashed")
    assert crashed["error"] == "RuntimeError: step exploded"
    assert "step exploded" in crashed["traceback"]
    stopped = only(records, "engine.stopped")
    assert stopped["pid"] == spawn.pid and stopped["reason"] == "daemon crashed"
    assert stopped["sigkill"] is False and stopped["survivors"] == []
    assert events.index("engine.spawned") < events.index("daemon.crashed") < events.index("engine.stopped")
    assert "daemon.stopped" not in events  # not a clean shutdown
    assert fake.group_signals(spawn.pid) == [signal.SIGTERM]
    assert not any(p.alive for p in fake.tree(spawn.pid))
    assert not os.path.exists(supervisor.config.paths.socket_path)  # the faces were closed


def test_when_even_the_bounded_stop_fails_the_group_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    supervisor, fake = make_supervisor(tmp_path, {"enabled": False})
    explode_once_engine_runs(supervisor, monkeypatch)
    lifecycle = supervisor.lifecycle
    assert lifecycle is not None

    def broken_stop(_monotonic: Callable[[], float], sleep: Callable[[float], None]) -> None:
        raise OSError("the engine itself is what failed")

    monkeypatch.setattr(lifecycle, "stop_now", broken_stop)

    assert run_bounded(supervisor) == EX_SOFTWARE
    (spawn,) = fake.spawns
    assert fake.group_signals(spawn.pid) == [signal.SIGKILL]
    assert not any(p.alive for p in fake.tree(spawn.pid))
    assert only(journal(supervisor), "daemon.crashed")["error"] == "RuntimeError: step exploded"
