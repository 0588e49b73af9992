"""The concurrency curve through the front door's cap: `tunerd door --curve 2,4,8,16`.

A restart costs 45–90 s on these CPUs and 50–110 s on the H200; the door's cap bounds what vLLM runs at
once without one. So the curve pins the cap at each value in turn on the serving vLLM, lets the requests
above the new cap finish (`settle_s`), measures the point for `point_s` seconds of the live traffic, and
gives the cap back as it was (pinned at its value, or steered). On the H200 the cap at 32 served within
3 % of a restart to max_num_seqs 32, and at 64 it beat the restart (issue 22): the curve says in seconds
per point what a walk of max_num_seqs would pay a restart per point to learn, and the tuner reads it
before it pays one (a concurrency the cap served less at is not worth a restart of max_num_seqs under
the same load: `curve_lost_below_best`).

Each point is scored by the objective in force (policy/verdict.objective_in_force: goodput with its
targets and the door's requests, else generation throughput), with its measured noise (core/stats): two
points closer than their noise are not ordered. While a curve runs, no rule acts and no exploration
starts (one experiment at a time); a restart of vLLM ends it (the points measured stand).

Journal: `door.curve.started` (caps, seconds per point), `door.curve.point` (each point's figures),
`door.curve.finished` (the points, the best, the cap given back) or `door.curve.aborted`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from tunerd.core.stats import relative_noise
from tunerd.policy.evidence import WindowStats
from tunerd.policy.first_step import LostCap
from tunerd.policy.objective import Goodput, Objective
from tunerd.records.recorder import Recorder


class DoorCap(Protocol):
    """The door's cap as a curve moves it (supervise/door_link.DoorLink): set for a measurement, then
    given back as the operator set it; and the cap its controller steers now (`steered_cap`)."""

    def try_cap(self, cap: int, why: str) -> None: ...

    def restore(self, why: str) -> None: ...

    def steered_cap(self) -> int | None: ...


class _Phase(Enum):
    SETTLING = "settling"  # the cap was just set: requests above it finish
    MEASURING = "measuring"


@dataclass(frozen=True)
class CurvePoint:
    """One cap measured: the objective's value (None: the window had too few polls, or no request for
    goodput) and the figures beside it."""

    cap: int
    seconds: float
    objective: float | None
    noise: float | None  # the relative noise of the objective's mean in this window (core/stats)
    throughput: float | None
    attainment: float | None
    requests: float | None
    running_avg: float | None
    waiting_avg: float | None
    preemptions_per_s: float | None

    def as_dict(self) -> dict[str, object]:
        def r(value: float | None, digits: int = 3) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "cap": self.cap,
            "seconds": round(self.seconds, 1),
            "objective": r(self.objective),
            "noise": r(self.noise, 4),
            "throughput": r(self.throughput, 1),
            "attainment": r(self.attainment, 4),
            "requests": r(self.requests, 0),
            "running_avg": r(self.running_avg, 2),
            "waiting_avg": r(self.waiting_avg, 2),
            "preemptions_per_s": r(self.preemptions_per_s),
        }


def measure(cap: int, window: WindowStats | None, seconds: float, goal: Objective) -> CurvePoint:
    """The point of `cap` from its window (None: nothing measured)."""
    if window is None:
        return CurvePoint(cap, seconds, None, None, None, None, None, None, None, None)
    samples = goal.samples(window)
    is_goodput = isinstance(goal, Goodput)
    return CurvePoint(
        cap=cap,
        seconds=seconds,
        objective=goal.of(window),
        noise=relative_noise(samples) if samples else None,
        throughput=window.values.get("throughput.generation"),
        attainment=Goodput.attainment(window) if is_goodput else None,
        requests=Goodput.requests(window) if is_goodput else None,
        running_avg=window.running_avg,
        waiting_avg=window.waiting_avg,
        preemptions_per_s=window.preemption_rate,
    )


def best_point(points: Sequence[CurvePoint], goal: Objective) -> CurvePoint | None:
    """The point with the best objective (None: no point measured)."""
    measured = [p for p in points if p.objective is not None]
    if not measured:
        return None
    return max(measured, key=lambda p: goal.rank(p.objective))  # type: ignore[arg-type]


def lost_caps(points: Sequence[CurvePoint], goal: Objective) -> dict[int, str]:
    """The caps that lost to the curve's best beyond both points' noise (z = 1.645 on the ratio: the
    one-sided 5 % of core/stats.CONFIDENCE), with why: a concurrency the cap lost under this load."""
    best = best_point(points, goal)
    if best is None or best.objective is None or best.objective <= 0:
        return {}
    out = {}
    for p in points:
        if p is best or p.objective is None:
            continue
        noise = ((p.noise or 0.0) ** 2 + (best.noise or 0.0) ** 2) ** 0.5
        ratio = p.objective / best.objective
        if goal.direction == "higher" and ratio < 1 - 1.645 * noise:
            out[p.cap] = (
                f"the door's cap at {p.cap} served {goal.describe(p.objective)} against "
                f"{goal.describe(best.objective)} at {best.cap} ({ratio - 1:+.0%}, noise ±{noise:.0%})"
            )
    return out


def curve_lost_below_best(points: Sequence[CurvePoint], goal: Objective) -> LostCap | None:
    """For the proposer (tune/proposer.py): the largest cap below the curve's best that served less than
    it — a max_num_seqs at or below it runs no more at once under this load than that cap did, so a
    restart to it is expected to serve what the cap served. Lowering max_num_seqs buys next to no memory
    (vLLM sizes the KV cache from gpu_memory_utilization after a profile run of max_num_batched_tokens) and
    no batch shape the cap lacks (CUDA graphs are captured up to max_num_seqs, so fewer, never more), so
    the restart is paid only where the curve ranks the lower value strictly first
    (issue 22: on the H200 the cap at 8 served 8.11 good/s against 10.56 with no cap, inside its noise,
    and the restart to 8 that followed cost 81.6 s and decided nothing). None when no cap below the best
    served less."""
    measured = [p for p in points if p.objective is not None]
    if not measured:
        return None
    # On a tie the larger cap ranks first: a restart must buy something, and it does not buy a tie.
    best = max(measured, key=lambda p: (goal.rank(p.objective), p.cap))  # type: ignore[arg-type]
    below = [p for p in measured if p.cap < best.cap]
    if not below:
        return None
    cap = max(p.cap for p in below)
    lost = lost_caps(points, goal)
    if cap in lost:
        return LostCap(cap, f"the concurrency curve: {lost[cap]}")
    at = next(p for p in below if p.cap == cap)
    return LostCap(
        cap,
        f"the concurrency curve: the door's cap at {cap} served {goal.describe(at.objective)} against "  # type: ignore[arg-type]
        f"{goal.describe(best.objective)} at {best.cap}, within their noise: a restart to it buys no more "
        "than the cap, which runs as many at once without one",
    )


def expected_from_curve(
    points: Sequence[CurvePoint], goal: Objective, value: int, in_force: int | None
) -> str | None:
    """What the curve says a restart to max_num_seqs = `value` buys (for the trial's notes): the cap at
    `value` against the cap at the max_num_seqs in force (`in_force`; the curve's best when the curve did
    not measure it). The cap runs as many at once without a restart, so the restart is expected to serve
    about what the cap did — more only where it buys memory or batch shapes the cap cannot. None when the
    curve did not measure `value`. (Against the best alone, the note said "+0 %" of every restart it let
    through: `curve_lost_below_best` lets one through only where `value` is the best.)"""

    def at(cap: int | None) -> CurvePoint | None:
        return next((p for p in points if p.cap == cap and p.objective is not None), None)

    new, old = at(value), at(in_force) or best_point(points, goal)
    if new is None or old is None or new.objective is None or old.objective is None or old.objective <= 0:
        return None
    which = "the max_num_seqs in force" if old.cap == in_force else "the curve's best"
    return (
        f"the concurrency curve measured the door's cap at {value}: {goal.describe(new.objective)}, against "
        f"{goal.describe(old.objective)} at {old.cap} ({which}): expected gain of the restart "
        f"{new.objective / old.objective - 1:+.0%} (about what the cap served; more only for memory or "
        "batch shapes)"
    )


MAX_CAPS = 32


def parse_caps(text: object) -> tuple[int, ...] | str:
    """The caps of `tunerd door --curve` ("2,4,8,16"), or why they are not: whole numbers ≥ 1, at most
    MAX_CAPS, no repeat (measured in the order given)."""
    if not isinstance(text, str) or not text.strip():
        return "curve: name the caps to measure, e.g. 2,4,8,16"
    caps = []
    for part in text.split(","):
        item = part.strip()
        if not item.isdigit() or int(item) < 1:
            return f"curve: {item!r} is not a cap (a whole number ≥ 1)"
        caps.append(int(item))
    if len(caps) > MAX_CAPS:
        return f"curve: {len(caps)} caps, at most {MAX_CAPS}"
    if len(set(caps)) != len(caps):
        return "curve: a cap is named twice"
    return tuple(caps)


class CapCurve:
    """One curve, stepped by the tuner on the loop: `step(now)` until it returns True (finished)."""

    def __init__(
        self,
        caps: Sequence[int],
        *,
        point_s: float,
        settle_s: float,
        goal: Objective,
        pin: Callable[[int, str], None],
        give_back: Callable[[], None],
        window: Callable[[float, float], WindowStats | None],
        recorder: Recorder,
        trigger: str,
        now: float,
    ) -> None:
        self.caps = tuple(caps)
        self.point_s, self.settle_s = point_s, settle_s
        self.goal = goal
        self.pin, self.give_back, self.window = pin, give_back, window
        self.rec = recorder
        self.trigger = trigger
        self.points: list[CurvePoint] = []
        self.index = 0
        self.phase = _Phase.SETTLING
        self.since = now
        self.rec.record(
            "door.curve.started",
            caps=list(self.caps),
            point_s=point_s,
            settle_s=settle_s,
            objective_name=goal.name,
            objective_unit=goal.unit,
            trigger=trigger,
        )
        self._set(now)

    def _set(self, now: float) -> None:
        cap = self.caps[self.index]
        self.pin(cap, f"{self.trigger}: the concurrency curve, point {self.index + 1} of {len(self.caps)}")
        self.phase, self.since = _Phase.SETTLING, now

    def step(self, now: float) -> bool:
        """Move the curve on; True once it finished (the cap given back, `door.curve.finished`)."""
        if self.phase is _Phase.SETTLING:
            if now - self.since >= self.settle_s:
                self.phase, self.since = _Phase.MEASURING, now
            return False
        if now - self.since < self.point_s:
            return False
        cap = self.caps[self.index]
        point = measure(cap, self.window(self.since, now), now - self.since, self.goal)
        self.points.append(point)
        self.rec.record("door.curve.point", **point.as_dict(), of=len(self.caps), trigger=self.trigger)
        self.index += 1
        if self.index < len(self.caps):
            self._set(now)
            return False
        self.give_back()
        best = best_point(self.points, self.goal)
        self.rec.record(
            "door.curve.finished",
            points=[p.as_dict() for p in self.points],
            best=None if best is None else best.cap,
            lost=[{"cap": cap, "why": why} for cap, why in lost_caps(self.points, self.goal).items()],
            objective_name=self.goal.name,
            objective_unit=self.goal.unit,
            trigger=self.trigger,
        )
        return True

    def abort(self, reason: str) -> None:
        """vLLM restarted (or tunerd stops): the cap is given back; the points measured stand."""
        self.give_back()
        self.rec.record(
            "door.curve.aborted",
            reason=reason,
            points=[p.as_dict() for p in self.points],
            trigger=self.trigger,
        )


class CurveSlot:
    """The tuner's one concurrency curve: the curve in progress and the run it measures (a restart of vLLM
    ends it), and the serving run's finished curves — what they say a restart of max_num_seqs is expected
    to gain (`expected_from_curve`, the last curve that measured the value) and the largest cap any of
    them lost below its best (a concurrency not worth a restart under this load: `curve_lost_below_best`).
    Every curve of the run counts: with the last one alone, the H100's closed loop (docs/gpu.md, the
    seventh lease) measured cap 8 lost, then cap 10 against no cap, then 8 again — which won that 10 s
    point — and restarted to it. A curve of an earlier run measured another start: it says nothing of
    this one."""

    def __init__(self) -> None:
        self.curve: CapCurve | None = None
        self._run: int | None = None
        self._kept: list[tuple[int, tuple[CurvePoint, ...], Objective]] = []  # (run id, points, goal)

    @property
    def busy(self) -> bool:
        return self.curve is not None

    def begin(self, curve: CapCurve, run_id: int) -> None:
        """`curve` (just started) measures run `run_id`."""
        self.curve, self._run = curve, run_id

    def keep(self, run_id: int, points: Sequence[CurvePoint], goal: Objective) -> None:
        """Run `run_id`'s finished curve: its `points`, scored by `goal` (an earlier run's are dropped)."""
        self._kept = [kept for kept in self._kept if kept[0] == run_id]
        self._kept.append((run_id, tuple(points), goal))

    def step(self, now: float, serving_run: int | None) -> bool:
        """Move the curve in progress on: True when it finished now (kept for run `serving_run`); aborted
        when vLLM restarted or stopped (`serving_run` None or another run)."""
        curve = self.curve
        if curve is None:
            return False
        if serving_run is None or serving_run != self._run:
            curve.abort("vLLM restarted or stopped: the curve measures one run")
            self.curve = None
            return False
        if not curve.step(now):
            return False
        self.keep(serving_run, curve.points, curve.goal)
        self.curve = None
        return True

    def _of(self, run_id: int | None) -> list[tuple[tuple[CurvePoint, ...], Objective]]:
        """Run `run_id`'s finished curves, oldest first."""
        return [(points, goal) for run, points, goal in self._kept if run == run_id]

    def lost(self, run_id: int | None) -> LostCap | None:
        """The largest cap any of run `run_id`'s curves lost below its best (None: none, or no curve)."""
        lost = [cap for curve in self._of(run_id) if (cap := curve_lost_below_best(*curve)) is not None]
        return max(lost, key=lambda cap: cap.value, default=None)

    def measured(self, run_id: int | None, cap: int) -> bool:
        """One of run `run_id`'s curves measured `cap`."""
        return any(cap in (p.cap for p in points) for points, _ in self._of(run_id))

    def expected(self, run_id: int | None, cap: int, in_force: int | None) -> str | None:
        """What the door's cap at `cap` served in the last of run `run_id`'s curves that measured it,
        against the cap at `in_force`, as a proposal's note (None: no curve of the run measured `cap`)."""
        for points, goal in reversed(self._of(run_id)):
            note = expected_from_curve(points, goal, cap, in_force)
            if note is not None:
                return note
        return None
