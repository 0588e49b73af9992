"""`tunerd trials`, `tunerd rules`, `tunerd pause`: the tuning loop for operators.

`trials` reads the journal (every trial's story ends in a `trial.decided` record); `rules` asks the
running daemon for each rule's live state; `pause` freezes tuning on the running daemon (`tunerd resume`
unfreezes it), persisted across a daemon restart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

from tunerd.cli.common import ask_daemon, journal_path
from tunerd.cli.status import bucket_text
from tunerd.config import default_config_path
from tunerd.records.journal import Record, read_records


def add_commands(sub: Any, config_option: Callable[[argparse.ArgumentParser], None]) -> None:
    trials = sub.add_parser("trials", help="the tuning trials so far: rule, change, objective, decision")
    config_option(trials)
    trials.add_argument("--file", help="journal file to read (default: the config's)")
    trials.add_argument("--json", action="store_true", help="one JSON object per trial")
    trials.set_defaults(func=cmd_trials)

    rules = sub.add_parser("rules", help="each rule's live state on the running daemon")
    config_option(rules)
    rules.add_argument("--json", action="store_true", help="the rules part of the status document")
    rules.set_defaults(func=cmd_rules)

    pause = sub.add_parser("pause", help="freeze tuning on the running daemon (tunerd resume unfreezes)")
    config_option(pause)
    pause.set_defaults(func=cmd_pause)


def trial_rows(records: Iterable[Record]) -> list[dict[str, Any]]:
    """One row per decided trial, from the journal's `trial.decided` and `trial.refused` records."""
    rows = []
    for record in records:
        event = record.get("event")
        if event == "trial.decided":
            rows.append(
                {
                    "time": record.get("time"),
                    "trial": record.get("trial"),
                    "rule": record.get("rule"),
                    "param": record.get("param"),
                    "old": record.get("old"),
                    "new": record.get("new"),
                    "objective": record.get("objective") or "",
                    "before": record.get("objective_before"),
                    "after": record.get("objective_after"),
                    "decision": record.get("decision"),
                    "reason": record.get("reason"),
                }
            )
        elif event == "trial.refused":
            rows.append(
                {
                    "time": record.get("time"),
                    "trial": record.get("trial"),
                    "rule": record.get("rule"),
                    "param": record.get("param"),
                    "old": record.get("old"),
                    "new": record.get("new"),
                    "objective": "",
                    "before": None,
                    "after": None,
                    "decision": "refused",
                    "reason": record.get("reason"),
                }
            )
    return rows


def render_trials(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no trials yet"
    header = ("time", "trial", "rule", "change", "objective before → after", "decision")
    lines = []
    for row in rows:
        change = f"{row['param']} {row['old']} → {row['new']}"
        figures = ""
        if row["before"] is not None and row["after"] is not None:
            figures = f"{row['objective']} {_short(row['before'])} → {_short(row['after'])}"
        when = str(row["time"] or "").replace("T", " ")[:19]
        lines.append((when, f"#{row['trial']}", str(row["rule"]), change, figures, str(row["decision"])))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    for line, row in zip(lines, rows, strict=True):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        out.append(f"{'':{widths[0]}}  why: {row['reason']}")
    return "\n".join(out)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_rules(tuning: dict[str, Any]) -> str:
    """The tuning part of the status document, rule by rule."""
    head = f"tuning: {tuning.get('mode', '?')}" + (
        "  (PAUSED: tunerd resume)" if tuning.get("paused") else ""
    )
    budget = tuning.get("budget") or {}
    lines = [
        head,
        f"restart budget left: {budget.get('hour_left', '?')} this hour, {budget.get('day_left', '?')} today",
    ]
    trial = tuning.get("trial")
    if trial:
        lines.append(
            f"trial #{trial['trial']} ({trial['rule']}): {trial['param']} {trial['old']} → {trial['new']}, "
            f"{trial['phase']} for {trial['phase_s']} s"
        )
    for rule in tuning.get("rules") or []:
        state = "holding" if rule.get("holding_s") is not None else "not holding"
        if rule.get("holding_s") is not None:
            state += f" for {rule['holding_s']} s of {rule['for_s']:g}"
        extra = []
        if rule.get("cooldown_left_s"):
            extra.append(f"cooldown {rule['cooldown_left_s']:.0f} s")
        if rule.get("last_fired_s_ago") is not None:
            extra.append(f"fired {rule['last_fired_s_ago']:.0f} s ago")
        if rule.get("muted_left_s"):
            extra.append(f"MUTED {rule['muted_left_s']:.0f} s: {rule.get('muted_why')}")
        lines.append(f"rule {rule['name']}: {state}" + (f" ({', '.join(extra)})" if extra else ""))
        for term in rule.get("terms") or []:
            value = "no data" if term.get("value") is None else f"{term['value']:.4g}"
            verdict = {True: "holds", False: "does not hold", None: "unknown"}[term.get("holds")]
            if term.get("undecidable"):  # the threshold lies inside the percentile's histogram bucket
                verdict = "undecidable at this bucket"
            if term.get("bucket"):
                verdict += f" (bucket {bucket_text(term['bucket'])})"
            lines.append(f"    {term['term']:<44} now {value:<10} {verdict}")
    return "\n".join(lines)


def cmd_trials(args: argparse.Namespace) -> int:
    path = args.file or journal_path(args.config or default_config_path())
    try:
        rows = trial_rows(read_records(path))
    except (FileNotFoundError, PermissionError) as exc:
        print(f"tunerd trials: {path}: {exc.strerror}", file=sys.stderr)
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(render_trials(rows))
    return 0


def cmd_rules(args: argparse.Namespace) -> int:
    answer = ask_daemon(args, "GET", "/status")
    if isinstance(answer, int):
        return answer
    _, document = answer
    tuning = document.get("tuning") if isinstance(document, dict) else None
    if not isinstance(tuning, dict):
        print("tunerd rules: the daemon's status has no tuning part", file=sys.stderr)
        return 1
    print(json.dumps(tuning, indent=2) if args.json else render_rules(tuning))
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    answer = ask_daemon(args, "POST", "/pause")
    if isinstance(answer, int):
        return answer
    code, _ = answer
    print("tuning paused (tunerd resume unfreezes it)" if code == 202 else f"the daemon refused: HTTP {code}")
    return 0 if code == 202 else 1
