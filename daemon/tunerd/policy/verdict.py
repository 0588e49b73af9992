"""Keep or revert a trial (pure): the before and after windows, the rule, the tuning settings and the
`[objective]` in; a verdict with its reason and the figures that decided out.

Like with like:
- the offered load must match (per-request sizes; outstanding requests when saturated, the request rate
  otherwise); when it does not, the window is extended once (`extend`), then the result is
  inconclusive: a performance change is reverted, a safety change kept only if its condition eased;
- a latency limit broken reverts any change (a throughput-only gate once kept a 6.6x latency
  regression: Hyperloom PR #1297);
- a safety change is kept when its condition eased, whatever the objective (its figures are reported).

The objective of a performance change is the one in force (`config/objective.in_force`): `tuning.objective`
names the configured kind's; goodput applies only with targets and the front door, else throughput does
and the verdict says why (`objective_reason`).

Throughput (and the latency kinds): throughput measures capacity only when the engine is saturated in
both windows; otherwise the latency at the offered load is the objective (ITL p95). The change is kept
when the objective is not worse beyond `tolerance` and the triggering condition eased.

Goodput, from the door's requests in each window (`WindowStats.slo`): A = attainment (the share of
requests that met every target), feasible = A >= `[objective] attainment`, G = goodput, tol = `tolerance`.
1. fewer than `[objective] min_requests` requests in the after window: extended once (unless it was
   already, or `max_extend_s` is 0), then inconclusive → reverted; too few in the before window:
   inconclusive → reverted at once (a longer after window cannot add requests before the change);
2. infeasible before, feasible after: kept, even when G fell (feasibility is the point of the targets);
3. feasible before, infeasible after: reverted, even when G rose;
4. both infeasible: kept when A_after > A_before × (1 + tol) (closer to the targets), else reverted;
5. both feasible: reverted when G_after < G_before × (1 − tol), or when the triggering condition did not
   ease (a change that did nothing for its rule is not kept for noise); else kept.
The decision reads the windows' figures (as the throughput objective's does); `interval` is the 90 %
bootstrap interval of median per-poll goodput after/before (throughput's likewise), journaled with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from tunerd.config import TuningConfig
from tunerd.config.objective import InForce, ObjectiveConfig, in_force
from tunerd.core.signal_window import quantile_bucket_of
from tunerd.policy.evidence import WindowStats, load_differs, ratio_interval, relative_change
from tunerd.policy.objective import Goodput, Objective, configured, feasible, for_trial

Decision = Literal["keep", "revert", "extend"]


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str
    objective: str = ""  # the objective's name (policy/objective.py); `unit` says what before/after are
    before: float | None = None
    after: float | None = None
    interval: tuple[float, float] | None = None  # 90 % bootstrap interval of after/before (per poll)
    inconclusive: bool = False
    figures: dict[str, object] = field(default_factory=dict)
    unit: str = ""
    goal: Objective | None = None  # the objective compared (its `fields()` name and unit the values)
    # Both windows' service levels (`service_levels`): attainment, goodput, feasibility, requests.
    service: Mapping[str, object] = field(default_factory=dict)
    objective_reason: str = ""  # why the objective compared is not the configured one ("" when it is)


def judge(
    before: WindowStats,
    after: WindowStats,
    *,
    tuning: TuningConfig,
    purpose: Literal["performance", "safety"],
    eased: bool,
    extended: bool,
    objective: ObjectiveConfig | None = None,
    door_enabled: bool = False,
) -> Verdict:
    """Decide a trial from its two windows (the module doc states the rules). `eased`: the triggering
    condition eased (rules.eased); `extended`: the after window was already extended once; `objective`
    and `door_enabled`: `[objective]` and whether the door measures it (None: no targets)."""
    config = objective if objective is not None else ObjectiveConfig()
    applies = objective_in_force(tuning, config, door_enabled)
    service = service_levels(before, after, config)

    def early(decision: Decision, reason: str, inconclusive: bool = False) -> Verdict:
        """A verdict before any objective was compared (the load, a limit)."""
        return Verdict(
            decision, reason, inconclusive=inconclusive, service=service, objective_reason=applies.reason
        )

    differs = load_differs(before, after, tuning.load_tolerance)
    if differs is not None:
        if not extended and tuning.max_extend_s > 0:
            return early("extend", f"the offered load changed ({differs}): window extended")
        if purpose == "safety" and eased and not _limit_broken(before, after, tuning):
            return early("keep", f"inconclusive ({differs}), but the safety condition eased", True)
        return early("revert", f"inconclusive: the offered load changed ({differs})", True)
    broken = _limit_broken(before, after, tuning)
    if broken:
        return early("revert", broken)
    goodput = applies.name == Goodput.name
    if goodput:
        goal = configured(config, tuning.tolerance)
    else:
        goal = for_trial(applies.name, before, after, tuning.tolerance)
    b, a = goal.of(before), goal.of(after)
    interval = _interval(goal.samples(before), goal.samples(after))
    figures = {"saturated_before": before.saturated, "saturated_after": after.saturated}

    def verdict(decision: Decision, reason: str, inconclusive: bool = False) -> Verdict:
        return Verdict(
            decision, reason, goal.name, b, a, interval, inconclusive, figures, goal.unit, goal,
            service, applies.reason,
        )  # fmt: skip

    if purpose == "safety":
        if eased:
            return verdict("keep", "the safety condition eased")
        return verdict("revert", "the safety condition did not ease")
    if goodput:
        decision, reason, inconclusive = _by_goodput(
            before, after, goal, config, eased=eased, extended=extended, max_extend_s=tuning.max_extend_s
        )
        return verdict(decision, reason, inconclusive)
    name = goal.name
    worse = goal.worse(a, b)
    if worse is None:
        return verdict("revert", f"{name} unknown in a window")
    if worse:
        change = relative_change(b, a)
        text = f"{name} worse: {b:.4g} → {a:.4g} ({change:+.1%}, tolerance {tuning.tolerance:.0%})"  # type: ignore[str-format]
        return verdict("revert", text)
    if not eased:
        return verdict("revert", "the triggering condition did not ease")
    change = relative_change(b, a)
    text = f"{name} {b:.4g} → {a:.4g} ({change:+.1%}), condition eased" if change is not None else "kept"  # type: ignore[str-format]
    return verdict("keep", text)


def objective_in_force(tuning: TuningConfig, objective: ObjectiveConfig, door_enabled: bool) -> InForce:
    """What a trial compares: `tuning.objective` (the configured kind's objective), except goodput when it
    is not in force (no targets, or the door is off): throughput then, with `in_force`'s reason."""
    if tuning.objective != Goodput.name:
        return InForce("", tuning.objective)
    return in_force(objective, door_enabled)


def service_levels(before: WindowStats, after: WindowStats, objective: ObjectiveConfig) -> dict[str, object]:
    """Both windows' attainment, goodput (in `goodput_unit`), feasibility and the door's requests, for
    the journal, whatever objective decides; every figure None without targets (nothing to attain)."""
    goal = Goodput(count=objective.count)
    out: dict[str, object] = {"attainment_target": objective.attainment, "goodput_unit": goal.unit}
    for name, window in (("before", before), ("after", after)):
        has = objective.targets.any
        share = Goodput.attainment(window) if has else None
        good = goal.of(window) if has else None
        requests = Goodput.requests(window) if has else None
        out[f"attainment_{name}"] = None if share is None else round(share, 4)
        out[f"goodput_{name}"] = None if good is None else round(good, 3)
        out[f"feasible_{name}"] = feasible(share, objective.attainment)
        out[f"requests_{name}"] = None if requests is None else int(requests)
    return out


def _by_goodput(
    before: WindowStats,
    after: WindowStats,
    goal: Objective,
    objective: ObjectiveConfig,
    *,
    eased: bool,
    extended: bool,
    max_extend_s: float,
) -> tuple[Decision, str, bool]:
    """(decision, reason, inconclusive) of a performance change under goodput (rules 1-5, module doc)."""
    least = objective.min_requests
    n_before, n_after = Goodput.requests(before) or 0, Goodput.requests(after) or 0
    if n_before < least:
        text = f"{n_before:.0f} requests before the change (min_requests {least})"
        return "revert", f"inconclusive: {text}", True
    if n_after < least:
        text = f"{n_after:.0f} requests after the change (min_requests {least})"
        if not extended and max_extend_s > 0:
            return "extend", f"too few requests to judge: {text}: window extended", False
        return "revert", f"inconclusive: {text}", True
    share_b, share_a = Goodput.attainment(before), Goodput.attainment(after)
    target = objective.attainment
    ok_b, ok_a = feasible(share_b, target), feasible(share_a, target)
    if ok_b is None or ok_a is None or share_b is None or share_a is None:
        return "revert", "attainment unknown in a window (no targets?)", False
    shares = f"attainment {share_b:.1%} → {share_a:.1%} (target {target:.0%})"
    b, a = goal.of(before), goal.of(after)
    good = f"{goal.name} {goal.describe(b)} → {goal.describe(a)}"
    if ok_a and not ok_b:
        return "keep", f"feasible now: {shares}; {good}", False
    if ok_b and not ok_a:
        return "revert", f"no longer feasible: {shares}; {good}", False
    if not ok_b:  # both infeasible: closer to the targets, or not
        if share_a > share_b * (1 + goal.tolerance):
            return "keep", f"still infeasible, but {shares} improved beyond the tolerance", False
        return "revert", f"still infeasible and {shares} did not improve beyond the tolerance", False
    worse = goal.worse(a, b)
    if worse is None:
        return "revert", f"{goal.name} unknown in a window", False
    change = relative_change(b, a)
    moved = f"{good} ({change:+.1%})" if change is not None else good
    if worse:
        return "revert", f"feasible, but {moved} worse beyond the tolerance {goal.tolerance:.0%}", False
    if not eased:
        return "revert", f"feasible, {moved}, but the triggering condition did not ease", False
    return "keep", f"feasible ({shares}), {moved}, condition eased", False


def _interval(
    before: tuple[float, ...] | None, after: tuple[float, ...] | None
) -> tuple[float, float] | None:
    """The bootstrap interval of after/before where the objective has per-poll samples (throughput,
    goodput)."""
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
