"""The tuning journal: append-only JSONL, one record per line, durable before the action it announces.

Every record carries `seq` (1, 2, 3 … across daemon restarts), `time` (wall clock, UTC, ISO 8601) and
`event`; the rest depends on the event. An action the daemon takes on purpose is announced by an
`intent` record (fsynced first, then the action), and closed by an `outcome` record that names the
intent's seq. Opening the journal repairs what a crash can leave: a torn last line is moved aside into
`<journal>.torn-<time>` and the file cut back to its last complete record; an intent without outcome
gets an `outcome` with result `aborted`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunerd.records.durable import fsync_dir

Record = dict[str, Any]


class JournalError(Exception):
    """A record could not be made durable (disk full, I/O error). The action it announced must not run."""


def utc_now() -> datetime:
    return datetime.now(UTC)


def format_time(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass
class RepairReport:
    """What `Journal.open` found and fixed."""

    torn_bytes: int = 0
    torn_moved_to: str | None = None
    aborted_intents: list[int] = field(default_factory=list)


class Journal:
    """Writer side of the journal. Only the supervisor's main loop writes; readers use `read_records`."""

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], datetime] = utc_now) -> None:
        self.path = Path(path)
        self._clock = clock
        self._fd: int | None = None
        self._next_seq = 1
        self._open_intents: dict[int, Record] = {}
        self.last_record: Record | None = None

    # -- opening and repair ------------------------------------------------------------------------

    def open(self) -> RepairReport:
        """Open for appending, repairing a torn tail and closing dangling intents. Raises JournalError."""
        report = RepairReport()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            if created:
                fsync_dir(self.path.parent)
            report.torn_bytes, report.torn_moved_to = self._cut_torn_tail()
            self._scan()
        except OSError as exc:
            raise JournalError(f"cannot open journal {self.path}: {exc}") from exc
        if report.torn_bytes:
            self.append("journal.repaired", torn_bytes=report.torn_bytes, moved_to=report.torn_moved_to)
        for seq, intent in sorted(self._open_intents.items()):
            self.outcome(
                seq, "aborted", action=intent.get("action"), reason="daemon stopped before it finished"
            )
            report.aborted_intents.append(seq)
        return report

    def _cut_torn_tail(self) -> tuple[int, str | None]:
        """Move bytes after the last complete, parseable record aside; cut the file there."""
        with open(self.path, "rb") as f:
            data = f.read()
        good = len(data)
        while good > 0:
            if data[good - 1 : good] != b"\n":
                good = data.rfind(b"\n", 0, good) + 1  # drop the unterminated piece
                continue
            start = data.rfind(b"\n", 0, good - 1) + 1
            if _parse_line(data[start:good]) is not None:
                break
            good = start  # a terminated but unparsable last line (e.g. NULs after a crash)
        torn = data[good:]
        if not torn:
            return 0, None
        aside = self.path.with_name(f"{self.path.name}.torn-{self._clock().strftime('%Y%m%dT%H%M%S%f')}")
        with open(aside, "wb") as f:
            f.write(torn)
            f.flush()
            os.fsync(f.fileno())
        assert self._fd is not None
        os.ftruncate(self._fd, good)
        os.fsync(self._fd)
        fsync_dir(self.path.parent)
        return len(torn), str(aside)

    def _scan(self) -> None:
        for record in read_records(self.path):
            self._next_seq = max(self._next_seq, int(record.get("seq", 0)) + 1)
            self.last_record = record
            if record.get("event") == "intent":
                self._open_intents[record["seq"]] = record
            elif record.get("event") == "outcome":
                self._open_intents.pop(record.get("intent"), None)

    # -- writing -----------------------------------------------------------------------------------

    def append(self, event: str, **fields: Any) -> int:
        """Write one record and fsync it; return its seq. Raises JournalError, leaving no partial line."""
        if self._fd is None:
            raise JournalError("journal is not open")
        record: Record = {"seq": self._next_seq, "time": format_time(self._clock()), "event": event}
        record.update(fields)
        line = (json.dumps(record, default=_json_default, separators=(",", ":")) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(line)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            os.fsync(self._fd)
        except OSError as exc:
            _truncate_quietly(self._fd, size)
            raise JournalError(f"cannot write journal {self.path}: {exc}") from exc
        self._next_seq += 1
        self.last_record = record
        return record["seq"]

    def intent(self, action: str, **fields: Any) -> int:
        """Announce an action before taking it. Returns the intent's seq for `outcome`."""
        seq = self.append("intent", action=action, **fields)
        self._open_intents[seq] = {"action": action}
        return seq

    def outcome(self, intent_seq: int, result: str, **fields: Any) -> int:
        """Close an intent with its result (e.g. `ok`, `failed`, `aborted`)."""
        seq = self.append("outcome", intent=intent_seq, result=result, **fields)
        self._open_intents.pop(intent_seq, None)
        return seq

    @property
    def open_intents(self) -> list[int]:
        return sorted(self._open_intents)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_records(path: str | os.PathLike[str]) -> Iterator[Record]:
    """Every parseable record in file order. Unparsable lines (a torn tail being written) are skipped."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                record = _parse_line(raw)
                if record is not None:
                    yield record
    except FileNotFoundError:
        return


def _parse_line(raw: bytes) -> Record | None:
    if not raw.endswith(b"\n"):
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "seq" in record and "event" in record else None


def _json_default(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, datetime):
        return format_time(value)
    return str(value)


def _truncate_quietly(fd: int, size: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, size)
