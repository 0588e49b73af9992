"""Exploration, the tuner's second mode: a coordinate search over named parameters (policy/explore.py),
each point a normal trial — intent, restart through the start path, warm-up, evidence — whose evidence
is the benchmark probe's throughput, within the latency limits — or, when live traffic saturates the
engine, the live window's (policy/explore.py says why; the probe then still sets the latency limits).

In order: the probe measures the configuration in force (no restart); the plan (parameters, ladders,
budget) is journaled; then point after point: the planner (a point it refuses is infeasible and costs no
restart), a restart with the point, the warm-up, a probe, the point's objective (None when its start
failed or a limit broke), the next point; the search's best becomes last-known-good (one more restart when
it is not the last point measured). Points stay in force between them and nothing is promoted by time;
each restart counts against the tuner's budget; values known to be bad are tabu; a point known from an
earlier exploration under a comparable load is not measured again. `tunerd explore` starts one; so may a
maintenance window.

A recall is the one-point form: the best configuration the tuning memory knows for this model and box
(a new deployment, an imported memory) is tried against the one in force, probe against probe, and kept
only when it beats it by more than the tolerance; else reverted, and its values go tabu.

Over 400 lines: one state machine (baseline, planning, applying, warm-up, measuring, decided, finishing,
reverting: tune/experiment.py's phases, every change checked against its table) whose steps both forms
share; the search itself is pure, in policy/explore.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from tunerd.config import Config
from tunerd.core.failures import EngineFailure
from tunerd.core.params import EngineParams
from tunerd.engine.process import EngineRun
from tunerd.observe.probe import ProbeResult
from tunerd.policy.evidence import WindowStats
from tunerd.policy.explore import Search, ladder, limit_excess, objective_source, scored, start
from tunerd.policy.objective import EXPLORE, Objective, Source
from tunerd.policy.tunables import REGISTRY, Value
from tunerd.records.recorder import Recorder
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.change import ChangeEvent, Outcome, Owner
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.supervise.preflight import run_here
from tunerd.tune.experiment import Phase, check
from tunerd.tune.memory import TuningMemory
from tunerd.tune.prober import Prober
from tunerd.tune.recall import Recall

log = structlog.get_logger("tunerd")


@dataclass
class Exploration:
    explore_id: int
    params: tuple[str, ...]
    reason: str
    step: Phase  # tune/experiment.py's table; changed only through `Explorer._enter`
    since: float
    search: Search | None = None
    point: tuple[str, Value] | None = None
    restarts: int = 0
    measured: list[dict[str, Any]] = field(default_factory=list)
    recall: EngineParams | None = None  # a recall: the configuration the tuning memory proposes
    baseline_objective: float | None = None
    plan: Future[PlanOutcome] | None = None  # the planner's verdict on the point, while PLANNING
    source: Source = "probe"  # what scores every point of this exploration, fixed at its start
    live: WindowStats | None = None  # live traffic's window before the search: the load a live score is of
    pending: tuple[ProbeResult | None, str | None] | None = None  # a probe done, the live window not yet
    defaults: dict[str, Value] = field(default_factory=dict)  # vLLM's values of the params not set at start
    change_id: int | None = (
        None  # the lifecycle's change in flight for this exploration (supervise/change.py)
    )

    @property
    def owner(self) -> Owner:
        return "recall" if self.recall is not None else "explore"


class Explorer:
    """One exploration at a time; the tuner forwards the outcomes of its changes (`on_change`)."""

    def __init__(
        self,
        config: Callable[[], Config],
        lifecycle: Lifecycle,
        prober: Prober,
        memory: TuningMemory,
        *,
        recorder: Recorder,
        monotonic: Callable[[], float],
        recall: Recall | None = None,
        on_kept: Callable[[str], None] = lambda why: None,
        submit: Callable[[Callable[[], PlanOutcome]], Future[PlanOutcome]] = run_here,
        window: Callable[[float, float], WindowStats | None] = lambda start, end: None,
    ) -> None:
        self.config = config
        self.life = lifecycle
        self.prober = prober
        self.memory = memory
        self.rec = recorder
        self.monotonic = monotonic
        self.recall = recall
        self.submit = submit  # the planner's check runs as a worker job (it reads the model, /proc)
        self.window = window  # the serving run's live window [start, end] (the tuner's samples)
        self.on_kept = on_kept  # a new configuration is last-known-good: the tuner records a new baseline
        self.current: Exploration | None = None

    def goal(self) -> Objective:
        """What scores a point: the exploration's objective with `tuning.explore_tolerance`."""
        return EXPLORE(tolerance=self.config().tuning.explore_tolerance)

    # -- starting ---------------------------------------------------------------------------------

    def begin(self, params: Sequence[str], reason: str, *, recall: EngineParams | None = None) -> str | None:
        """Start exploring `params` (with `recall`: try that one configuration); None when it started,
        else why not."""
        if self.current is not None:
            return "an exploration is running"
        if self.life.slot.current is not None:
            return "a trial is running"
        if self.life.engine.run is None or self.life.engine.run.ready_mono is None:
            return "vLLM is not serving"
        explore_id = self.memory.next_trial()
        self.current = Exploration(
            explore_id,
            tuple(params),
            reason,
            check(Phase.NONE, Phase.BASELINE),
            self.monotonic(),
            recall=recall,
        )
        self.life.slot.hold(self.current.owner)
        self.prober.request(f"exploration {explore_id}: the configuration in force", self._baseline)
        return None

    def _baseline(self, result: ProbeResult | None, why: str | None) -> None:
        ex = self.current
        if ex is None:
            return
        if result is None:
            self._finish(f"no baseline probe: {why}")
            return
        # Live traffic's window is the one before the baseline probe began: the probe's own requests
        # saturate a small max_num_seqs (the engine tier's 4 at a time against 2 made an idle engine look
        # saturated, and each point then scored its mostly idle window: 0 tok/s).
        live = self.window(ex.since - self.config().tuning.window_s, ex.since)
        ex.source, ex.live, goal = objective_source(live), live, self.goal()
        feasible, excess = self._probe_score(result)
        objective, _ = scored(goal, ex.source, feasible, live)
        if ex.recall is not None:
            self._recall_start(ex, result, objective, live)
            return
        params = self.life.params
        run = self.life.engine.run
        machine = run.machine if run is not None else None
        backend = machine.backend if machine is not None else "cuda"
        unified = bool(machine is not None and machine.memory.unified)
        tuning = self.config().tuning
        current: dict[str, Value] = {}
        ladders: dict[str, tuple[Value, ...]] = {}
        for name in ex.params:
            value = getattr(params, name)
            if value is None:
                value = REGISTRY[name].default(backend, machine.memory.gpu_total_bytes if machine else None)
                if value is None:
                    self._finish(
                        f"{name} is not set and vLLM's default is not known: nothing to explore from"
                    )
                    return
                ex.defaults[name] = value
            current[name] = value
            ladders[name] = ladder(
                name, value, backend=backend, unified=unified, bounds=tuning.bounds,
                unified_cap=tuning.unified_max_gpu_memory_utilization,
            )  # fmt: skip
        known = {}
        if self.recall is not None:
            known = self.recall.known(ex.params, params, goal=goal, source=ex.source, live=live)
        for name, value in self.memory.tabu():
            if name in ex.params:
                known.setdefault((name, value), None)  # known-bad: never measured, never chosen
        ex.search = start(
            ex.params,
            current,
            ladders,
            goal=goal,
            objective=objective,
            known=known,
            excess=excess,
        )
        budget = self.memory.budget().left
        self.rec.record(
            "explore.started",
            explore=ex.explore_id,
            params=list(ex.params),
            trigger=ex.reason,
            ladders={k: list(v) for k, v in ladders.items()},
            objective=objective,
            **goal.fields(),
            limit_excess=excess,
            objective_source=ex.source,
            probe=result.as_dict(),
            live=live.as_dict() if live is not None else None,
            known_points=len(known),
            budget_left=budget,
            at_most_restarts=sum(2 * len(v) for v in ladders.values()) + 1,
        )
        self._next(self.monotonic())

    # -- points -----------------------------------------------------------------------------------

    def _next(self, now: float) -> None:
        ex = self.current
        assert ex is not None and ex.search is not None
        ex.search, point = ex.search.next_point()
        if point is None:
            self._to_best(now)
            return
        if self.memory.budget().left <= 0:
            self.rec.record("explore.budget_spent", explore=ex.explore_id, restarts=ex.restarts)
            self._to_best(now)
            return
        name, value = point
        params = self.life.params.replace(**{**ex.search.best, name: value})
        ex.point, plan = point, self.life.capacity.check
        ex.plan = self.submit(lambda: plan(params))
        self._enter(ex, Phase.PLANNING, now)

    def _planned(self, ex: Exploration, now: float) -> None:
        """The planner's verdict on the point: refused — infeasible, tabu, no restart — or restart."""
        assert ex.plan is not None and ex.point is not None and ex.search is not None
        try:
            outcome: PlanOutcome | None = ex.plan.result()
        except Exception:  # the planner is advice: a bug in it does not stop the exploration
            outcome = None
        refusal = outcome.refusal if outcome is not None else None
        ex.plan = None
        name, value = ex.point
        if refusal is not None:
            self._enter(ex, Phase.DECIDED, now)
            self._record_point(ex, None, {"refused": refusal})
            self.memory.add_tabu(name, value, f"the planner refused it: {refusal}")
            self._next(now)
            return
        params = self.life.params.replace(**{**ex.search.best, name: value})
        if not self._request(ex, params, f"exploration {ex.explore_id}: {name} = {value}", outcome):
            self._finish("the restart could not be announced")
            return
        self._restarted(ex, Phase.APPLYING, now)

    def _request(
        self, ex: Exploration, params: EngineParams, reason: str, plan: PlanOutcome | None = None
    ) -> bool:
        """Ask the lifecycle for the change (with the planner's outcome for it, when asked); False when
        it could not be announced."""
        ex.change_id = self.life.request(params, reason, ex.owner, ex.explore_id, plan)
        return ex.change_id is not None

    def _end_change(self, ex: Exploration, *, keep: bool, reason: str, promote: bool = True) -> bool:
        ended = ex.change_id is not None and self.life.slot.end(
            ex.change_id, keep=keep, reason=reason, promote=promote
        )
        if ended and keep:
            ex.change_id = None  # kept: nothing of it is in flight any more
        return ended

    def _outcome_pending(self, ex: Exploration) -> bool:
        """Its change ended in the lifecycle (aborted, reverted) and the outcome is on the loop's queue:
        nothing is decided about it until then."""
        return ex.change_id is not None and not self.life.slot.holds(ex.change_id)

    def _restarted(self, ex: Exploration, phase: Phase, now: float) -> None:
        ex.restarts += 1
        self.memory.count_restart()
        self._enter(ex, phase, now)

    def _enter(self, ex: Exploration, phase: Phase, now: float) -> None:
        """The exploration's next phase, checked against tune/experiment.py's table."""
        ex.step, ex.since = check(ex.step, phase), now

    def step(self, now: float) -> None:
        ex = self.current
        if ex is None or self._outcome_pending(ex):
            return
        if ex.step is Phase.PLANNING and ex.plan is not None and ex.plan.done():
            self._planned(ex, now)
        elif ex.step is Phase.MEASURING and ex.pending is not None and self._window_full(ex, now):
            (result, why), ex.pending = ex.pending, None
            self._scored(ex, result, why, now)
        elif ex.step is Phase.WARMUP and now - ex.since >= self.config().tuning.warmup_s:
            self._enter(ex, Phase.MEASURING, now)
            what = ex.point or "the recalled configuration"
            self.prober.request(f"exploration {ex.explore_id}: {what}", self._measured, remember=False)

    def _measured(self, result: ProbeResult | None, why: str | None) -> None:
        """The point's probe is done; scored now, or (live objective) once its live window is whole."""
        ex, now = self.current, self.monotonic()
        if ex is None or ex.step is not Phase.MEASURING or self._outcome_pending(ex):
            return
        if self._window_full(ex, now):
            self._scored(ex, result, why, now)
        else:
            ex.pending = (result, why)

    def _window_full(self, ex: Exploration, now: float) -> bool:
        """A live objective needs `tuning.window_s` of the point's serving, like a trial's evidence."""
        return ex.source == "probe" or now - ex.since >= self.config().tuning.window_s

    def _scored(self, ex: Exploration, result: ProbeResult | None, why: str | None, now: float) -> None:
        live = self.window(ex.since, now) if ex.source == "live" else None
        self._enter(ex, Phase.DECIDED, now)
        feasible, excess = self._probe_score(result) if result is not None else (None, None)
        objective, source = scored(self.goal(), ex.source, feasible, live)
        figures = result.as_dict() if result is not None else {"error": why}
        extra = {"live": live.as_dict() if live is not None else None}
        if ex.recall is not None:
            self._recall_measured(ex, objective, figures, source, extra)
            return
        if ex.point is None or ex.search is None:
            return
        self._record_point(ex, objective, figures, excess=excess, source=source, **extra)
        self._end_change(ex, keep=True, reason="exploration point measured", promote=False)
        self._next(now)

    def _record_point(
        self,
        ex: Exploration,
        objective: float | None,
        figures: dict[str, Any],
        excess: float | None = None,
        source: Source | None = None,
        **extra: Any,
    ) -> None:
        """Fold a point in, file it in the tuning memory and journal it. `source`: what measured its
        value (None: nothing did, it failed: the exploration's source)."""
        assert ex.point is not None and ex.search is not None
        name, value = ex.point
        ex.search = ex.search.record(name, value, objective, excess)
        entry = {"param": name, "value": value, "objective": objective, "limit_excess": excess}
        ex.measured.append(entry)
        source = source or ex.source
        if self.recall is not None:
            params = self.life.params.replace(**{**ex.search.best, name: value})
            self.recall.point(
                params, name, objective, figures, goal=ex.search.goal, source=source, live=ex.live
            )
        self.rec.record(
            "explore.point",
            explore=ex.explore_id,
            **entry,
            **ex.search.goal.fields(),
            objective_source=source,
            best=dict(ex.search.best),
            probe=figures,
            **extra,
        )

    def _probe_score(self, result: ProbeResult) -> tuple[float | None, float | None]:
        """(the probe's value of the objective, None) when it met the latency limits; (None, how far it
        broke the worst one) when it broke one; (None, None) when it failed."""
        if result.errors:
            return None, None
        tuning = self.config().tuning
        excess = limit_excess(
            result.ttft_p95, result.itl_p95, ttft_max=tuning.ttft_p95_max_s, itl_max=tuning.itl_p95_max_s
        )
        return (None, excess) if excess is not None else (self.goal().of_probe(result.signals()), None)

    # -- a recall: one configuration from the tuning memory -----------------------------------------

    def _recall_start(
        self, ex: Exploration, result: ProbeResult, objective: float | None, live: WindowStats | None
    ) -> None:
        assert ex.recall is not None
        ex.baseline_objective = objective
        changes = {k: v for k, v in ex.recall.as_dict().items() if getattr(self.life.params, k) != v}
        self.rec.record(
            "explore.started",
            explore=ex.explore_id,
            params=list(ex.params),
            trigger=ex.reason,
            recall=changes,
            objective=ex.baseline_objective,
            **self.goal().fields(),
            objective_source=ex.source,
            probe=result.as_dict(),
            live=live.as_dict() if live is not None else None,
            budget_left=self.memory.budget().left,
            at_most_restarts=2,
        )
        if self.memory.budget().left <= 0:
            self._finish("the restart budget is spent")
            return
        if not self._request(ex, ex.recall, f"exploration {ex.explore_id}: {ex.reason}"):
            self._finish("the restart could not be announced")
            return
        self._restarted(ex, Phase.APPLYING, self.monotonic())

    def _recall_measured(
        self,
        ex: Exploration,
        objective: float | None,
        figures: dict[str, Any],
        source: Source,
        extra: dict[str, Any],
    ) -> None:
        assert ex.recall is not None
        base, goal = ex.baseline_objective, self.goal()
        tolerance = goal.tolerance
        won = goal.better(objective, base)
        entry = {"recall": ex.recall.as_dict(), "objective": objective, "objective_before": base}
        ex.measured.append(entry)
        self.rec.record(
            "explore.point",
            explore=ex.explore_id,
            **entry,
            **goal.fields(),
            objective_source=source,
            kept=won,
            probe=figures,
            **extra,
        )
        if self.recall is not None:  # its own figures here: a hint from elsewhere becomes a measurement
            for name in ex.params:
                self.recall.point(ex.recall, name, objective, figures, goal=goal, source=source, live=ex.live)
        if won:
            self._end_change(
                ex, keep=True, reason="exploration: the recalled configuration won", promote=False
            )
            self._finish("the recalled configuration won", promote=True)
            return
        self._recall_lost(ex, f"it did not beat the configuration in force by {tolerance:.0%}")
        if self._end_change(
            ex, keep=False, reason=f"exploration {ex.explore_id}: the recalled configuration lost"
        ):
            self._restarted(ex, Phase.REVERTING, self.monotonic())
        else:
            self._finish("the revert could not be started")

    def _recall_lost(self, ex: Exploration, why: str) -> None:
        assert ex.recall is not None
        for name in ex.params:
            self.memory.add_tabu(name, getattr(ex.recall, name), f"recalled from the tuning memory: {why}")

    def _to_best(self, now: float) -> None:
        ex = self.current
        assert ex is not None and ex.search is not None
        # vLLM's default of a parameter left unset is no change: the bench's block_size exploration, with
        # no point measured, restarted vLLM to pass --block-size 128, what it ran already.
        changes = {
            name: value
            for name, value in ex.search.best.items()
            if not (getattr(self.life.params, name) is None and ex.defaults.get(name) == value)
        }
        best = self.life.params.replace(**changes)
        if best == self.life.params:
            self._finish("done", promote=True)
            return
        reason = f"exploration {ex.explore_id}: the best point"
        if not self._request(ex, best, reason):
            self._finish("the restart to the best point could not be announced")
            return
        self._restarted(ex, Phase.FINISHING, now)

    def _finish(self, why: str, *, promote: bool = False, kept: bool = False) -> None:
        """The exploration is over. `promote`: the configuration in force becomes last-known-good now;
        `kept`: it already did (the restart to the best point served)."""
        ex = self.current
        if ex is None:
            return
        check(ex.step, Phase.NONE)
        self.current = None
        self.life.slot.release()
        best = dict(ex.search.best) if ex.search is not None else {}
        if ex.recall is not None:
            best = ex.recall.as_dict() if promote else {}
        if promote:
            self.life.promote(self.life.params, f"exploration {ex.explore_id}: the best point")
        self.rec.record(
            "explore.finished",
            explore=ex.explore_id,
            trigger=ex.reason,
            reason=why,
            best=best,
            objective=ex.search.best_objective if ex.search is not None else None,
            **self.goal().fields(),
            limit_excess=ex.search.best_excess if ex.search is not None else None,
            points=len(ex.measured),
            restarts=ex.restarts,
            params=self.life.params,
        )
        log.info("explore.finished", explore=ex.explore_id, best=best, restarts=ex.restarts, why=why)
        if promote or kept:
            self.on_kept(f"exploration {ex.explore_id} finished")

    # -- what became of its changes (ChangeEvent, forwarded by the tuner) ------------------------------

    def on_change(self, event: ChangeEvent) -> None:
        """The outcome of this exploration's change; one about an earlier change is ignored."""
        ex = self.current
        if ex is None or ex.change_id != event.change_id:
            return
        if event.outcome in (Outcome.REVERTED, Outcome.ABORTED):
            ex.change_id = None  # the change is over
        if event.outcome is Outcome.SERVING:
            self._serving(ex, event.at)
        elif event.outcome is Outcome.FAILED:
            assert event.failure is not None
            self._failed(ex, event.failure)
        elif event.outcome is Outcome.REVERTED:
            self._reverted(ex, event.run, event.failure)
        else:
            self._finish(f"aborted: {event.reason}")

    def _serving(self, ex: Exploration, now: float) -> None:
        if ex.step is Phase.FINISHING:
            self._end_change(ex, keep=True, reason="exploration: the best point serves")
            self._finish("done", kept=True)
        elif ex.step is Phase.APPLYING:
            self._enter(ex, Phase.WARMUP, now)

    def _failed(self, ex: Exploration, failure: EngineFailure) -> None:
        if ex.step is Phase.FINISHING:
            self._finish(f"the best point failed to start: {failure.kind}")
            return
        ex.restarts += 1  # the revert the lifecycle starts at once
        self.memory.count_restart()
        if ex.recall is not None:
            self._recall_lost(ex, f"its start failed: {failure.kind}")
            self._enter(ex, Phase.REVERTING, self.monotonic())
            return
        self._enter(ex, Phase.REVERTING, self.monotonic())
        self._record_point(ex, None, {"failure": failure.as_dict()})
        if ex.point is not None:
            self.memory.add_tabu(ex.point[0], ex.point[1], f"its start failed in exploration: {failure.kind}")

    def _reverted(self, ex: Exploration, run: EngineRun | None, failure: EngineFailure | None) -> None:
        if run is None:
            self._finish(f"the revert after a failed point failed: {failure.kind if failure else '?'}")
            return
        if ex.recall is not None:
            self._finish("the recalled configuration lost: the one before serves again")
            return
        self._next(self.monotonic())

    def status(self, now: float) -> dict[str, Any] | None:
        ex = self.current
        if ex is None:
            return None
        return {
            "explore": ex.explore_id,
            "params": list(ex.params),
            "step": ex.step.name.lower(),
            "step_s": round(now - ex.since, 1),
            "point": list(ex.point) if ex.point else None,
            "best": dict(ex.search.best) if ex.search is not None else None,
            "best_objective": ex.search.best_objective if ex.search is not None else None,
            "points": len(ex.measured),
            "restarts": ex.restarts,
        }
