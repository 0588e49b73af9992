"""Exploration (pure): a coordinate search over named parameters, one at a time, on a ladder of values.

For each parameter in turn, from the best configuration found so far:
1. step: measure the ladder's neighbour on each side; when one improves the objective by more than the
   tolerance, move there and keep stepping that way while it improves;
2. shrink the step: measure the midpoints between the best ladder value and its two neighbours;
3. stop: nothing improved by more than the tolerance.
So an exploration of N parameters costs about the sum of their steps, not their product (the grid
sweep's). A point that fails (its start fails, a latency limit breaks) is infeasible (None); a feasible
point always beats it. While no feasible point is known, the search still has a direction: a point that
breaks the limit by less (`limit_excess`, by more than the tolerance) is the better one, so a
configuration in force that already breaks the limit is left towards the limit instead of standing
still. A point already measured (in this search, or known from an earlier one under the same load) is
not measured again.

The objective (`policy/objective.EXPLORE`, with `explore_tolerance`) is the probe's generation
throughput — unless live traffic saturated the engine in the
window before the search's first probe: then the live window's throughput (all traffic, the probe's
included) is what measures the engine's capacity, and the probe's few requests only their share of it.
`objective_source` fixes that once per search, so every point is scored the same way. Under a goodput
objective too, for now: the probe goes straight to vLLM and has no client-side attainment, and a search's
only feasibility is its latency limits (docs/objective.md); a rule's trial judges by goodput.

`Search` is a value: `next_point()` says what to measure, `record()` folds one measurement in and
returns the new search. The caller (tune/explorer.py) turns each point into a trial.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tunerd.core.params import Backend
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


@dataclass(frozen=True)
class Search:
    """A whole exploration: the axes in order and every measurement (objective; None: infeasible, with
    its limit excess when it served but broke a latency limit)."""

    axes: tuple[Axis, ...]
    goal: Objective  # what a measurement is, and how much better a point must be to move the best
    measured: Mapping[tuple[str, Value], float | None] = field(default_factory=dict)
    best: Mapping[str, Value] = field(default_factory=dict)  # the best configuration so far
    best_objective: float | None = None
    best_excess: float | None = None  # while the best is infeasible: how far it breaks its limit

    @property
    def done(self) -> bool:
        return all(axis.done for axis in self.axes)

    def next_point(self) -> tuple[Search, tuple[str, Value] | None]:
        """(the search moved past exhausted stages, the next (param, value) to measure — the other
        parameters at their best — or None when the exploration is over)."""
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
        """Fold one measurement in (None: infeasible; `excess`: how far it broke a latency limit). It
        moves the best only when it is better by more than the tolerance (`improves`)."""
        search = replace(self, measured={**self.measured, (param, value): objective})
        axis = _current(search)
        if axis is None or axis.param != param or not search.improves(objective, excess):
            return search
        side = 1 if float(value) > float(axis.center) else -1
        moved = replace(axis, center=value, direction=axis.direction or side)
        return replace(
            search._replace_axis(axis, moved),
            best={**search.best, param: value},
            best_objective=objective,
            best_excess=excess if objective is None else None,
        )

    def improves(self, objective: float | None, excess: float | None) -> bool:
        """Feasible first: a feasible point beats an infeasible best, two feasible ones compare by
        objective; while the best is infeasible, a point that served but broke its limit beats it by
        breaking it less (or beats a best that did not serve at all). A failed point never improves."""
        if objective is not None:
            return self.goal.better(objective, self.best_objective)
        if self.best_objective is not None or excess is None:
            return False
        return self.best_excess is None or excess < self.best_excess * (1 - self.goal.tolerance)

    def _replace_axis(self, old: Axis, new: Axis) -> Search:
        return replace(self, axes=tuple(new if a is old else a for a in self.axes))


def start(
    params: Sequence[str],
    current: Mapping[str, Value],
    ladders: Mapping[str, tuple[Value, ...]],
    *,
    goal: Objective,
    objective: float | None,
    known: Mapping[tuple[str, Value], float | None] | None = None,
    excess: float | None = None,
) -> Search:
    """A search over `params` from the `current` configuration and its measured `objective`, a value of
    `goal` (None: infeasible; `excess`: how far it broke a latency limit). `known` measurements (tuning
    memory, under a comparable load, of the same objective and source) count as measured, and the best
    known value of a parameter, when it beats the current one by more than the tolerance, is where its
    axis starts: the best known configuration is the first proposal."""
    measured: dict[tuple[str, Value], float | None] = dict(known or {})
    for p in params:
        measured[(p, current[p])] = objective
    best, best_objective = {p: current[p] for p in params}, objective
    axes = []
    for p in params:
        center = current[p]
        for value in ladders[p]:
            seen = measured.get((p, value))
            if seen is not None and goal.better(seen, best_objective):
                center, best[p], best_objective = value, value, seen
        tunable = REGISTRY[p]
        # A midpoint of two allowed block sizes is not one (91 between 64 and 128: vLLM refuses it).
        discrete = tunable.boolean or bool(tunable.choices_cpu or tunable.choices_cuda)
        axes.append(Axis(p, ladders[p], tunable.integer and not tunable.boolean, center, discrete=discrete))
    best_excess = excess if best_objective is None else None
    return Search(tuple(axes), goal, measured, best, best_objective, best_excess)


def _current(search: Search) -> Axis | None:
    return next((axis for axis in search.axes if not axis.done), None)


def _next_stage(axis: Axis) -> Axis:
    """Steps done → the midpoints around the best; midpoints done → the axis is done."""
    if axis.anchor is None:
        return replace(axis, anchor=axis.center)
    return replace(axis, done=True)


def _candidate(search: Search, axis: Axis) -> Value | None:
    """The next unmeasured value of the axis at its stage, or None when the stage is exhausted."""
    if axis.anchor is None:
        i = axis.values.index(axis.center)
        for side in (axis.direction,) if axis.direction else (1, -1):
            j = i + side
            if 0 <= j < len(axis.values) and (axis.param, axis.values[j]) not in search.measured:
                return axis.values[j]
        return None
    if axis.discrete:
        return None
    i = axis.values.index(axis.anchor)
    for side in (1, -1):
        j = i + side
        if 0 <= j < len(axis.values):
            mid = midpoint(axis.anchor, axis.values[j], axis.integer)
            if mid is not None and (axis.param, mid) not in search.measured:
                return mid
    return None
