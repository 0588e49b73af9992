"""Exploration (pure): a coordinate search over named parameters, one at a time, on a ladder of values,
that moves only on evidence which beats the noise.

For each parameter in turn, from the best configuration found so far:
1. step, coarse to fine: measure the point a stride away on each side — a third of the ladder at first,
   then half that, down to one rung (a ladder of powers of two: 8× at first on max_num_seqs 1..256). When
   one is confirmed better (below), move there and keep stepping that way; past a point that looked
   better but could not be confirmed, look one stride further (a point further away differs more, so the
   evidence may tell it apart); stop a side at a point that did not look better;
2. shrink the step: measure the midpoint between the best and a ladder neighbour only when it is worth a
   restart: the neighbour is infeasible (where feasibility ends), or the parabola through the best and
   its two neighbours expects the midpoint better by more than the tolerance at `probes` probes — a
   smaller expected gain could not be confirmed, so the restart is not spent (`Search.worth_measuring`);
3. stop: nothing was confirmed better.
Where the tuning memory already knows points of a parameter, its search starts at one rung (refining).
So an exploration of N parameters costs about the sum of their steps, not their product (the grid
sweep's). A point that fails (its start fails, a latency limit breaks) is infeasible (None); a feasible
point always beats it. While no feasible point is known, the search still has a direction: a point that
breaks the limit by less (`limit_excess`, by more than the floor) is the better one, so a configuration
in force that already breaks the limit is left towards the limit instead of standing still. A point
already measured (in this search, or known from an earlier one under the same load) is not restarted to.

**Never a move on one measurement** (issue 22; docs/benchmarks.md: one configuration measured 132–172
tok/s across four windows, the 3 % tolerance was below that noise, and the search moved on noise: 9
restarts, 0.98× random search). A point is measured by probes, several in one start: the configuration in
force gets `probes` of them before the search begins (the reference every candidate is compared with),
every point at least two (`MIN_PROBES`: one more probe is the cheapest look at the noise, and a point
whose first probe read low gets its second chance), and a point that looks better than the best by more
than the floor (`goal.tolerance`, `tuning.explore_tolerance`) more, up to `probes`, while the evidence
cannot tell. It becomes the point the search moves from only when the interval of its ratio to the best
(`ratio_interval`) lies wholly above 1 + floor; at an interval wholly below, or at `probes` probes, it
is not taken.

Why more probes of the same start and not interleaved windows of candidate and incumbent: on one engine
the incumbent and the candidate are two vLLM starts, so each interleaved window is a restart (45–110 s,
the budget's unit) — the confirmation would cost as much as the search. A probe of the point in force
costs seconds. But probes of one start share that start: they cannot see the noise *between* starts (two
starts of vLLM with the same flags served 2,256 and 3,511 tok/s on the 2-core box, issue 22). So a
point's noise is its probes' noise plus `start_noise` (`tuning.start_noise`, the relative spread
of one start's mean; an operator's figure, no probe count shrinks it), added in quadrature:
    noise(point) = √((spread / √probes)² + start_noise²)
where `spread` is the relative standard deviation of one probe pooled over every point this search
probed more than once (each point's own two or three probes would give it one or two degrees of freedom;
pooled, they are many). The ratio's interval is normal on its log with the two points' noises in
quadrature, at `core/stats.CONFIDENCE` with Student's quantile for the pooled degrees of freedom — not
`core/stats.mean_ratio_interval`, whose autocorrelation correction is for per-second samples of one
window, where probes are independent runs and a point has only two or three of them.

**The tolerance follows the noise.** `tolerance(probes)` is the smallest change the search can detect
between the best and a point with that many probes — `core/stats.min_detectable_effect` of their
noises — never below the floor. It is what the journal's `explore.point` says beside `noise` (the
probe's pooled spread and `start_noise`), and what a midpoint's expected gain must exceed in stage 2.
The move itself needs the interval above 1 + floor: with the noise in the interval's width the threshold
a measured ratio must pass is the floor and about z · noise more, so the floor is the smallest gain worth
a restart and the noise decides how sure the search must be of it.

What it buys (tests/unit/test_explore_vs_random.py, 100 seeded landscapes over max_num_seqs ×
max_num_batched_tokens with this box's noise — 0.10 between starts, 0.42 between probes): the true value
of its choice beat random search's at equal restarts on 58 of 100, median ratio 1.02; the search before
this one (a move on one probe beyond 3 %) on 36, median 0.92. Against random points measured with as
many probes as this search's, a tie (49 of 100, 1.00): at this noise the evidence, not the search's
shape, is what a restart buys.

The objective (`policy/objective.EXPLORE`, with `explore_tolerance`) is the probe's generation
throughput — unless live traffic saturated the engine in the
window before the search's first probe: then the live window's throughput (all traffic, the probe's
included) is what measures the engine's capacity, and the probe's few requests only their share of it.
`objective_source` fixes that once per search, so every point is scored the same way. Under a goodput
objective too, for now: the probe goes straight to vLLM and has no client-side attainment, and a search's
only feasibility is its latency limits (docs/objective.md); a rule's trial judges by goodput.

`Search` is a value: `next_point()` says what to restart to, `again` whether the point in force wants one
more probe first, `record()` folds one measurement in and returns the new search. The caller
(tune/explorer.py) turns each point into a trial and each probe into a `record`. Over 400 lines: the
search is one value whose stages, confirmations and noise-derived tolerance read together, with the ladders
and scoring it is built from beside it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist

from tunerd.core.params import Backend
from tunerd.core.stats import CONFIDENCE, Interval, min_detectable_effect
from tunerd.policy.evidence import WindowStats
from tunerd.policy.objective import Objective, Source
from tunerd.policy.tunables import REGISTRY, Value, bounds_of


def objective_source(live: WindowStats | None) -> Source:
    """The search's objective, fixed when it starts: "live" when live traffic's window before its first
    probe (the probe's own requests can saturate a small max_num_seqs) was saturated, else "probe"."""
    return "live" if live is not None and live.saturated else "probe"


def scored(
    goal: Objective, source: Source, probe: float | None, live: WindowStats | None
) -> tuple[float | None, Source]:
    """A point's value of `goal` and what measured it. `probe` is the probe's value, None when the probe
    says the point is infeasible (errors, a latency limit broke): infeasible in either mode. In live
    mode the live window's value; the probe's when there is no window (too few polls)."""
    if probe is None or source == "probe" or live is None:
        return probe, "probe"
    return goal.of(live), "live"


def limit_excess(
    ttft_p95: float | None,
    itl_p95: float | None,
    *,
    ttft_max: float | None,
    itl_max: float | None,
) -> float | None:
    """How far a point breaks its worst latency limit (observed / limit, above 1), None when it breaks
    none (or none is set)."""
    ratios = [value / limit for value, limit in ((ttft_p95, ttft_max), (itl_p95, itl_max)) if value and limit]
    worst = max(ratios, default=0.0)
    return worst if worst > 1 else None


def ladder(
    param: str,
    current: Value,
    *,
    backend: Backend,
    unified: bool = False,
    bounds: Mapping[str, tuple[float, float]] | None = None,
    unified_cap: float = 0.85,
) -> tuple[Value, ...]:
    """The values an exploration of `param` visits, ascending, `current` among them: the backend's
    choices (block_size), powers of two within the bounds (integers), a 0.05 grid (fractions), both
    booleans."""
    tunable = REGISTRY[param]
    low, high = bounds_of(tunable, bounds or {}, backend, unified, unified_cap)
    if tunable.boolean:
        return (False, True)
    values: set[Value]
    if tunable.choices(backend):
        values = {c for c in tunable.choices(backend) if low <= c <= high}
    elif tunable.integer:
        first, last = max(0, math.ceil(math.log2(max(low, 1)))), math.floor(math.log2(high))
        values = {2**e for e in range(first, last + 1)}
    else:
        values = {round(k * 0.05, 2) for k in range(math.ceil(low / 0.05), math.floor(high / 0.05) + 1)}
    values.add(current)
    return tuple(sorted(values))


def midpoint(a: Value, b: Value, integer: bool) -> Value | None:
    """The geometric midpoint of two ladder values (rounded for integers); None when there is none."""
    low, high = sorted((float(a), float(b)))
    if integer:
        mid = round(math.sqrt(low * high)) if low > 0 else round((low + high) / 2)
        return int(mid) if low < mid < high else None
    mid = round((low + high) / 2, 3)
    return mid if low < mid < high else None


MIN_PROBES = 2  # every point's probes in its start before it is judged (a noise figure, a second chance)
Key = tuple[str, Value]  # a point: (the parameter, its value), the other parameters at their best


def student_t(p: float, dof: float) -> float:
    """Student's t quantile `p` for `dof` degrees of freedom (Cornish–Fisher to the 1/dof² term: within
    6 % of the exact quantile from 2 degrees of freedom at p = 0.95, exact as dof grows); the normal
    quantile when `dof` is infinite."""
    z = NormalDist().inv_cdf(p)
    if math.isinf(dof):
        return z
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


@dataclass(frozen=True)
class Axis:
    """One parameter's search: its ladder, the best value so far, the stage it is in."""

    param: str
    values: tuple[Value, ...]
    integer: bool
    center: Value
    direction: int = 0  # +1 / -1 once a step that way improved; 0 while both sides are measured
    anchor: Value | None = None  # set when the steps are done: the midpoints around it are measured
    done: bool = False
    discrete: bool = False  # the ladder is every allowed value (block_size's choices, booleans): no midpoints
    stride: int = 1  # ladder rungs per step: 2 at first on a long ladder, then 1


@dataclass(frozen=True)
class Search:
    """A whole exploration: the axes in order and every measurement (`measured`: a point's mean
    objective; None: infeasible, with its limit excess when it served but broke a latency limit;
    `samples`: the probes' values behind a mean this search measured)."""

    axes: tuple[Axis, ...]
    goal: Objective  # what a measurement is; its tolerance is the floor a move must clear
    measured: Mapping[Key, float | None] = field(default_factory=dict)
    best: Mapping[str, Value] = field(default_factory=dict)  # the best configuration so far
    best_objective: float | None = None
    best_excess: float | None = None  # while the best is infeasible: how far it breaks its limit
    samples: Mapping[Key, tuple[float, ...]] = field(default_factory=dict)
    best_samples: tuple[float, ...] = ()  # the probes behind `best_objective`
    probes: int = 3  # the most probes of one point in one start (the first and its confirmations)
    start_noise: float = 0.0  # the relative spread of one start's mean, which no probe of it can see
    again: Key | None = None  # the point in force wants one more probe before the search goes on
    compared: Mapping[str, object] = field(default_factory=dict)  # the last probe's evidence and verdict

    @property
    def done(self) -> bool:
        return all(axis.done for axis in self.axes)

    # -- the noise ---------------------------------------------------------------------------------

    def spread(self) -> tuple[float | None, int]:
        """(the relative standard deviation of one probe, pooled over every point probed more than
        once — None when none was —, its degrees of freedom)."""
        squares, dof = 0.0, 0
        for values in self.samples.values():
            mean = statistics.fmean(values) if values else 0.0
            if len(values) >= 2 and mean > 0:  # floats, not statistics.variance's exact fractions: fast
                squares += sum((v - mean) ** 2 for v in values) / mean**2
                dof += len(values) - 1
        return (math.sqrt(squares / dof), dof) if dof else (None, 0)

    def noise(self, samples: Sequence[float]) -> float | None:
        """The relative noise of the mean of `samples` (probes of one start): the pooled spread over
        √probes and `start_noise` in quadrature; None without a spread or a probe."""
        spread, _ = self.spread()
        if spread is None or not samples:
            return None
        return math.hypot(spread / math.sqrt(len(samples)), self.start_noise)

    def tolerance(self, probes: int) -> float:
        """The smallest relative change between the best and a point with `probes` probes that this
        search detects (`core/stats.min_detectable_effect` of their noises), never below the floor."""
        best, point = self.noise(self.best_samples), self.noise((0.0,) * probes)
        if best is None or point is None:
            return self.goal.tolerance
        return max(self.goal.tolerance, min_detectable_effect(best, point))

    def ratio(self, value: float) -> float | None:
        """How much better `value` is than the best, as a ratio (above 1: better; the objective's
        direction taken into account); None without a positive pair."""
        best = self.best_objective
        if best is None or best <= 0 or value <= 0:
            return None
        return value / best if self.goal.direction == "higher" else best / value

    def ratio_interval(self, samples: Sequence[float]) -> Interval | None:
        """The interval, at `core/stats.CONFIDENCE`, of the ratio of a point with `samples` to the best
        (`ratio`): normal on its log, the two noises in quadrature, Student's quantile for the pooled
        spread's degrees of freedom. None without a noise figure."""
        best, point = self.noise(self.best_samples), self.noise(samples)
        ratio = self.ratio(statistics.fmean(samples)) if samples else None
        if best is None or point is None or ratio is None:
            return None
        _, dof = self.spread()
        # A start's noise is the operator's figure, not estimated: only the probes' share is uncertain.
        half = student_t(0.5 + CONFIDENCE / 2, dof) * math.hypot(best, point)
        return Interval(ratio * math.exp(-half), ratio * math.exp(half), CONFIDENCE)

    def evidence(self, key: Key) -> dict[str, object]:
        """What the journal says of a point's comparison with the best: its probes, the noise, the
        tolerance (and its floor), the ratio and its interval. `record` keeps the last one, with its
        verdict, in `compared` (taken before a move: against the best it was compared with)."""
        samples = self.samples.get(key, ())
        spread, dof = self.spread()
        value = self.measured.get(key)
        interval = self.ratio_interval(samples) if samples else None
        return {
            "probes": len(samples),
            "noise": {
                "probe_spread": None if spread is None else round(spread, 4),
                "dof": dof,
                "start_noise": self.start_noise,
                "point": _rounded(self.noise(samples)),
                "best": _rounded(self.noise(self.best_samples)),
            },
            "tolerance": round(self.tolerance(max(len(samples), 1)), 4),
            "tolerance_floor": self.goal.tolerance,
            "ratio": _rounded(self.ratio(value) if value is not None else None),
            "ratio_interval": interval.as_list() if interval is not None else None,
        }

    # -- the search --------------------------------------------------------------------------------

    def next_point(self) -> tuple[Search, Key | None]:
        """(the search moved past exhausted stages, the next (param, value) to restart to — the other
        parameters at their best — or None when the exploration is over). Ask `again` first."""
        search = self
        while (axis := _current(search)) is not None:
            value = _candidate(search, axis)
            if value is not None:
                return search, (axis.param, value)
            search = search._replace_axis(axis, _next_stage(axis))
        return search, None

    def record(
        self, param: str, value: Value, objective: float | None, excess: float | None = None
    ) -> Search:
        """Fold one probe of (param, value) in (None: infeasible; `excess`: how far it broke a latency
        limit). A feasible probe adds to the point's samples; the point becomes the best only when its
        interval to the best clears the floor (`verdict`); `again` says whether it wants another probe."""
        key = (param, value)
        search = replace(self, again=None, compared={})
        axis = _current(search)
        if objective is None:  # infeasible: its probes so far do not matter
            search = replace(search, measured={**search.measured, key: None})
            if axis is None or axis.param != param or not search.improves(None, excess):
                return search
            return search._move(axis, value, (), excess)
        samples = (*search.samples.get(key, ()), objective)
        search = replace(
            search,
            measured={**search.measured, key: statistics.fmean(samples)},
            samples={**search.samples, key: samples},
        )
        if axis is None or axis.param != param:
            return search
        if search.best.get(param) == value and search.best_samples:  # the best itself, probed again
            search = replace(search, best_samples=samples, best_objective=statistics.fmean(samples))
            return replace(search, again=key) if len(samples) < 2 <= search.probes else search
        verdict = search.verdict(samples)
        search = replace(search, compared={**search.evidence(key), "verdict": verdict})
        if verdict == "move":
            moved = search._move(axis, value, samples, None)
            # A feasible point took an infeasible best's place at once: probe it again for a noise figure.
            return replace(moved, again=key) if len(samples) < 2 <= search.probes else moved
        return replace(search, again=key) if verdict == "again" else search

    def verdict(self, samples: Sequence[float]) -> str:
        """What a feasible point's probes say against the best: "move" (a feasible point against an
        infeasible best; or at least two probes whose ratio interval lies above 1 + floor), "again"
        (it looks better by more than the floor and the evidence cannot tell yet: one more probe, while
        fewer than `probes`), else "stay"."""
        if self.best_objective is None:
            return "move"
        ratio = self.ratio(statistics.fmean(samples))
        if ratio is None or ratio <= 1 + self.goal.tolerance:
            return "again" if len(samples) < MIN_PROBES else "stay"
        interval = self.ratio_interval(samples)
        side = interval.side_of(1 + self.goal.tolerance) if interval is not None else None
        if side == "above" and len(samples) >= 2:
            return "move"
        return "again" if side != "below" and len(samples) < self.probes else "stay"

    def looked_better(self, key: Key) -> bool:
        """The point `key` was measured better than the best by more than the floor, yet the search did
        not move there (not confirmed)."""
        value = self.measured.get(key)
        ratio = self.ratio(value) if value is not None else None
        return ratio is not None and ratio > 1 + self.goal.tolerance

    def worth_measuring(self, axis: Axis, neighbour: Value, mid: Value) -> bool:
        """Whether the midpoint `mid` between the best (the axis' anchor) and its ladder `neighbour` is
        worth a restart: the neighbour is infeasible while the best is not (where feasibility ends is
        worth knowing), the best is infeasible (the search walks by limit excess), or the parabola
        through the best and its two ladder neighbours (`predicted`) expects `mid` better than the best
        by more than the tolerance at `probes` probes — a smaller expected gain could not be confirmed,
        and a neighbour within the noise of the best is where the parabola says so."""
        if self.best_objective is None:
            return True
        if self.measured.get((axis.param, neighbour), 0.0) is None:
            return True
        expected = predicted(self, axis, mid)
        ratio = self.ratio(expected) if expected is not None else None
        return ratio is not None and ratio > 1 + self.tolerance(self.probes)

    def improves(self, objective: float | None, excess: float | None) -> bool:
        """For one measurement, without its confirmation: feasible first (a feasible point beats an
        infeasible best, two feasible ones compare by objective beyond the floor); while the best is
        infeasible, a point that served but broke its limit beats it by breaking it less (or beats a
        best that did not serve at all). A failed point never improves."""
        if objective is not None:
            return self.goal.better(objective, self.best_objective)
        if self.best_objective is not None or excess is None:
            return False
        return self.best_excess is None or excess < self.best_excess * (1 - self.goal.tolerance)

    def _move(self, axis: Axis, value: Value, samples: tuple[float, ...], excess: float | None) -> Search:
        side = 1 if float(value) > float(axis.center) else -1
        moved = replace(axis, center=value, direction=axis.direction or side)
        objective = statistics.fmean(samples) if samples else None
        return replace(
            self._replace_axis(axis, moved),
            best={**self.best, axis.param: value},
            best_objective=objective,
            best_excess=excess if objective is None else None,
            best_samples=samples,
        )

    def _replace_axis(self, old: Axis, new: Axis) -> Search:
        return replace(self, axes=tuple(new if a is old else a for a in self.axes))


def predicted(search: Search, axis: Axis, at: Value) -> float | None:
    """The objective the parabola through the axis' anchor (the best) and its two ladder neighbours
    expects at `at` (on log2 of the value for integers: the ladders are powers of two); None unless all
    three are measured feasible."""
    i = axis.values.index(axis.anchor if axis.anchor is not None else axis.center)
    if not 0 < i < len(axis.values) - 1 or search.best_objective is None:
        return None
    left, right = (search.measured.get((axis.param, axis.values[j])) for j in (i - 1, i + 1))
    if left is None or right is None:
        return None

    around = axis.values[i - 1 : i + 2]
    log = axis.integer and all(float(v) > 0 for v in around)

    def x(value: Value) -> float:
        return math.log2(float(value)) if log else float(value)

    points = list(zip(map(x, around), (left, search.best_objective, right), strict=True))
    t = x(at)
    return sum(
        y * math.prod((t - xk) / (xj - xk) for k, (xk, _) in enumerate(points) if k != j)
        for j, (xj, y) in enumerate(points)
    )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def start(
    params: Sequence[str],
    current: Mapping[str, Value],
    ladders: Mapping[str, tuple[Value, ...]],
    *,
    goal: Objective,
    objective: float | None,
    known: Mapping[Key, float | None] | None = None,
    excess: float | None = None,
    samples: Sequence[float] = (),
    probes: int = 3,
    start_noise: float = 0.0,
) -> Search:
    """A search over `params` from the `current` configuration and its measured `objective`, a value of
    `goal` (None: infeasible; `excess`: how far it broke a latency limit) — the mean of its probes'
    `samples` when given (else the one value). `known` measurements (tuning memory, under a comparable
    load, of the same objective and source) count as measured, and the best known value of a parameter,
    when it beats the current one by more than the floor, is where its axis starts: the best known
    configuration is the first proposal. `probes`, `start_noise`: as `Search`."""
    measured: dict[Key, float | None] = dict(known or {})
    baseline = tuple(samples) if objective is not None and samples else ()
    if baseline:
        objective = statistics.fmean(baseline)
    elif objective is not None:
        baseline = (objective,)
    for p in params:
        measured[(p, current[p])] = objective
    best, best_objective, best_samples = {p: current[p] for p in params}, objective, baseline
    axes = []
    for p in params:
        center = current[p]
        for value in ladders[p]:
            seen = measured.get((p, value))
            if seen is not None and goal.better(seen, best_objective):
                center, best[p], best_objective, best_samples = value, value, seen, (seen,)
        tunable = REGISTRY[p]
        # A midpoint of two allowed block sizes is not one (91 between 64 and 128: vLLM refuses it).
        discrete = tunable.boolean or bool(tunable.choices_cpu or tunable.choices_cuda)
        # Coarse first (a third of the ladder a step, then halved): neighbours on a ladder of powers of
        # two often differ by less than the noise, points further apart by more. Where the tuning memory
        # knows points of this axis, a search was done before: refine around its best.
        coarse = not any((p, v) in (known or {}) for v in ladders[p] if v != current[p])
        stride = max(1, len(ladders[p]) // 3) if coarse else 1
        axes.append(
            Axis(
                p,
                ladders[p],
                tunable.integer and not tunable.boolean,
                center,
                discrete=discrete,
                stride=stride,
            )
        )
    best_excess = excess if best_objective is None else None
    # The baseline's probes, under the first parameter's key (one configuration, counted once in the spread).
    own = {(params[0], current[params[0]]): baseline} if params and len(baseline) > 1 else {}
    return Search(
        tuple(axes), goal, measured, best, best_objective, best_excess, own, best_samples, probes, start_noise
    )


def _current(search: Search) -> Axis | None:
    return next((axis for axis in search.axes if not axis.done), None)


def _next_stage(axis: Axis) -> Axis:
    """Steps done → the midpoints around the best; midpoints done → the axis is done."""
    if axis.stride > 1:
        return replace(axis, stride=axis.stride // 2, direction=0)
    if axis.anchor is None:
        return replace(axis, anchor=axis.center)
    return replace(axis, done=True)


def _candidate(search: Search, axis: Axis) -> Value | None:
    """The next unmeasured value of the axis at its stage, or None when the stage is exhausted. A
    midpoint is a candidate only when it is worth a restart (`Search.worth_measuring`)."""
    if axis.anchor is None:
        i, last = axis.values.index(axis.center), len(axis.values) - 1
        for side in (axis.direction,) if axis.direction else (1, -1):
            if not 0 <= i + side <= last:
                continue
            j = min(max(i + side * axis.stride, 0), last)
            # Past a rung that looked better but was not confirmed (within the noise of the best): a
            # step further that way is expected to differ more, so it may be told apart.
            while 0 <= j <= last and search.looked_better((axis.param, axis.values[j])):
                j += side * axis.stride
            if 0 <= j <= last and (axis.param, axis.values[j]) not in search.measured:
                return axis.values[j]
        return None
    if axis.discrete:
        return None
    i = axis.values.index(axis.anchor)
    for side in (1, -1):
        j = i + side
        if 0 <= j < len(axis.values):
            mid = midpoint(axis.anchor, axis.values[j], axis.integer)
            fresh = mid is not None and (axis.param, mid) not in search.measured
            if fresh and search.worth_measuring(axis, axis.values[j], mid):
                return mid
    return None
