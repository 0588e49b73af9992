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
from tunerd.core.signal_window import quantile_bucket_of
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
    beyond `itl_p95_max_increase` of its value before.

    Only what was measured breaks a limit. Where the door timed every request (`door.ttft.p95`,
    `door.tpot.p95`: exact, the clients' view) those figures are read; otherwise vLLM's histogram
    percentiles, which are known only to their bucket: an absolute limit breaks when the after window's
    whole bucket lies above it (lower edge ≥ the limit), the increase only when the after window's bucket
    lies wholly above the one before and the interpolated values grew beyond the share. Issue 21: TTFT p95
    read 2.02 s, interpolated between the 1.0 and 2.5 s edges, while no client waited over 1.26 s; ITL p95
    read 9.5 ms in every window from the 0–10 ms bucket while the clients' ranged 1.6–4.6 ms."""
    ttft = _figure(after, _TTFT, after.ttft_p95)
    if tuning.ttft_p95_max_s is not None and ttft is not None and ttft.above(tuning.ttft_p95_max_s):
        return f"{ttft.what} {ttft.text(1.0, 's', 3)} is above the limit {tuning.ttft_p95_max_s:g} s"
    itl = _figure(after, _ITL, after.itl_p95)
    if tuning.itl_p95_max_s is not None and itl is not None and itl.above(tuning.itl_p95_max_s):
        limit = tuning.itl_p95_max_s * 1000
        return f"{itl.what} {itl.text(1000.0, 'ms', 1)} is above the limit {limit:g} ms"
    growth = tuning.itl_p95_max_increase
    if growth <= 0:
        return None
    b, a = _figure(before, _ITL, before.itl_p95), itl
    if b is None or a is None or b.exact != a.exact:  # like with like: the same statistic on both sides
        b, a = _figure(before, _ITL[1:], before.itl_p95), _figure(after, _ITL[1:], after.itl_p95)
    if b is None or a is None or not b.value or not a.grew(b, growth):
        return None
    return (
        f"{a.what} {b.text(1000.0, 'ms', 1)} → {a.text(1000.0, 'ms', 1)}: more than "
        f"{growth:.0%} worse (tuning.itl_p95_max_increase)"
    )


# (the door's exact signal, its text), then (vLLM's histogram percentile, its text): what a limit reads.
_TTFT = (("door.ttft.p95", "clients' TTFT p95 (door)"), ("ttft.p95", "TTFT p95"))
_ITL = (("door.tpot.p95", "clients' TPOT p95 (door)"), ("itl.p95", "ITL p95"))


@dataclass(frozen=True, slots=True)
class _Figure:
    """A window's latency percentile: exact (the door's per request), or vLLM's with the bucket
    `(lo, hi]` it falls in (None: no edges known, e.g. a window built without them)."""

    value: float
    exact: bool
    bucket: tuple[float, float] | None
    what: str

    def above(self, limit: float) -> bool:
        """Measured above `limit`: the whole bucket where there is one."""
        return self.bucket[0] >= limit if self.bucket is not None else self.value > limit

    def grew(self, before: _Figure, share: float) -> bool:
        """Grew beyond `share` of `before`, and (buckets) into a bucket wholly above before's."""
        if self.value <= before.value * (1 + share):
            return False
        return self.bucket is None or before.bucket is None or self.bucket[0] >= before.bucket[1]

    def text(self, scale: float, unit: str, digits: int) -> str:
        out = f"{self.value * scale:.{digits}f} {unit}"
        if self.bucket is not None:
            lo, hi = self.bucket
            top = "+Inf" if hi == float("inf") else f"{hi * scale:g}"
            out += f" (bucket {lo * scale:g}–{top} {unit})"
        return out


def _figure(window: WindowStats, names: tuple[tuple[str, str], ...], value: float | None) -> _Figure | None:
    """The door's exact figure where `names` has one and the window measured it, else vLLM's percentile
    (the last of `names`; its value `value`, the field the window carries) with its bucket."""
    *door, (name, what) = names
    exact = window.values.get(door[0][0]) if door else None
    if exact is not None:
        return _Figure(exact, True, None, door[0][1])
    if value is None:
        return None
    return _Figure(value, False, quantile_bucket_of(window.values, name), what)
