"""`tunerd journal`: --since parsing, readable lines, --last, and following a growing file."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from tunerd.cli.journal import follow, format_record, parse_since, print_journal

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def record(seq: int, minutes_ago: float, event: str = "engine.ready", **fields: object) -> dict:
    moment = NOW - timedelta(minutes=minutes_ago)
    stamp = moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {"seq": seq, "time": stamp, "event": event, **fields}


def write_journal(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def append(path: Path, *records: dict) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


# -- parse_since -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ago"),
    [
        ("10m", timedelta(minutes=10)),
        ("2h", timedelta(hours=2)),
        ("1d", timedelta(days=1)),
        ("30s", timedelta(seconds=30)),
        ("1.5h", timedelta(minutes=90)),
        (" 5 m ", timedelta(minutes=5)),
    ],
)
def test_relative_since_counts_back_from_now(text: str, ago: timedelta) -> None:
    assert parse_since(text, now=NOW) == NOW - ago


def test_iso_since_without_zone_is_utc() -> None:
    assert parse_since("2026-11-30T10:15") == datetime(2026, 11, 30, 10, 15, tzinfo=UTC)


def test_iso_since_with_zone_keeps_its_offset() -> None:
    moment = parse_since("2026-11-30T12:00+02:00")
    assert moment == datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    assert moment.utcoffset() == timedelta(hours=2)


def test_iso_since_with_z_suffix_is_utc() -> None:
    assert parse_since("2026-11-30T12:00:00Z") == datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize("text", ["yesterday", "10x", "", "m10", "-5m"])
def test_garbage_since_raises_value_error_with_examples(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_since(text, now=NOW)
    message = str(info.value)
    assert message.startswith(f"--since {text!r}")
    assert "10m" in message
    assert "2026-11-30T12:00" in message


# -- format_record ---------------------------------------------------------------------------------


def test_format_record_is_one_readable_line() -> None:
    line = format_record(
        {
            "seq": 7,
            "time": "2026-11-30T12:00:00.000Z",
            "event": "intent",
            "action": "restart",
            "params": {"max_model_len": 512, "block_size": 32},
            "reason": "kv cache pressure",
            "pids": [1, 2],
        }
    )
    assert "\n" not in line
    assert line.startswith("2026-11-30 12:00:00.000Z  #7 ")
    assert " intent " in line
    assert "action=restart" in line
    assert "params={max_model_len=512, block_size=32}" in line
    assert 'reason="kv cache pressure"' in line
    assert "pids=[1, 2]" in line
    assert "seq=" not in line and "time=" not in line and "event=" not in line


def test_a_trial_says_who_proposed_its_value_and_the_arithmetic() -> None:
    record = {
        "seq": 9, "time": "2026-12-03T12:00:00Z", "event": "trial.started", "trial": 1,
        "rule": "kv-cache-pressure", "param": "max_num_seqs", "old": 32, "new": 16,
        "proposed_by": "kv model", "arithmetic": "KV cache 9,584 tokens ... = 23.00 → 23; ... → 16",
    }  # fmt: skip
    line = format_record(record)
    assert "max_num_seqs 32 → 16 (by the kv model: KV cache 9,584 tokens ... = 23.00 → 23; ... → 16)" in line
    assert "(by the rule step);" in format_record({**record, "proposed_by": "rule step", "arithmetic": None})
    assert "(by the" not in format_record({k: v for k, v in record.items() if k != "proposed_by"})


def test_format_record_shows_empty_strings_quoted_and_missing_head_fields_as_question_marks() -> None:
    line = format_record({"detail": ""})
    assert line.startswith("?  #? ")
    assert 'detail=""' in line


# -- print_journal ---------------------------------------------------------------------------------


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    path = tmp_path / "journal.jsonl"
    write_journal(path, [record(1, 120), record(2, 30, "rule.fired"), record(3, 5), record(4, 1)])
    with open(path, "a") as f:
        f.write("garbage\n")
    return path


def seqs_printed(out: io.StringIO, *, as_json: bool = True) -> list[int]:
    assert as_json
    return [json.loads(line)["seq"] for line in out.getvalue().splitlines()]


def test_print_journal_prints_every_record_in_order(journal: Path) -> None:
    out = io.StringIO()
    print_journal(str(journal), out, as_json=True, since=None, last=None)
    assert seqs_printed(out) == [1, 2, 3, 4]


def test_print_journal_since_keeps_records_at_or_after_it(journal: Path) -> None:
    out = io.StringIO()
    print_journal(str(journal), out, as_json=True, since=parse_since("30m", now=NOW), last=None)
    assert seqs_printed(out) == [2, 3, 4]


def test_print_journal_last_keeps_the_newest(journal: Path) -> None:
    out = io.StringIO()
    print_journal(str(journal), out, as_json=True, since=None, last=2)
    assert seqs_printed(out) == [3, 4]


def test_print_journal_last_applies_after_since(journal: Path) -> None:
    out = io.StringIO()
    print_journal(str(journal), out, as_json=True, since=parse_since("1h", now=NOW), last=5)
    assert seqs_printed(out) == [2, 3, 4]


def test_print_journal_last_zero_prints_nothing(journal: Path) -> None:
    out = io.StringIO()
    print_journal(str(journal), out, as_json=True, since=None, last=0)
    assert out.getvalue() == ""


def test_print_journal_human_form_uses_format_record(journal: Path) -> None:
    out = io.StringIO()
    print_journal(str(journal), out, as_json=False, since=None, last=1)
    assert out.getvalue() == format_record(record(4, 1)) + "\n"


def test_print_journal_of_a_missing_file_prints_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    print_journal(str(tmp_path / "absent.jsonl"), out, as_json=True, since=None, last=None)
    assert out.getvalue() == ""


# -- follow ----------------------------------------------------------------------------------------


def scripted(steps: list[Callable[[], None]]) -> Callable[[], bool]:
    """A keep_going that runs one step per loop iteration and stops the loop when they are used up."""
    remaining = list(steps)

    def keep_going() -> bool:
        if not remaining:
            return False
        remaining.pop(0)()
        return True

    return keep_going


def test_follow_prints_only_records_appended_after_it_starts(journal: Path) -> None:
    out = io.StringIO()
    steps = [
        lambda: append(journal, record(5, 0)),
        lambda: None,
        lambda: append(journal, record(6, 0), record(7, 0)),
        lambda: None,
    ]
    follow(str(journal), out, as_json=True, since=None, interval_s=0.0, keep_going=scripted(steps))
    assert seqs_printed(out) == [5, 6, 7]


def test_follow_holds_a_partial_line_until_it_is_complete(journal: Path) -> None:
    out = io.StringIO()
    line = json.dumps(record(5, 0)) + "\n"

    def write_part(text: str) -> Callable[[], None]:
        def step() -> None:
            with open(journal, "a") as f:
                f.write(text)

        return step

    steps = [write_part(line[:10]), lambda: None, write_part(line[10:]), lambda: None]
    follow(str(journal), out, as_json=True, since=None, interval_s=0.0, keep_going=scripted(steps))
    assert seqs_printed(out) == [5]


def test_follow_restarts_from_the_beginning_when_the_file_is_replaced(journal: Path) -> None:
    out = io.StringIO()

    def replace_file() -> None:
        fresh = journal.with_name("fresh.jsonl")
        write_journal(fresh, [record(1, 0, "daemon.started"), record(2, 0)])
        os.replace(fresh, journal)

    steps = [
        lambda: append(journal, record(5, 0)),
        replace_file,
        lambda: append(journal, record(3, 0)),
        lambda: None,
    ]
    follow(str(journal), out, as_json=True, since=None, interval_s=0.0, keep_going=scripted(steps))
    assert seqs_printed(out) == [5, 1, 2, 3]


def test_follow_starts_over_when_the_file_is_cut_back(journal: Path) -> None:
    out = io.StringIO()

    def cut_back() -> None:
        with open(journal, "r+b") as f:
            f.truncate(0)
        append(journal, record(1, 0, "journal.repaired"))

    steps = [cut_back, lambda: None]
    follow(str(journal), out, as_json=True, since=None, interval_s=0.0, keep_going=scripted(steps))
    assert seqs_printed(out) == [1]


def test_follow_waits_for_a_file_that_does_not_exist_yet(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    out = io.StringIO()
    steps = [lambda: None, lambda: write_journal(path, [record(1, 0)]), lambda: None]
    follow(str(path), out, as_json=True, since=None, interval_s=0.0, keep_going=scripted(steps))
    assert seqs_printed(out) == [1]


def test_follow_applies_since(journal: Path) -> None:
    out = io.StringIO()
    steps = [lambda: append(journal, record(5, 90), record(6, 1)), lambda: None]
    since = parse_since("1h", now=NOW)
    follow(str(journal), out, as_json=True, since=since, interval_s=0.0, keep_going=scripted(steps))
    assert seqs_printed(out) == [6]


def test_follow_in_human_form_prints_formatted_lines(journal: Path) -> None:
    out = io.StringIO()
    new = record(5, 0, "change.applied", rule="kv")
    steps = [lambda: append(journal, new), lambda: None]
    follow(str(journal), out, as_json=False, since=None, interval_s=0.0, keep_going=scripted(steps))
    assert out.getvalue() == format_record(new) + "\n"


def test_follow_returns_at_once_when_told_to_stop(journal: Path) -> None:
    out = io.StringIO()
    follow(str(journal), out, as_json=True, since=None, interval_s=0.0, keep_going=lambda: False)
    assert out.getvalue() == ""


def test_iso_since_with_other_zone_compares_correctly_with_utc_records(journal: Path) -> None:
    out = io.StringIO()
    since = (NOW - timedelta(minutes=6)).astimezone(timezone(timedelta(hours=-5)))
    print_journal(str(journal), out, as_json=True, since=since, last=None)
    assert seqs_printed(out) == [3, 4]
