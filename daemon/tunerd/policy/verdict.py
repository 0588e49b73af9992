"""Keep or revert a trial (pure): the before and after windows, the rule, the tuning settings in; a
verdict with its reason and the figures that decided out.

Like with like:
- the offered load must match (per-request sizes; outstanding requests when saturated, the request rate
  otherwise); when it does not, the window is extended once (`extend`), then the result is
  inconclusive: a performance change is reverted, a safety change kept only if its condition eased;
- throughput measures capacity only when the engine is saturated in both windows; otherwise the
  latency at the offered load is the objective (TTFT, ITL, e2e p95);
- a performance change is kept only if the objective is not worse beyond `tolerance`, no latency limit
  is broken (a throughput-only gate once kept a 6.6x latency regression: Hyperloom PR #1297) and the
  triggering condition eased; a safety change when its condition eased and no limit broke.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tunerd.config import TuningConfig
from tunerd.policy.evidence import WindowStats, load_differs, ratio_interval, relative_change
from tunerd.policy.objective import for_trial

Decision = Literal["keep", "revert", "extend"]


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str
    objective: str = ""  # the objective's name (policy/objective.py); `unit` says what before/after are
    before: float | None = None
    after: float | None = None
    interval: tuple[float, float] | None = None  # 90 % bootstrap interval of after/before (throughput)
    inconclusive: bool = False
    figures: dict[str, object] = field(default_factory=dict)
    unit: str = ""


def judge(
    before: WindowStats,
    after: WindowStats,
    *,
    tuning: TuningConfig,
    purpose: Literal["performance", "safety"],
    eased: bool,
    extended: bool,
) -> Verdict:
    """Decide a trial from its two windows. `eased`: the triggering condition eased (rules.eased);
    `extended`: the after window was already extended once."""
    differs = load_differs(before, after, tuning.load_tolerance)
    if differs is not None:
        if not extended and tuning.max_extend_s > 0:
            return Verdict("extend", f"the offered load changed ({differs}): window extended")
        if purpose == "safety" and eased and not _limit_broken(before, after, tuning):
            return Verdict(
                "keep", f"inconclusive ({differs}), but the safety condition eased", inconclusive=True
            )
        return Verdict("revert", f"inconclusive: the offered load changed ({differs})", inconclusive=True)
    broken = _limit_broken(before, after, tuning)
    if broken:
        return Verdict("revert", broken)
    goal = for_trial(tuning.objective, before, after, tuning.tolerance)
    b, a = goal.of(before), goal.of(after)
    worse = goal.worse(a, b)
    interval = _interval(goal.samples(before), goal.samples(after))
    objective = goal.name
    figures = {"saturated_before": before.saturated, "saturated_after": after.saturated}

    def verdict(decision: Decision, reason: str) -> Verdict:
        return Verdict(decision, reason, objective, b, a, interval, figures=figures, unit=goal.unit)

    if purpose == "safety":
        if eased:
            return verdict("keep", "the safety condition eased")
        return verdict("revert", "the safety condition did not ease")
    if worse is None:
        return verdict("revert", f"{objective} unknown in a window")
    if worse:
        change = relative_change(b, a)
        text = f"{objective} worse: {b:.4g} → {a:.4g} ({change:+.1%}, tolerance {tuning.tolerance:.0%})"  # type: ignore[str-format]
        return verdict("revert", text)
    if not eased:
        return verdict("revert", "the triggering condition did not ease")
    change = relative_change(b, a)
    text = f"{objective} {b:.4g} → {a:.4g} ({change:+.1%}), condition eased" if change is not None else "kept"  # type: ignore[str-format]
    return verdict("keep", text)


def _interval(
    before: tuple[float, ...] | None, after: tuple[float, ...] | None
) -> tuple[float, float] | None:
    """The bootstrap interval of after/before where the objective has per-poll samples (throughput)."""
    return None if before is None or after is None else ratio_interval(before, after)


def _limit_broken(before: WindowStats, after: WindowStats, tuning: TuningConfig) -> str | None:
    """A latency limit the after window broke: absolute limits where configured, and ITL p95 growing
    beyond `itl_p95_max_increase` of its value before."""
    if (
        tuning.ttft_p95_max_s is not None
        and after.ttft_p95 is not None
        and after.ttft_p95 > tuning.ttft_p95_max_s
    ):
        return f"TTFT p95 {after.ttft_p95:.3f} s is above the limit {tuning.ttft_p95_max_s:g} s"
    if (
        tuning.itl_p95_max_s is not None
        and after.itl_p95 is not None
        and after.itl_p95 > tuning.itl_p95_max_s
    ):
        return f"ITL p95 {after.itl_p95 * 1000:.1f} ms is above the limit {tuning.itl_p95_max_s * 1000:g} ms"
    growth = tuning.itl_p95_max_increase
    if (
        growth > 0
        and before.itl_p95
        and after.itl_p95 is not None
        and after.itl_p95 > before.itl_p95 * (1 + growth)
    ):
        return (
            f"ITL p95 {before.itl_p95 * 1000:.1f} → {after.itl_p95 * 1000:.1f} ms: more than "
            f"{growth:.0%} worse (tuning.itl_p95_max_increase)"
        )
    return None
