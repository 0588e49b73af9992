"""The journal: durable appends, torn-tail repair, aborted intents, and no half-written line on ENOSPC."""

from __future__ import annotations

import errno
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tunerd.records.journal import Journal, JournalError, read_records


class FakeWallClock:
    """Wall time that moves one second per reading, so every record has its own time."""

    def __init__(self) -> None:
        self.moment = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.moment += timedelta(seconds=1)
        return self.moment


def open_journal(path: Path) -> Journal:
    journal = Journal(path, clock=FakeWallClock())
    journal.open()
    return journal


def lines(path: Path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_bytes().splitlines()]


def write_records(path: Path, *records: dict) -> bytes:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    path.write_bytes(data)
    return data


GOOD_1 = {"seq": 1, "time": "2026-11-30T11:00:00.000Z", "event": "daemon.started"}
GOOD_2 = {"seq": 2, "time": "2026-11-30T11:00:01.000Z", "event": "engine.ready"}


# -- appending -------------------------------------------------------------------------------------


def test_append_assigns_increasing_seq_and_writes_one_line_each(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    seqs = [journal.append("engine.ready", port=8000), journal.append("rule.fired", rule="kv")]
    journal.close()
    assert seqs == [1, 2]
    records = lines(path)
    assert [r["seq"] for r in records] == [1, 2]
    assert records[0]["event"] == "engine.ready"
    assert records[0]["port"] == 8000
    assert records[0]["time"] == "2026-11-30T12:00:01.000Z"
    assert records[1]["rule"] == "kv"


def test_each_append_is_fsynced_before_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = open_journal(tmp_path / "journal.jsonl")
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    journal.append("a")
    assert len(synced) == 1
    journal.intent("restart", params={"max_model_len": 512})
    journal.outcome(2, "ok")
    assert len(synced) == 3
    journal.close()


def test_append_before_open_raises_journal_error(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="not open"):
        Journal(tmp_path / "journal.jsonl").append("x")


def test_open_creates_missing_parent_folders(tmp_path: Path) -> None:
    path = tmp_path / "state" / "deep" / "journal.jsonl"
    journal = open_journal(path)
    journal.append("x")
    journal.close()
    assert [r["event"] for r in lines(path)] == ["x"]


def test_records_carry_paths_and_sets_as_json(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    journal.append("x", log=Path("/var/log/a.log"), pids={3}, when=datetime(2026, 1, 2, tzinfo=UTC))
    journal.close()
    record = lines(path)[0]
    assert record["log"] == "/var/log/a.log"
    assert record["pids"] == [3]
    assert record["when"] == "2026-01-02T00:00:00.000Z"


def test_seq_continues_after_reopen(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    journal.append("a")
    journal.append("b")
    journal.close()
    journal = open_journal(path)
    assert journal.last_record is not None
    assert journal.last_record["seq"] == 2
    assert journal.append("c") == 3
    journal.close()
    assert [r["seq"] for r in lines(path)] == [1, 2, 3]


def test_failed_write_raises_and_leaves_no_partial_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    journal.append("before")
    size_before = path.stat().st_size
    real_write = os.write
    journal_fd = journal._fd

    def disk_fills_up(fd: int, data: bytes) -> int:
        if fd != journal_fd:
            return real_write(fd, data)
        real_write(fd, bytes(data)[:7])  # part of the line reaches the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_fills_up)
    with pytest.raises(JournalError, match="No space left"):
        journal.append("during", detail="x" * 100)
    monkeypatch.undo()

    assert path.stat().st_size == size_before
    assert journal.append("after") == 2  # the failed record did not use up a seq
    journal.close()
    assert [(r["seq"], r["event"]) for r in lines(path)] == [(1, "before"), (2, "after")]


def test_failed_write_after_a_short_write_leaves_no_partial_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    journal.append("before")
    size_before = path.stat().st_size
    real_write = os.write
    journal_fd = journal._fd
    calls = 0

    def short_then_full(fd: int, data: bytes) -> int:
        nonlocal calls
        if fd != journal_fd:
            return real_write(fd, data)
        calls += 1
        if calls == 1:
            return real_write(fd, bytes(data)[:10])  # a short write: the caller must go on
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(JournalError):
        journal.append("during")
    monkeypatch.undo()
    journal.close()
    assert calls == 2
    assert path.stat().st_size == size_before


def test_failed_intent_is_not_left_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = open_journal(tmp_path / "journal.jsonl")

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(JournalError):
        journal.intent("restart")
    monkeypatch.undo()
    assert journal.open_intents == []
    journal.close()
    assert (tmp_path / "journal.jsonl").read_bytes() == b""


# -- repair on open --------------------------------------------------------------------------------


def test_torn_last_line_is_moved_aside_and_file_cut_back(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    good = write_records(path, GOOD_1, GOOD_2)
    torn = b'{"seq":3,"time":"2026-11-30T11:00:02.000Z","event":"inte'
    with open(path, "ab") as f:
        f.write(torn)

    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    journal.close()

    assert report.torn_bytes == len(torn)
    assert report.torn_moved_to is not None
    aside = Path(report.torn_moved_to)
    assert aside.parent == tmp_path
    assert aside.name.startswith("journal.jsonl.torn-")
    assert aside.read_bytes() == torn
    data = path.read_bytes()
    assert data.startswith(good)
    records = lines(path)
    assert [r["seq"] for r in records] == [1, 2, 3]
    assert records[2]["event"] == "journal.repaired"
    assert records[2]["torn_bytes"] == len(torn)
    assert records[2]["moved_to"] == str(aside)


def test_complete_json_without_newline_counts_as_torn(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    write_records(path, GOOD_1)
    torn = json.dumps(GOOD_2).encode()  # the crash came before the newline
    with open(path, "ab") as f:
        f.write(torn)
    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    journal.close()
    assert Path(report.torn_moved_to or "").read_bytes() == torn
    assert [r["event"] for r in lines(path)] == ["daemon.started", "journal.repaired"]


def test_terminated_unparsable_last_line_is_moved_aside_and_file_cut_back(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    good = write_records(path, GOOD_1, GOOD_2)
    torn = b"\x00" * 48 + b"\n"  # a crash can leave a block of NULs where the last write went
    with open(path, "ab") as f:
        f.write(torn)

    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    journal.close()

    assert report.torn_bytes == len(torn)
    assert Path(report.torn_moved_to or "").read_bytes() == torn
    assert path.read_bytes()[: len(good)] == good
    records = lines(path)
    assert [(r["seq"], r["event"]) for r in records] == [
        (1, "daemon.started"),
        (2, "engine.ready"),
        (3, "journal.repaired"),
    ]


def test_several_bad_lines_at_the_end_are_all_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    write_records(path, GOOD_1)
    torn = b"\x00\x00\x00\n" + b"not json\n" + b'{"seq":9,"ev'
    with open(path, "ab") as f:
        f.write(torn)
    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    journal.close()
    assert Path(report.torn_moved_to or "").read_bytes() == torn
    assert [r["seq"] for r in lines(path)] == [1, 2]


def test_file_with_only_a_torn_line_is_cut_to_empty(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b'{"seq":1,"ti')
    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    journal.close()
    assert report.torn_bytes == 12
    assert [(r["seq"], r["event"]) for r in lines(path)] == [(1, "journal.repaired")]


def test_clean_journal_is_left_untouched_on_open(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    good = write_records(path, GOOD_1, GOOD_2)
    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    journal.close()
    assert report.torn_bytes == 0
    assert report.torn_moved_to is None
    assert report.aborted_intents == []
    assert path.read_bytes() == good
    assert list(tmp_path.glob("*.torn-*")) == []


def test_intent_without_outcome_is_marked_aborted_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    seq = journal.intent("restart", params={"max_model_len": 512})
    assert journal.open_intents == [seq]
    journal.close()  # the daemon dies here, before the outcome

    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    assert report.aborted_intents == [seq]
    assert journal.open_intents == []
    journal.close()
    outcome = lines(path)[-1]
    assert outcome["event"] == "outcome"
    assert outcome["intent"] == seq
    assert outcome["result"] == "aborted"
    assert outcome["action"] == "restart"
    assert outcome["seq"] == seq + 1


def test_intent_with_outcome_is_not_aborted_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    seq = journal.intent("restart")
    journal.outcome(seq, "ok")
    journal.close()
    size = path.stat().st_size

    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    journal.close()
    assert report.aborted_intents == []
    assert path.stat().st_size == size


def test_only_the_unclosed_intents_are_aborted(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    first = journal.intent("restart")
    journal.outcome(first, "failed")
    second = journal.intent("rollback")
    journal.close()
    journal = Journal(path, clock=FakeWallClock())
    assert journal.open().aborted_intents == [second]
    journal.close()
    aborted = [r for r in lines(path) if r.get("result") == "aborted"]
    assert [(r["intent"], r["action"]) for r in aborted] == [(second, "rollback")]


def test_repair_and_abort_happen_together_after_a_crash_mid_restart(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = open_journal(path)
    seq = journal.intent("restart")
    journal.close()
    with open(path, "ab") as f:
        f.write(b'{"seq":2,"time":"2026')
    journal = Journal(path, clock=FakeWallClock())
    report = journal.open()
    journal.close()
    assert report.torn_bytes > 0
    assert report.aborted_intents == [seq]
    assert [(r["seq"], r["event"]) for r in lines(path)] == [
        (1, "intent"),
        (2, "journal.repaired"),
        (3, "outcome"),
    ]


# -- reading ---------------------------------------------------------------------------------------


def test_read_records_skips_garbage_lines(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_bytes(
        json.dumps(GOOD_1).encode()
        + b"\n"
        + b"garbage\n"
        + b"[1, 2, 3]\n"
        + b'{"no_seq": true, "event": "x"}\n'
        + b"\x00\x00\n"
        + json.dumps(GOOD_2).encode()
        + b"\n"
        + b'{"seq":3,"event":"torn"'
    )
    assert [r["seq"] for r in read_records(path)] == [1, 2]


def test_read_records_of_a_missing_file_is_empty(tmp_path: Path) -> None:
    assert list(read_records(tmp_path / "absent.jsonl")) == []
