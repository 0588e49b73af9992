"""The recorder when the disk does not write: intents are None, errors are counted, no change of
parameters is made without a durable intent — and supervision goes on."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fakes import KV_TOO_SMALL_LINE, EngineScript, Rig, fixed_wall, make_rig
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.records.journal import Journal, JournalError, read_records
from tunerd.records.metrics import Metrics
from tunerd.records.recorder import Recorder

ERRORS = "tunerd_journal_write_errors_total"


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[Recorder]:
    journal = Journal(tmp_path / "journal.jsonl", clock=fixed_wall)
    journal.open()
    yield Recorder(journal, Metrics())
    journal.close()


class DiskFull:
    """Points the journal's open file at /dev/full (every write: ENOSPC) until `recover`."""

    def __init__(self, journal: Journal) -> None:
        self.fd = journal._fd  # Journal takes no opener: the only way at its file descriptor
        assert self.fd is not None
        self.saved = os.dup(self.fd)
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, self.fd)
        os.close(full)

    def recover(self) -> None:
        os.dup2(self.saved, self.fd)
        os.close(self.saved)


def errors(recorder: Recorder) -> float:
    return recorder.metrics.registry.get_sample_value(ERRORS) or 0.0


def test_a_full_disk_makes_intent_return_none_and_counts_the_error(recorder: Recorder) -> None:
    assert recorder.record("daemon.started") == 1
    full = DiskFull(recorder.journal)
    assert recorder.intent("trial", params=EngineParams(max_model_len=1024)) is None
    assert errors(recorder) == 1.0
    assert recorder.error is not None and "No space left on device" in recorder.error
    assert recorder.record("engine.failed") is None
    assert errors(recorder) == 2.0
    recorder.outcome(None, "ok")  # nothing to close: no write, no error
    assert errors(recorder) == 2.0

    full.recover()
    assert recorder.record("engine.ready") == 2  # the seq of the lost records was not used up
    assert recorder.error is None
    assert [r["event"] for r in read_records(recorder.journal.path)] == ["daemon.started", "engine.ready"]


def test_a_failed_write_leaves_no_partial_line(recorder: Recorder) -> None:
    recorder.record("daemon.started")
    size = recorder.journal.path.stat().st_size
    full = DiskFull(recorder.journal)
    recorder.record("x", blob="y" * 10_000)
    full.recover()
    assert recorder.journal.path.stat().st_size == size


# -- through the lifecycle -------------------------------------------------------------------------------


def break_journal(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every append raises JournalError from now on; returns the events that were lost."""
    lost: list[str] = []

    def append(event: str, **_fields: Any) -> int:
        lost.append(event)
        raise JournalError(f"cannot write journal {rig.journal.path}: [Errno 28] No space left on device")

    monkeypatch.setattr(rig.journal, "append", append)
    return lost


def test_a_planned_restart_with_new_parameters_is_refused_without_a_durable_intent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig(tmp_path)
    run = rig.serve()
    written = len(rig.records())
    lost = break_journal(rig, monkeypatch)

    assert rig.lifecycle.restart(EngineParams(max_model_len=1024), "tuning trial", action="trial") is False
    assert lost == ["intent"]
    assert rig.sample(ERRORS) == 1.0
    assert rig.os.group_signals(run.pgid) == []  # the serving engine was not touched
    assert rig.state is EngineState.RUNNING
    assert rig.lifecycle.pending is None
    assert rig.lifecycle.params == EngineParams()
    assert len(rig.records()) == written


def test_supervision_goes_on_while_the_journal_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig(tmp_path)
    run = rig.serve()
    lost = break_journal(rig, monkeypatch)
    rig.os.kill(run.pid)  # the OOM killer
    rig.step()
    assert rig.os.group_signals(run.pgid) == [signal.SIGTERM]
    rig.settle()
    assert rig.state is EngineState.BACKOFF
    rig.step(10.0)  # the same parameters again: no change, so no intent needed
    assert rig.state is EngineState.STARTING
    assert len(rig.os.spawns) == 2 and rig.os.spawns[1].argv == rig.os.spawns[0].argv
    assert lost[:3] == ["engine.exited", "engine.failed", "engine.stopped"]
    assert rig.sample(ERRORS) == float(len(lost))
    assert rig.restarts("killed") == 1.0


def test_an_operator_restart_that_changes_nothing_goes_ahead_without_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig(tmp_path)
    run = rig.serve()
    break_journal(rig, monkeypatch)
    assert rig.lifecycle.restart(rig.lifecycle.params, "operator restart") is True
    assert rig.os.group_signals(run.pgid) == [signal.SIGTERM]
    rig.settle()
    assert len(rig.os.spawns) == 2


def test_a_correction_refused_for_want_of_an_intent_retries_unchanged_instead_of_stalling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig(tmp_path, {"engine": {"params": {"max_model_len": 4096}}})
    rig.os.scripts.append(EngineScript(lines=(KV_TOO_SMALL_LINE,)))
    rig.start()
    break_journal(rig, monkeypatch)
    rig.step()
    rig.settle()
    rig.step(3600.0)
    # Not stuck in BACKOFF with nothing pending: the parameters in force were started again, unchanged
    # (no change without a durable intent: the corrected max_model_len was not applied).
    assert rig.state is EngineState.STARTING, rig.transitions
    assert rig.lifecycle.engine.run is not None
    assert rig.lifecycle.engine.run.params.max_model_len == 4096
