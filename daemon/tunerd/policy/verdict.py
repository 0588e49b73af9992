"""Keep or revert a trial (pure): the before and after windows, the rule, the tuning settings and the
`[objective]` in; a verdict with its reason, the evidence and the figures that decided out.

Evidence before a decision (issue 22). A window's mean of autocorrelated per-poll samples is known only
to its noise (core/stats.py: the standard error over the effective samples), and on this box one minute
of a configuration's throughput is known to about ±6 % (docs/benchmarks.md: the defaults measured
132–172 tok/s across four windows). So a performance change is judged on the interval of its
objective's ratio after/before (`core.stats.mean_ratio_interval` of the per-poll samples, at
`[tuning] confidence`), never on the two point figures alone, against `1 + tolerance`:
- "better": the whole interval lies above 1 + tolerance → kept (when the rule's condition eased);
- "worse": the whole interval lies below 1 − tolerance → reverted;
- "no difference": the whole interval lies below 1 + tolerance but not below 1 − tolerance (the change
  is within the tolerance, or worse by less than it could tell) → reverted: a change that buys nothing
  the evidence can see is not worth its risk, and a restart back costs less than a wrong keep;
- straddling 1 + tolerance: the evidence cannot tell yet → the after window is extended (`extend`; the
  trial doubles it, up to `[tuning] max_extend_s` in all, tune/trials.Windows) and judged again; once
  the budget is spent (`budget_spent`) → "no difference (budget spent)" → reverted. Not extended when
  the rule's condition did not ease: no evidence could make it a keep ("no difference", reverted).
  When the spread between vLLM starts is the larger part of the noise and `starts_left`, the straddle
  asks for another start a side instead (`Verdict.more` "start"; the trial's `earlier` windows then join
  the evidence: policy/weigh.py), and it is "no difference" at once when even `[tuning] max_starts` a
  side could not tell.
A keep errs with at most (1 − confidence) / 2 at each look; the looks are few (the window doubles), and
the simulation of tests/unit/test_verdict_noise.py measures what they add up to on this box's noise.
A latency quantile (ITL p95, TTFT p95: one figure per window, no per-poll samples) has no interval: it
is judged on its two figures against the same tolerance ("better", "worse", "no difference"), as before.

Like with like, first:
- the offered load must match (per-request sizes; outstanding requests when saturated, the request rate
  otherwise); when it does not, the window is extended while the budget lasts, then the result is
  inconclusive: a performance change is reverted, a safety change kept only if its condition eased;
- a latency limit broken reverts any change (a throughput-only gate once kept a 6.6x latency
  regression: Hyperloom PR #1297);
- a safety change is kept when its condition eased, whatever the objective (its figures and evidence
  are reported).

The objective of a performance change is the one in force (`config/objective.in_force`): `tuning.objective`
names the configured kind's; goodput applies only with targets and the front door, else throughput does
and the verdict says why (`objective_reason`).

Throughput (and the latency kinds): throughput measures capacity only when the engine is saturated in
both windows; otherwise the latency at the offered load is the objective (ITL p95). Its ratio is that of
the windows' mean per-poll throughput.

Goodput, from the door's requests in each window (`WindowStats.slo`): A = attainment (the share of
requests that met every target: a proportion, each request a trial), feasible = A >= `[objective]
attainment` (the point figure: what the operator's target reads), D = Newcombe's interval of
A_after − A_before (core/stats.proportion_difference), G = per-poll goodput, tol = `tolerance`.
1. fewer than `[objective] min_requests` requests in the after window: extended while the budget lasts,
   then inconclusive → reverted; too few in the before window: inconclusive → reverted at once (a
   longer after window cannot add requests before the change);
2. infeasible before, feasible after: "better" (kept, even when G fell: feasibility is the point of the
   targets) only when D lies wholly above 0 — the attainment rose beyond its noise; D straddling 0 →
   extend, then "no difference (budget spent)" → reverted;
3. feasible before, infeasible after: reverted at once ("worse" when D lies wholly below 0, else "no
   difference"): no more evidence could make it a keep under rule 5's terms, and a restart back is the
   safe side;
4. both infeasible (closer to the targets, or not): "better" when D lies wholly above tol × A_before
   (the old relative rule, on the interval's low end) → kept; "worse" when D lies wholly below
   −tol × A_before, "no difference" when wholly below tol × A_before → reverted; straddling → extend,
   then "no difference (budget spent)";
5. both feasible: the ratio interval of mean per-poll goodput after/before, as throughput's above
   (kept only "better" and when the triggering condition eased).
`Verdict.evidence` says which ("better", "worse", "no difference", "no difference (budget spent)"),
and `Verdict.figures` carries the interval, the samples (n and effective n each side), each window's
relative noise and the minimum detectable effect the two windows implied (what `trial.decided` journals).

Just over 400 lines: the rules above are one decision, and its order (like with like, limits, safety,
then the objective's evidence) is what makes a keep safe; the interval arithmetic is core/stats.py's,
the evidence over several starts policy/weigh.py's and the latency limits policy/latency_limits.py's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tunerd.config import TuningConfig
from tunerd.config.objective import InForce, ObjectiveConfig, in_force
from tunerd.core import stats
from tunerd.policy.evidence import WindowStats, load_differs, relative_change
from tunerd.policy.latency_limits import limit_broken
from tunerd.policy.objective import Goodput, Objective, configured, feasible, for_trial
from tunerd.policy.weigh import SPENT, Evidence, More, Weighed, weigh_ratio

Decision = Literal["keep", "revert", "extend"]


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str
    objective: str = ""  # the objective's name (policy/objective.py); `unit` says what before/after are
    before: float | None = None
    after: float | None = None
    interval: tuple[float, float] | None = None  # the interval of after/before (mean per poll), `figures`
    inconclusive: bool = False
    figures: dict[str, object] = field(default_factory=dict)
    unit: str = ""
    goal: Objective | None = None  # the objective compared (its `fields()` name and unit the values)
    # Both windows' service levels (`service_levels`): attainment, goodput, feasibility, requests.
    service: Mapping[str, object] = field(default_factory=dict)
    objective_reason: str = ""  # why the objective compared is not the configured one ("" when it is)
    evidence: Evidence | None = None  # None: decided before any evidence was weighed (load, a limit)
    more: More = "window"  # an "extend": what would tell — a longer window, or another start a side


def judge(
    before: WindowStats,
    after: WindowStats,
    *,
    tuning: TuningConfig,
    purpose: Literal["performance", "safety"],
    eased: bool,
    budget_spent: bool,
    objective: ObjectiveConfig | None = None,
    door_enabled: bool = False,
    earlier: tuple[Sequence[WindowStats], Sequence[WindowStats]] = ((), ()),
    starts_left: bool = False,
) -> Verdict:
    """Decide a trial from its two windows (the module doc states the rules). `eased`: the triggering
    condition eased (rules.eased); `budget_spent`: the after window may not be extended again (its
    budget, `max_extend_s`, is spent); `objective` and `door_enabled`: `[objective]` and whether the door
    measures it (None: no targets); `earlier`: the windows of the earlier vLLM starts of each side, when
    the trial compares over several (`before` and `after` are the latest); `starts_left`: another start a
    side may still be spent (`[tuning] max_starts`)."""
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
        if not budget_spent:
            return early("extend", f"the offered load changed ({differs}): window extended")
        if purpose == "safety" and eased and not limit_broken(before, after, tuning):
            return early("keep", f"inconclusive ({differs}), but the safety condition eased", True)
        return early("revert", f"inconclusive: the offered load changed ({differs})", True)
    broken = limit_broken(before, after, tuning)
    if broken:
        return early("revert", broken)
    goodput = applies.name == Goodput.name
    if goodput:
        goal = configured(config, tuning.tolerance)
    else:
        goal = for_trial(applies.name, before, after, tuning.tolerance)
    b, a = goal.of(before), goal.of(after)
    starts_b, starts_a = _starts(goal, earlier[0], before), _starts(goal, earlier[1], after)
    weighed = None
    if starts_b and starts_a:
        weighed = weigh_ratio(
            starts_b,
            starts_a,
            tolerance=tuning.tolerance,
            confidence=tuning.confidence,
            spent=budget_spent,
            start_noise=tuning.start_noise,  # the windows are of two (or more) vLLM starts
            starts_left=starts_left,
            max_starts=tuning.max_starts,
        )
    interval = weighed.interval if weighed is not None else None
    figures: dict[str, object] = {"saturated_before": before.saturated, "saturated_after": after.saturated}
    if weighed is not None:
        figures.update(weighed.figures)

    def verdict(
        decision: Decision,
        reason: str,
        evidence: Evidence | None,
        inconclusive: bool = False,
        more: More | None = None,
    ) -> Verdict:
        pair = (interval.lo, interval.hi) if interval is not None else None
        return Verdict(
            decision, reason, goal.name, b, a, pair, inconclusive, figures, goal.unit, goal,
            service, applies.reason, evidence, more or "window",
        )  # fmt: skip

    if purpose == "safety":
        said = weighed.evidence if weighed is not None else None
        if eased:
            return verdict("keep", "the safety condition eased", said)
        return verdict("revert", "the safety condition did not ease", said)
    if goodput:
        decision, reason, evidence, inconclusive, more = _by_goodput(
            before,
            after,
            goal,
            config,
            weighed,
            eased=eased,
            spent=budget_spent,
            confidence=tuning.confidence,
        )
        figures.update(_attainment_figures(before, after, tuning.confidence))
        return verdict(decision, reason, evidence, inconclusive, more)
    if weighed is None:
        evidence = _by_figures(goal, b, a)
        if evidence is None:
            return verdict("revert", f"{goal.name} unknown in a window", None)
    else:
        evidence = _unless_hopeless(weighed.evidence, eased)
    more = weighed.more if weighed is not None else None
    hidden = figures.get("no_window_can_tell")  # weigh_ratio says why no window could tell
    decision, reason = _act_on(
        evidence, goal, b, a, interval, eased=eased, tolerance=tuning.tolerance, more=more, hidden=hidden
    )
    return verdict(decision, reason, evidence, more=more)


def _starts(goal: Objective, earlier: Sequence[WindowStats], latest: WindowStats) -> list[Sequence[float]]:
    """One side's per-poll samples of the objective, a window per vLLM start (earlier starts first);
    empty when the latest window has none (a latency quantile: judged on its figures). An earlier window
    without samples is left out."""
    samples = [goal.samples(window) for window in (*earlier, latest)]
    if samples[-1] is None:
        return []
    return [s for s in samples if s is not None]


def _unless_hopeless(evidence: Evidence | None, eased: bool) -> Evidence | None:
    """A straddle is extended only where a keep is still possible: not when the triggering condition did
    not ease (a performance change is then never kept) — said "no difference" (none was told)."""
    return "no difference" if evidence is None and not eased else evidence


def _by_figures(goal: Objective, b: float | None, a: float | None) -> Evidence | None:
    """The evidence of an objective without per-poll samples (a latency quantile): its two figures
    against the tolerance; None when unknown."""
    worse = goal.worse(a, b)
    if worse is None:
        return None
    if worse:
        return "worse"
    return "better" if goal.better(a, b) else "no difference"


def _act_on(
    evidence: Evidence | None,
    goal: Objective,
    b: float | None,
    a: float | None,
    interval: stats.Interval | None,
    *,
    eased: bool,
    tolerance: float,
    more: More | None = None,
    hidden: object = None,
) -> tuple[Decision, str]:
    """What a performance change's evidence decides (module doc), with the reason an operator reads
    (`more`: what a straddle asks for; `hidden`: why no window or start could tell, weigh.py's
    `no_window_can_tell`, said instead of the tolerance: the interval straddles it)."""
    change = relative_change(b, a)
    moved = f"{goal.name} {goal.describe(b)} → {goal.describe(a)}"
    if change is not None:
        moved += f" ({change:+.1%})"
    if interval is not None:
        moved += f", ratio interval [{interval.lo:.3f}, {interval.hi:.3f}]"
    if evidence is None:
        then = "another vLLM start a side" if more == "start" else "window extended"
        return "extend", f"{moved} straddles 1 + tolerance {tolerance:.0%}: {then}"
    if evidence != "worse" and not eased:  # no keep was possible whatever the evidence
        return "revert", f"{moved}: {evidence}; the triggering condition did not ease"
    if evidence == "better":
        if not eased:
            return "revert", f"{moved} better, but the triggering condition did not ease"
        return "keep", f"{moved} better beyond the tolerance {tolerance:.0%}, condition eased"
    if evidence == "worse":
        return "revert", f"{moved} worse beyond the tolerance {tolerance:.0%}"
    if evidence == SPENT:
        return "revert", f"{moved}: no difference the evidence could tell (extension budget spent)"
    if hidden:
        return "revert", f"{moved}: no difference any window could tell: {hidden}"
    return "revert", f"{moved}: no difference beyond the tolerance {tolerance:.0%}"


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
    weighed: Weighed | None,
    *,
    eased: bool,
    spent: bool,
    confidence: float,
) -> tuple[Decision, str, Evidence | None, bool, More | None]:
    """(decision, reason, evidence, inconclusive, more) of a performance change under goodput (rules 1-5,
    module doc; `more`: what rule 5's straddle asks for, None elsewhere: a longer window)."""
    least = objective.min_requests
    n_before, n_after = Goodput.requests(before) or 0, Goodput.requests(after) or 0
    if n_before < least:
        text = f"{n_before:.0f} requests before the change (min_requests {least})"
        return "revert", f"inconclusive: {text}", None, True, None
    if n_after < least:
        text = f"{n_after:.0f} requests after the change (min_requests {least})"
        if not spent:
            return "extend", f"too few requests to judge: {text}: window extended", None, False, None
        return "revert", f"inconclusive: {text}", None, True, None
    share_b, share_a = Goodput.attainment(before), Goodput.attainment(after)
    target = objective.attainment
    ok_b, ok_a = feasible(share_b, target), feasible(share_a, target)
    if ok_b is None or ok_a is None or share_b is None or share_a is None:
        return "revert", "attainment unknown in a window (no targets?)", None, False, None
    shares = f"attainment {share_b:.1%} → {share_a:.1%} (target {target:.0%})"
    b, a = goal.of(before), goal.of(after)
    good = f"{goal.name} {goal.describe(b)} → {goal.describe(a)}"
    if ok_b and ok_a:  # rule 5: the goodput ratio, as throughput's
        if weighed is None:
            evidence = _by_figures(goal, b, a)
            if evidence is None:
                return "revert", f"{goal.name} unknown in a window", None, False, None
        else:
            evidence = _unless_hopeless(weighed.evidence, eased)
        interval = weighed.interval if weighed is not None else None
        more = weighed.more if weighed is not None else None
        decision, reason = _act_on(
            evidence, goal, b, a, interval, eased=eased, tolerance=goal.tolerance, more=more
        )
        return decision, f"feasible ({shares}), {reason}", evidence, False, more
    diff = _attainment_difference(before, after, confidence)
    if diff is None:
        return "revert", "attainment unknown in a window (no requests?)", None, False, None
    told = f"{shares}, difference [{diff.lo:+.3f}, {diff.hi:+.3f}]"
    if ok_b:  # rule 3: feasible → infeasible
        evidence: Evidence = "worse" if diff.side_of(0.0) == "below" else "no difference"
        return "revert", f"no longer feasible: {told}; {good}", evidence, False, None
    if ok_a:  # rule 2: infeasible → feasible
        if diff.side_of(0.0) == "above":
            return "keep", f"feasible now: {told}; {good}", "better", False, None
        if not spent:
            return (
                "extend",
                f"feasible now by the point figure, but {told} straddles 0: window extended",
                None,
                False,
                None,
            )
        return "revert", f"feasible by the point figure only: {told} (budget spent)", SPENT, False, None
    margin = goal.tolerance * share_b  # rule 4: both infeasible
    if diff.side_of(margin) == "above":
        return "keep", f"still infeasible, but {told} improved beyond the tolerance", "better", False, None
    if diff.side_of(margin) == "below":
        evidence = "worse" if diff.side_of(-margin) == "below" else "no difference"
        return (
            "revert",
            f"still infeasible and {told} did not improve beyond the tolerance",
            evidence,
            False,
            None,
        )
    if not spent:
        return (
            "extend",
            f"still infeasible; {told} straddles the tolerance: window extended",
            None,
            False,
            None,
        )
    return "revert", f"still infeasible; {told}: no difference told (budget spent)", SPENT, False, None


def _attainment_difference(
    before: WindowStats, after: WindowStats, confidence: float
) -> stats.Interval | None:
    """Newcombe's interval of attainment after − before, from the windows' counted requests and the
    share of them that were good (the door's counters; the `slo.*` signals where a window has none)."""
    counts = []
    for window in (before, after):
        n, share = Goodput.requests(window), Goodput.attainment(window)
        if n is None or share is None:
            return None
        counts.append((share * n, n))
    (good_b, n_b), (good_a, n_a) = counts
    return stats.proportion_difference(good_b, n_b, good_a, n_a, confidence=confidence)


def _attainment_figures(before: WindowStats, after: WindowStats, confidence: float) -> dict[str, object]:
    """The attainment's intervals for the journal: each window's Wilson interval and the difference's."""
    out: dict[str, object] = {}
    for name, window in (("before", before), ("after", after)):
        n, share = Goodput.requests(window), Goodput.attainment(window)
        ci = (
            stats.wilson(share * n, n, confidence=confidence) if n is not None and share is not None else None
        )
        out[f"attainment_interval_{name}"] = ci.as_list() if ci is not None else None
    diff = _attainment_difference(before, after, confidence)
    out["attainment_difference_interval"] = diff.as_list() if diff is not None else None
    return out
