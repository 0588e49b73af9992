"""The tuning journal's records told as sentences: what `tunerd journal` prints for the tuning loop.

Each function takes one record and returns its line without the time/seq/event head; records of other
events keep the generic `key=value` form (`cli.journal.format_record`). `--json` prints the records raw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunerd.records.journal import Record


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "?"
    if isinstance(value, float):
        return f"{value:,.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _window(stats: dict[str, Any] | None) -> str:
    """`1,959 tok/s (median; quartiles 1,654–2,440; 60 polls), saturated, 5.85 preemptions/s`."""
    if not stats:
        return "no window"
    tput = stats.get("throughput") or {}
    quartiles = f"{_num(tput.get('p25'))}–{_num(tput.get('p75'))}"
    parts = [
        f"{_num(tput.get('median'))} tok/s (median; quartiles {quartiles}; "
        f"{tput.get('n', '?')} samples over {_num(stats.get('seconds'))} s)",
        "saturated" if stats.get("saturated") else "not saturated",
    ]
    for key, label in (
        ("preemptions_per_s", "preemptions/s"),
        ("kv_usage_avg", "KV usage"),
        ("running_avg", "running"),
        ("waiting_avg", "waiting"),
        ("itl_p95_s", "ITL p95 s"),
        ("ttft_p95_s", "TTFT p95 s"),
    ):
        if stats.get(key) is not None:
            parts.append(f"{label} {_num(stats[key], 3)}")
    return ", ".join(parts)


def _terms(record: Record) -> str:
    out = []
    for term in record.get("terms") or []:
        out.append(f"{term.get('term')} (now {_num(term.get('value'), 3)})")
    return "; ".join(out)


def _change(record: Record) -> str:
    return f"{record.get('param')} {record.get('old')} → {record.get('new')}"


def _action(action: dict[str, Any] | None) -> str:
    if not action:
        return "?"
    if action.get("kind") != "step":
        return str(action.get("kind"))
    how = (
        f"×{action['factor']:g}"
        if action.get("factor")
        else f"by {action['by']:g}"
        if action.get("by")
        else "next"
    )
    return f"step {action.get('param')} {action.get('direction')} {how}"


def rule_fired(r: Record) -> str:
    held = _num(r.get("held_s"))
    return f"rule {r.get('rule')} fired on {_terms(r)}, held {held} s → {_action(r.get('action'))}"


def trial_started(r: Record) -> str:
    return (
        f"trial #{r.get('trial')} (rule {r.get('rule')}): {_change(r)}{_proposed_by(r)}; "
        f"before: {_window(r.get('before'))}"
    )


def _proposed_by(r: Record) -> str:
    """Who proposed the value and how it was computed (issue 22); nothing for older records."""
    by = r.get("proposed_by")
    if not by:
        return ""
    return f" (by the {by}: {r['arithmetic']})" if r.get("arithmetic") else f" (by the {by})"


def trial_decided(r: Record) -> str:
    decision = str(r.get("decision", "?")).upper()
    text = f"trial #{r.get('trial')} {decision}: {_change(r)} — {r.get('reason')}"
    if r.get("evidence"):
        text += f" (evidence: {r['evidence']})"
    interval = r.get("ratio_interval") or r.get("ratio_interval_90")  # the latter: journals before issue 22
    if interval:
        low, high = interval
        share = r.get("confidence", 0.9)
        text += f" [after/before {share:.0%} interval {low:.2f}–{high:.2f}]"
    if r.get("after"):
        text += f"; after: {_window(r.get('after'))}"
    return text


def trial_plain(r: Record) -> str:
    extra = r.get("reason") or r.get("outcome") or ""
    if r.get("by") == "start":  # trial.extended over more vLLM starts a side
        extra += f" (start {r.get('starts_a_side')} of {r.get('max_starts')} a side)"
    return f"trial #{r.get('trial')} (rule {r.get('rule')}): {_change(r)} — {extra}"


def rule_plain(r: Record) -> str:
    return f"rule {r.get('rule')}: {r.get('reason') or r.get('why') or ''}"


def baseline(r: Record) -> str:
    figures = ", ".join(f"{k} {_num(v, 4)}" for k, v in sorted((r.get("signals") or {}).items()))
    return f"baseline ({r.get('why')}): {figures}"


STORIES: dict[str, Callable[[Record], str]] = {
    "rule.fired": rule_fired,
    "rule.deferred": rule_plain,
    "rule.exhausted": rule_plain,
    "rule.muted": rule_plain,
    "rule.resolved": rule_plain,
    "rule.alert": rule_plain,
    "trial.proposed": lambda r: (
        f"proposed (dry-run) by rule {r.get('rule')}: {_change(r)}; before: {_window(r.get('before'))}"
    ),
    "trial.started": trial_started,
    "trial.decided": trial_decided,
    "trial.refused": trial_plain,
    "trial.extended": trial_plain,
    "trial.aborted": trial_plain,
    "trial.ended": trial_plain,
    "baseline.recorded": baseline,
}
