"""`tunerd journal`: the tuning journal for humans (or raw with --json), optionally followed like tail -f."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from tunerd.cli.story import STORIES
from tunerd.records.journal import Record, parse_time

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_HEAD = ("seq", "time", "event")


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """'10m', '2h', '1d', '30s' (ago) or an ISO time ('2026-11-30T12:00', UTC unless it says).

    Raises ValueError with a message fit for the command line.
    """
    now = now or datetime.now(UTC)
    if m := _RELATIVE.match(text.strip()):
        return now - timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {text!r}: use e.g. 10m, 2h, 1d or 2026-11-30T12:00") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def format_record(record: Record) -> str:
    """One readable line: time, seq, event, then the other fields as key=value."""
    when = record.get("time", "?").replace("T", " ")
    head = f"{when}  #{record.get('seq', '?'):<5} {record.get('event', '?'):<22}"
    story = STORIES.get(str(record.get("event")))
    if story is not None:
        return head + " " + story(record)
    rest = [f"{key}={_format_value(value)}" for key, value in record.items() if key not in _HEAD]
    return head + " " + "  ".join(rest)


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    if isinstance(value, str) and (" " in value or not value):
        return json.dumps(value)
    return str(value)


def select(records: Iterable[Record], since: datetime | None) -> Iterator[Record]:
    for record in records:
        if since is None or _record_time(record) >= since:
            yield record


def _record_time(record: Record) -> datetime:
    try:
        return parse_time(record["time"])
    except (KeyError, ValueError):
        return datetime.min.replace(tzinfo=UTC)


def print_journal(
    path: str,
    out: TextIO,
    *,
    as_json: bool,
    since: datetime | None,
    last: int | None,
) -> int:
    """Print the journal's records (the last `last` of them, if given).

    Returns the byte offset just after the last complete line read, where `follow` should go on.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    end = data.rfind(b"\n") + 1
    parsed = (_loads(raw) for raw in data[:end].splitlines())
    records = list(select((r for r in parsed if r is not None), since))
    if last is not None:
        records = records[-last:] if last > 0 else []
    for record in records:
        out.write(_render(record, as_json) + "\n")
    out.flush()
    return end


def follow(
    path: str,
    out: TextIO,
    *,
    as_json: bool,
    since: datetime | None,
    offset: int | None = None,
    interval_s: float = 0.25,
    keep_going: Callable[[], bool] = lambda: True,
) -> None:
    """Print records appended after `offset` (default: the current end of the file), as they come,
    until `keep_going()` is false (see `tail_records`)."""
    for record in tail_records(path, offset=offset, interval_s=interval_s, keep_going=keep_going):
        if since is None or _record_time(record) >= since:
            out.write(_render(record, as_json) + "\n")
            out.flush()


def tail_records(
    path: str,
    *,
    offset: int | None = None,
    interval_s: float = 0.25,
    keep_going: Callable[[], bool] = lambda: True,
) -> Iterator[Record]:
    """The records appended after `offset` (default: the current end of the file), as they come.

    Survives the file being created later, replaced or cut back (journal repair): it then starts
    over from the new file's beginning. Ends when `keep_going()` is false.
    """
    offset = journal_size(path) if offset is None else offset
    inode, partial = _inode(path), b""
    while keep_going():
        current = _inode(path)
        if current != inode:
            offset, inode, partial = 0, current, b""
        size = journal_size(path)
        if size < offset:
            offset, partial = 0, b""
        if size > offset:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(size - offset)
            offset += len(data)
            *lines, partial = (partial + data).split(b"\n")
            for raw in lines:
                record = _loads(raw)
                if record is not None:
                    yield record
            continue  # more may have come while these were read
        time.sleep(interval_s)


def _render(record: Record, as_json: bool) -> str:
    return json.dumps(record, separators=(",", ":")) if as_json else format_record(record)


def _loads(raw: bytes) -> Record | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def journal_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
