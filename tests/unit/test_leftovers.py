"""Leftover engine processes before a start: SIGTERM, wait, SIGKILL, give up loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.engine.leftovers import LeftoverReaper
from tunerd.engine.oscalls import SIGKILL, SIGTERM
from tunerd.engine.process import MARKER_ENV
from tunerd.engine.stopper import KILL_WAIT_S

MARKER = "0123456789abcdef"
GRACEFUL_S = 30.0


class FakeOsCalls:
    """Records signals; answers `marked_pids` from a script, one answer per call (the last repeats)."""

    def __init__(self, proc: Path, answers: list[list[int]]) -> None:
        self.proc = str(proc)
        self.answers = list(answers)
        self.signals: list[tuple[int, int]] = []
        self.queries: list[tuple[str, str]] = []

    def marked_pids(self, key: str, value: str) -> list[int]:
        self.queries.append((key, value))
        return self.answers.pop(0) if len(self.answers) > 1 else list(self.answers[0])

    def signal_pid(self, pid: int, sig: int) -> bool:
        self.signals.append((pid, sig))
        return True


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    path = tmp_path / "proc"
    path.mkdir()
    return path


def reaper(
    proc: Path, answers: list[list[int]], pgid: int | None = 4000
) -> tuple[LeftoverReaper, FakeOsCalls]:
    oscalls = FakeOsCalls(proc, answers)
    return LeftoverReaper(oscalls, MARKER, recorded_pgid=pgid), oscalls  # type: ignore[arg-type]


def test_no_leftovers_is_clear_at_once(proc: Path) -> None:
    subject, oscalls = reaper(proc, [[]])
    result = subject.step(now=100.0, graceful_s=GRACEFUL_S)
    assert result.clear
    assert result.reason is None
    assert result.journal == []
    assert oscalls.signals == []
    assert oscalls.queries == [(MARKER_ENV, MARKER)]


def test_leftovers_get_sigterm_and_a_found_record(proc: Path) -> None:
    subject, oscalls = reaper(proc, [[4002, 4001]])
    result = subject.step(now=100.0, graceful_s=GRACEFUL_S)
    assert not result.clear
    assert result.reason == "stopping 2 leftover engine process(es)"
    assert oscalls.signals == [(4001, SIGTERM), (4002, SIGTERM)]
    assert result.journal == [
        {"event": "leftover.found", "pids": {4001: "?", 4002: "?"}, "recorded_pgid": 4000}
    ]


def test_found_record_names_the_process_from_proc(proc: Path) -> None:
    (proc / "4001").mkdir()
    (proc / "4001" / "stat").write_text("4001 (VLLM::EngineCor) S 1 4000 4000 0 -1 0 10 0 0 0 0 0\n")
    subject, _ = reaper(proc, [[4001]])
    result = subject.step(now=0.0, graceful_s=GRACEFUL_S)
    assert result.journal[0]["pids"] == {4001: "VLLM::EngineCor"}


def test_leftovers_that_exit_after_sigterm_are_reported_reaped(proc: Path) -> None:
    subject, oscalls = reaper(proc, [[4001, 4002], [4001], []])
    assert not subject.step(now=100.0, graceful_s=GRACEFUL_S).clear
    waiting = subject.step(now=101.0, graceful_s=GRACEFUL_S)
    assert not waiting.clear
    assert waiting.reason == "waiting for 1 leftover engine process(es) to exit"
    assert waiting.journal == []
    done = subject.step(now=102.5, graceful_s=GRACEFUL_S)
    assert done.clear
    assert done.journal == [
        {"event": "leftover.reaped", "pids": {4001: "?", 4002: "?"}, "seconds": 2.5, "sigkill": False}
    ]
    assert all(sig == SIGTERM for _, sig in oscalls.signals)


def test_no_sigkill_before_the_graceful_timeout(proc: Path) -> None:
    subject, oscalls = reaper(proc, [[4001]])
    subject.step(now=100.0, graceful_s=GRACEFUL_S)
    for now in (101.0, 110.0, 129.9):
        result = subject.step(now=now, graceful_s=GRACEFUL_S)
        assert not result.clear
        assert result.reason == "waiting for 1 leftover engine process(es) to exit"
    assert oscalls.signals == [(4001, SIGTERM)]


def test_sigkill_after_graceful_timeout_then_reaped_record_says_so(proc: Path) -> None:
    subject, oscalls = reaper(proc, [[4001, 4002], [4001, 4002], [4002], []])
    subject.step(now=100.0, graceful_s=GRACEFUL_S)
    killing = subject.step(now=130.0, graceful_s=GRACEFUL_S)
    assert not killing.clear
    assert killing.reason == "waiting for 2 leftover engine process(es) to exit"
    assert oscalls.signals[2:] == [(4001, SIGKILL), (4002, SIGKILL)]
    subject.step(now=131.0, graceful_s=GRACEFUL_S)
    done = subject.step(now=132.0, graceful_s=GRACEFUL_S)
    assert done.clear
    assert done.journal[0]["event"] == "leftover.reaped"
    assert done.journal[0]["sigkill"] is True
    assert done.journal[0]["seconds"] == 32.0
    assert [sig for _, sig in oscalls.signals].count(SIGKILL) == 2  # each pid killed once


def test_processes_surviving_sigkill_are_reported_stuck_after_the_extra_wait(proc: Path) -> None:
    subject, oscalls = reaper(proc, [[4001]])
    subject.step(now=100.0, graceful_s=GRACEFUL_S)
    subject.step(now=130.0, graceful_s=GRACEFUL_S)
    still = subject.step(now=130.0 + KILL_WAIT_S - 0.1, graceful_s=GRACEFUL_S)
    assert still.reason == "waiting for 1 leftover engine process(es) to exit"
    stuck = subject.step(now=130.0 + KILL_WAIT_S, graceful_s=GRACEFUL_S)
    assert not stuck.clear
    assert stuck.reason == "leftover engine process(es) [4001] survive SIGKILL"
    assert oscalls.signals == [(4001, SIGTERM), (4001, SIGKILL)]


def test_a_late_step_sends_sigkill_at_once(proc: Path) -> None:
    # The loop may tick late; a step past the deadline kills rather than waiting another tick.
    subject, oscalls = reaper(proc, [[4001]])
    subject.step(now=100.0, graceful_s=GRACEFUL_S)
    subject.step(now=500.0, graceful_s=GRACEFUL_S)
    assert (4001, SIGKILL) in oscalls.signals


def test_reaper_starts_afresh_after_reaping(proc: Path) -> None:
    subject, oscalls = reaper(proc, [[4001], [], [5001]])
    subject.step(now=100.0, graceful_s=GRACEFUL_S)
    assert subject.step(now=101.0, graceful_s=GRACEFUL_S).clear
    again = subject.step(now=500.0, graceful_s=GRACEFUL_S)
    assert not again.clear
    assert again.journal == [{"event": "leftover.found", "pids": {5001: "?"}, "recorded_pgid": None}]
    assert oscalls.signals[-1] == (5001, SIGTERM)


def test_find_lists_marked_pids_sorted(proc: Path) -> None:
    subject, oscalls = reaper(proc, [[30, 10, 20]])
    assert subject.find() == [10, 20, 30]
    assert oscalls.queries == [(MARKER_ENV, MARKER)]
