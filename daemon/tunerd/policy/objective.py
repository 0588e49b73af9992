"""What "better" means (pure): one objective — a name, a unit, a direction and a tolerance — read from
ONE statistic of a window (`WindowStats.signals()`, the names of docs/signals.md) or of the probe
(`ProbeResult.signals()`), and the comparisons every caller makes with it: a trial's verdict, an
exploration point, a recall, the tuning memory's ranking.

A value is a bare float everywhere else (the journal, the experience file), so it travels with its
objective's name and unit and where it was measured (`Source`): tok/s and seconds never share a field
without a name that says which.

Adding an objective is one subclass here (name, unit, direction, the window statistic it reads — a
signal of `core/signal_catalog.py`, which every window computes — and the probe's figure of it if there
is one) plus its kind in `config/objective.OBJECTIVE_NAMES` (`[objective] kind`; config cannot import
policy; a unit test holds the two lists equal). `configured(config.objective)` is the objective the
operator chose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

from tunerd.config.objective import OBJECTIVE_NAMES, ObjectiveConfig
from tunerd.core.slo import Count
from tunerd.core.slo import feasible as feasible  # the goodput objective's feasibility test, re-exported
from tunerd.policy.evidence import WindowStats

Direction = Literal["higher", "lower"]
Source = Literal["live", "probe"]  # what measured a value: the live window, or the benchmark probe


@dataclass(frozen=True)
class Objective:
    """One objective with its `tolerance` (relative: 0.05 = 5 %). Subclasses set the class fields."""

    name: ClassVar[str]  # the signal's name (docs/signals.md), e.g. "throughput.generation"
    unit: ClassVar[str]  # "tok/s", "s"
    direction: ClassVar[Direction]
    probe_signal: ClassVar[str | None] = None  # the probe's figure of the same quantity, if it has one
    # Measures capacity: meaningful for a trial only when the engine was saturated in both windows
    # (an unsaturated engine's throughput is the offered load, not what the change did).
    capacity: ClassVar[bool] = False

    tolerance: float = 0.0

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        OBJECTIVES[cls.name] = cls

    # -- reading ------------------------------------------------------------------------------------

    def of(self, window: WindowStats | None) -> float | None:
        """The objective's value in `window` (its one statistic), None when unknown."""
        return None if window is None else window.signals().get(self.name)

    def of_probe(self, signals: Mapping[str, float | None]) -> float | None:
        """The objective's value in a probe's signals (`ProbeResult.signals()`), None when the probe has
        no figure of it."""
        return None if self.probe_signal is None else signals.get(self.probe_signal)

    def samples(self, window: WindowStats) -> tuple[float, ...] | None:
        """Per-poll samples of the statistic, for the interval of its mean (core/stats.py); None when it
        has none (a latency quantile is one figure of the whole window)."""
        return None

    # -- comparing ----------------------------------------------------------------------------------

    def better(self, a: float | None, b: float | None) -> bool:
        """`a` beats `b` by more than the tolerance. None is no measurement (infeasible, unknown): a
        value beats None, None beats nothing."""
        if a is None:
            return False
        if b is None:
            return True
        if self.direction == "higher":
            return a > b * (1 + self.tolerance)
        return a < b * (1 - self.tolerance)

    def worse(self, a: float | None, b: float | None) -> bool | None:
        """`a` is worse than `b` beyond the tolerance; None when that cannot be told (a value unknown, or
        a rate compared with zero)."""
        if a is None or b is None:
            return None
        if self.direction == "higher":
            return None if b <= 0 else a < b * (1 - self.tolerance)
        return a > b * (1 + self.tolerance)

    def rank(self, value: float) -> float:
        """A sort key: the greater, the better."""
        return value if self.direction == "higher" else -value

    # -- saying -------------------------------------------------------------------------------------

    def describe(self, value: float | None) -> str:
        """`value` with its unit, for an operator: "1234 tok/s", "85.2 ms"."""
        if value is None:
            return "unknown"
        if self.unit == "s" and abs(value) < 1:
            return f"{value * 1000:.3g} ms"
        return f"{value:.4g} {self.unit}"

    def fields(self) -> dict[str, str]:
        """What a journal event or an experience entry carries beside a value of it."""
        return {"objective_name": self.name, "objective_unit": self.unit}


OBJECTIVES: dict[str, type[Objective]] = {}


@dataclass(frozen=True)
class Throughput(Objective):
    """Generated tokens per second: the engine's capacity when it is saturated."""

    name: ClassVar[str] = "throughput.generation"
    unit: ClassVar[str] = "tok/s"
    direction: ClassVar[Direction] = "higher"
    probe_signal: ClassVar[str | None] = "probe.throughput"
    capacity: ClassVar[bool] = True

    def samples(self, window: WindowStats) -> tuple[float, ...] | None:
        return window.throughput_samples


@dataclass(frozen=True)
class TtftP95(Objective):
    name: ClassVar[str] = "ttft.p95"
    unit: ClassVar[str] = "s"
    direction: ClassVar[Direction] = "lower"
    probe_signal: ClassVar[str | None] = "probe.ttft_p95"


@dataclass(frozen=True)
class ItlP95(Objective):
    name: ClassVar[str] = "itl.p95"
    unit: ClassVar[str] = "s"
    direction: ClassVar[Direction] = "lower"
    probe_signal: ClassVar[str | None] = "probe.itl_p95"


@dataclass(frozen=True)
class E2eP95(Objective):
    name: ClassVar[str] = "e2e.p95"
    unit: ClassVar[str] = "s"
    direction: ClassVar[Direction] = "lower"


@dataclass(frozen=True)
class Goodput(Objective):
    """Requests per second that met every per-request target of `[objective]` (or their output tokens
    per second: `count = "tokens"`), measured by the front door (core/slo.py, signal `slo.goodput`).
    Meaningful with the attainment beside it: a configuration is feasible when `feasible(attainment,
    target)`; among feasible ones, more goodput is better (policy/verdict.py). In a trial's window its
    figures are the window's own (`WindowStats.slo`, the door's counters), per poll for the interval;
    the `slo.*` signals (the last poll's view of `observe.window_s`) where the window has no counters."""

    name: ClassVar[str] = "slo.goodput"
    unit: ClassVar[str] = "req/s"
    direction: ClassVar[Direction] = "higher"

    count: Count = "requests"

    def __post_init__(self) -> None:
        if self.count == "tokens":  # the unit follows what is counted (an instance's, not the class's)
            object.__setattr__(self, "unit", "tok/s")

    def of(self, window: WindowStats | None) -> float | None:
        if window is not None and window.slo is not None:
            return window.slo.goodput(self.count)
        return super().of(window)

    def samples(self, window: WindowStats) -> tuple[float, ...] | None:
        return window.slo.samples(self.count) if window.slo is not None else None

    @staticmethod
    def attainment(window: WindowStats) -> float | None:
        """The share of the window's requests that met every target (None: no request)."""
        if window.slo is not None:
            return window.slo.attainment
        return window.values.get("slo.attainment")

    @staticmethod
    def requests(window: WindowStats) -> float | None:
        """The door's requests in the window (None: the door counted none, or is off)."""
        if window.slo is not None:
            return window.slo.requests
        return window.values.get("slo.requests")


# The latency at the offered load: what a trial compares when a capacity objective cannot measure.
AT_OFFERED_LOAD: type[Objective] = ItlP95
# An exploration's points are scored by generation throughput (the probe's closed loop, or live traffic
# that saturates the engine); the latency limits bound it (policy/explore.limit_excess). Under goodput too:
# the probe has no client-side attainment to judge feasibility by (docs/objective.md).
EXPLORE: type[Objective] = Throughput


def objective(name: str, tolerance: float = 0.0) -> Objective:
    """The objective called `name` with `tolerance`. Raises KeyError for a name no class has."""
    return OBJECTIVES[name](tolerance=tolerance)


def configured(config: ObjectiveConfig, tolerance: float = 0.0) -> Objective:
    """The objective `[objective]` names (its kind), goodput counting what `count` says. The configured
    one, not necessarily the one in force (config/objective.in_force: goodput needs targets and the door)."""
    name = OBJECTIVE_NAMES[config.kind]
    if name == Goodput.name:
        return Goodput(tolerance=tolerance, count=config.count)
    return OBJECTIVES[name](tolerance=tolerance)


def direction_of(name: str | None) -> Direction | None:
    """The direction of the objective called `name`; None for no name or one this version does not
    know (an entry written by a newer tunerd)."""
    cls = OBJECTIVES.get(name) if name is not None else None
    return None if cls is None else cls.direction


def for_trial(configured: str, before: WindowStats, after: WindowStats, tolerance: float) -> Objective:
    """The objective a trial compares: the configured one — unless it measures capacity and the engine
    was not saturated in both windows; then the latency at the offered load (ITL p95)."""
    chosen = OBJECTIVES[configured]
    if chosen.capacity and not (before.saturated and after.saturated):
        chosen = AT_OFFERED_LOAD
    return chosen(tolerance=tolerance)
