"""Exploration, the tuner's second mode: a coordinate search over named parameters (policy/explore.py),
each point a normal trial — intent, restart through the start path, warm-up, evidence — whose evidence
is the benchmark probe's throughput, within the latency limits — or, when live traffic saturates the
engine, the live window's (policy/explore.py says why; the probe then still sets the latency limits).

In order: the probe measures the configuration in force `tuning.explore_probes` times (no restart: the
reference every point is compared with, and the search's first look at the probe's noise); the plan
(parameters, ladders, budget, noise, tolerance) is journaled; then point after point: the planner (a
point it refuses is infeasible and costs no restart), a restart with the point, the warm-up, a probe and
as many more of the same start as the search asks for (`Search.again`: a point that looks better is
confirmed before the search moves there — policy/explore.py says why probes of one start and not
interleaved restarts), the point's objective (the mean of its probes; None when its start failed or a
limit broke) with its evidence in `explore.point` (probes, noise, tolerance, ratio interval, verdict),
the next point; the search's best becomes last-known-good (one more restart when
it is not the last point measured). Points stay in force between them and nothing is promoted by time;
each restart counts against the tuner's budget; values known to be bad are tabu; a point known from an
earlier exploration under a comparable load is not measured again. `tunerd explore` starts one; so may a
maintenance window.

A recall is the one-point form: the best configuration the tuning memory knows for this model and box
(a new deployment, an imported memory) is tried against the one in force, probe against probe, and kept
only when it beats it by more than the tolerance; else reverted, and its values go tabu.

Each exploration's phases and changes are run by its `Experiment` (tune/experiment.py: the planner, the
request, the warm-up, the change's outcomes, keep or revert); the explorer is its `Subject`: it says
which point to apply, measures it with a probe (or the live window), scores it and picks the next. The
search itself is pure, in policy/explore.py. Over 400 lines: the baseline, the search's points, the
recall and the finish read as one story of one exploration; its machine is tune/experiment.py's.
"""

from __future__ import annotations

import math
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
from tunerd.supervise.change import ChangeEvent, Owner
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.supervise.preflight import run_here
from tunerd.tune.experiment import Experiment, Phase
from tunerd.tune.memory import TuningMemory
from tunerd.tune.prober import Prober
from tunerd.tune.recall import Recall

log = structlog.get_logger("tunerd")


@dataclass
class Exploration:
    explore_id: int
    params: tuple[str, ...]
    reason: str
    experiment: Experiment  # its phases, its changes and their restarts (tune/experiment.py)
    search: Search | None = None
    point: tuple[str, Value] | None = None
    measured: list[dict[str, Any]] = field(default_factory=list)
    recall: EngineParams | None = None  # a recall: the configuration the tuning memory proposes
    baseline_objective: float | None = None
    source: Source = "probe"  # what scores every point of this exploration, fixed at its start
    live: WindowStats | None = None  # live traffic's window before the search: the load a live score is of
    pending: tuple[ProbeResult | None, str | None] | None = None  # a probe done, the live window not yet
    defaults: dict[str, Value] = field(default_factory=dict)  # vLLM's values of the params not set at start
    baseline_probes: list[ProbeResult] = field(default_factory=list)  # the configuration in force's probes
    measure_from: float = 0.0  # where the point's measurement in progress began (a live window's start)
    probes: list[dict[str, Any]] = field(default_factory=list)  # the point's probes so far, for its record
    quiet_from: float = -math.inf  # when tunerd's last probe before the exploration ended

    @property
    def since(self) -> float:
        return self.experiment.since

    @property
    def restarts(self) -> int:
        return self.experiment.restarts


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
        owner: Owner = "recall" if recall is not None else "explore"
        experiment = Experiment(
            self,
            self.life,
            owner=owner,
            ref=explore_id,
            submit=self.submit,
            warmup_s=lambda: self.config().tuning.warmup_s,
            count_restart=self.memory.count_restart,
        )
        last_probe = self.prober.ended_at
        self.current = Exploration(
            explore_id,
            tuple(params),
            reason,
            experiment,
            recall=recall,
            quiet_from=-math.inf if last_probe is None else last_probe,
        )
        experiment.enter(Phase.BASELINE, self.monotonic())
        self.life.slot.hold(owner)
        self.prober.request(f"exploration {explore_id}: the configuration in force", self._baseline)
        return None

    def _baseline(self, result: ProbeResult | None, why: str | None) -> None:
        """A probe of the configuration in force: `tuning.explore_probes` of them (all feasible) are the
        reference every point is compared with, and the search's first measure of the probe's noise."""
        ex = self.current
        if ex is None:
            return
        done = result is None  # a further probe could not run: the ones before are the baseline
        if result is None:
            if not ex.baseline_probes:
                self._finish(f"no baseline probe: {why}")
                return
        else:
            ex.baseline_probes.append(result)
        result = ex.baseline_probes[-1]
        # Live traffic's window is the one before the baseline probe began, and after any probe before it:
        # the probe's own requests saturate a small max_num_seqs (the engine tier's 4 at a time against 2
        # made an idle engine look saturated, and each point then scored its mostly idle window: 0 tok/s;
        # in CI a second exploration started 7 s after the first one's baseline probe, and re-measured a
        # point the memory knew, scored on that probe's window as "live").
        live = self.window(max(ex.since - self.config().tuning.window_s, ex.quiet_from), ex.since)
        ex.source, ex.live, goal = objective_source(live), live, self.goal()
        feasible, excess = self._probe_score(result)
        objective, _ = scored(goal, ex.source, feasible, live)
        # More probes of the same start while they are feasible; a live score is one window, not probes.
        more = ex.source == "probe" and objective is not None and ex.recall is None
        if more and not done and len(ex.baseline_probes) < self.config().tuning.explore_probes:
            self.prober.request(f"exploration {ex.explore_id}: the configuration in force", self._baseline)
            return
        baseline = [v for v in (self._probe_score(r)[0] for r in ex.baseline_probes) if v is not None]
        if not more:
            baseline = []
        elif baseline:
            objective = sum(baseline) / len(baseline)
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
            samples=baseline,
            probes=tuning.explore_probes,
            start_noise=tuning.start_noise,
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
            baseline_probes=baseline,
            noise=ex.search.evidence((ex.params[0], current[ex.params[0]]))["noise"],
            tolerance=round(ex.search.tolerance(tuning.explore_probes), 4),
            tolerance_floor=goal.tolerance,
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
        ex.point = point
        params = self.life.params.replace(**{**ex.search.best, name: value})
        ex.experiment.plan(params, f"exploration {ex.explore_id}: {name} = {value}", now)

    def step(self, now: float) -> None:
        """Drive the exploration in progress (every loop tick)."""
        if self.current is not None:
            self.current.experiment.step(now)

    # -- the exploration's judge (tune/experiment.py's Subject: its Experiment calls these) -----------

    def on_refused(self, plan: PlanOutcome, now: float) -> None:
        """The planner refused the point: infeasible, tabu, no restart; the next point."""
        ex = self._current()
        assert ex.point is not None
        name, value = ex.point
        self._record_point(ex, None, {"refused": plan.refusal})
        self.memory.add_tabu(name, value, f"the planner refused it: {plan.refusal}")
        self._next(now)

    def on_accepted(self, plan: PlanOutcome) -> None:
        """The point's restart follows; its `explore.point` is journaled once it is measured."""

    def on_unannounced(self, now: float) -> None:
        self._finish("the restart could not be announced")

    def on_warm(self, now: float) -> None:
        ex = self._current()
        ex.measure_from, ex.probes = now, []
        what = ex.point or "the recalled configuration"
        self.prober.request(f"exploration {ex.explore_id}: {what}", self._measured, remember=False)

    def on_measuring(self, now: float) -> None:
        ex = self._current()
        if ex.pending is not None and self._window_full(ex, now):
            (result, why), ex.pending = ex.pending, None
            self._scored(ex, result, why, now)

    def _current(self) -> Exploration:
        assert self.current is not None
        return self.current

    def _measured(self, result: ProbeResult | None, why: str | None) -> None:
        """The point's probe is done; scored now, or (live objective) once its live window is whole."""
        ex, now = self.current, self.monotonic()
        if ex is None or not ex.experiment.measuring:
            return
        if self._window_full(ex, now):
            self._scored(ex, result, why, now)
        else:
            ex.pending = (result, why)

    def _window_full(self, ex: Exploration, now: float) -> bool:
        """A live objective needs `tuning.window_s` of the point's serving, like a trial's evidence (each
        measurement of it a window of its own)."""
        return ex.source == "probe" or now - ex.measure_from >= self.config().tuning.window_s

    def _scored(self, ex: Exploration, result: ProbeResult | None, why: str | None, now: float) -> None:
        """One measurement of the point in force. The search may want another of the same start (a
        probe, or a live window: no restart, `Search.again`) before it decides; then the point is
        journaled with its evidence and the next one follows."""
        live = self.window(ex.measure_from, now) if ex.source == "live" else None
        feasible, excess = self._probe_score(result) if result is not None else (None, None)
        objective, source = scored(self.goal(), ex.source, feasible, live)
        figures = result.as_dict() if result is not None else {"error": why}
        extra = {"live": live.as_dict() if live is not None else None}
        if ex.recall is not None:
            ex.experiment.decide(now)
            self._recall_measured(ex, objective, figures, source, extra)
            return
        if ex.point is None or ex.search is None:
            return
        if result is not None or not ex.probes:  # a confirmation that could not run: judged on the rest
            ex.search = ex.search.record(*ex.point, objective, excess)
            ex.probes.append({"objective": objective, "limit_excess": excess})
            if ex.search.again == ex.point:
                ex.measure_from = now
                what = f"exploration {ex.explore_id}: {ex.point[0]} = {ex.point[1]} again"
                self.prober.request(what, self._measured, remember=False)
                return
        ex.experiment.decide(now)
        self._record_point(ex, objective, figures, excess=excess, source=source, folded=True, **extra)
        ex.experiment.keep("exploration point measured", promote=False)
        self._next(now)

    def _record_point(
        self,
        ex: Exploration,
        objective: float | None,
        figures: dict[str, Any],
        excess: float | None = None,
        source: Source | None = None,
        folded: bool = False,
        **extra: Any,
    ) -> None:
        """Fold a point in (unless its measurements are `folded` already), file it in the tuning memory
        and journal it: its value (the mean of its probes), and the evidence it was judged on (probes,
        noise, tolerance, ratio interval, verdict: `Search.compared`). `source`: what measured its value
        (None: nothing did, it failed: the exploration's source)."""
        assert ex.point is not None and ex.search is not None
        name, value = ex.point
        if not folded:
            ex.search = ex.search.record(name, value, objective, excess)
        objective = ex.search.measured.get(ex.point)  # the mean of its probes; None: infeasible
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
            samples=list(ex.search.samples.get(ex.point, ())),
            **ex.search.compared,
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
        if not ex.experiment.apply(ex.recall, f"exploration {ex.explore_id}: {ex.reason}", self.monotonic()):
            self._finish("the restart could not be announced")

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
            ex.experiment.keep("exploration: the recalled configuration won", promote=False)
            self._finish("the recalled configuration won", promote=True)
            return
        self._recall_lost(ex, f"it did not beat the configuration in force by {tolerance:.0%}")
        reason = f"exploration {ex.explore_id}: the recalled configuration lost"
        if not ex.experiment.revert(reason, self.monotonic()):
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
        if not ex.experiment.apply(best, reason, now, phase=Phase.FINISHING):
            self._finish("the restart to the best point could not be announced")

    def _finish(self, why: str, *, promote: bool = False, kept: bool = False) -> None:
        """The exploration is over. `promote`: the configuration in force becomes last-known-good now;
        `kept`: it already did (the restart to the best point served)."""
        ex = self.current
        if ex is None:
            return
        ex.experiment.end()
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
            best_probes=len(ex.search.best_samples) if ex.search is not None else 0,
            tolerance_floor=self.goal().tolerance,
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
        if self.current is not None:
            self.current.experiment.on_change(event)

    def on_served(self, now: float) -> None:
        """The restart to the best point serves: it is kept (last-known-good), the exploration ends."""
        self._current().experiment.keep("exploration: the best point serves")
        self._finish("done", kept=True)

    def on_failed(self, failure: EngineFailure, now: float) -> None:
        """A point's start failed (its Experiment is REVERTING: the lifecycle reverts at once): infeasible,
        tabu. The best point's: the exploration ends."""
        ex = self._current()
        if ex.experiment.phase is Phase.FINISHING:
            self._finish(f"the best point failed to start: {failure.kind}")
            return
        if ex.recall is not None:
            self._recall_lost(ex, f"its start failed: {failure.kind}")
            return
        self._record_point(ex, None, {"failure": failure.as_dict()})
        if ex.point is not None:
            self.memory.add_tabu(ex.point[0], ex.point[1], f"its start failed in exploration: {failure.kind}")

    def on_aborted(self, reason: str) -> None:
        self._finish(f"aborted: {reason}")

    def on_reverted(self, run: EngineRun | None, failure: EngineFailure | None) -> None:
        ex = self._current()
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
            "step": ex.experiment.phase.name.lower(),
            "step_s": round(now - ex.since, 1),
            "point": list(ex.point) if ex.point else None,
            "best": dict(ex.search.best) if ex.search is not None else None,
            "best_objective": ex.search.best_objective if ex.search is not None else None,
            "points": len(ex.measured),
            "restarts": ex.restarts,
        }
