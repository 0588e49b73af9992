"""The tuning loop: rules fire, the tuner proposes one change, runs it as a trial through the lifecycle's
normal start path, decides keep or revert from like-with-like evidence, and tells the story in the journal.

A stateful peer of the lifecycle, driven by the main loop (`on_poll` every poll, `step` every tick); its
trial's experiment asks the lifecycle for the change (`Lifecycle.request`, decided with `ChangeSlot.end`)
and learns its outcome as a `ChangeEvent` the loop delivers (`on_change`, handed to the trial's or the
exploration's experiment). Every decision is pure and lives in
`tunerd.policy`: rule evaluation (`rules`), what a fired rule does (`fired`), the proposal (`tunables`),
the gates (`gates`), the evidence (`evidence`) and the verdict (`verdict`).

A trial, in order: the rule fired on the *before* window of the serving run → the planner is asked
(a refused change costs no restart) → the intent is journaled and vLLM restarted with the one change →
warm-up → the *after* window, of the same length, of that run only → keep (the parameters become
last-known-good and the new baseline) or revert (a restart like any other; the value goes tabu). The
front door's in-flight cap is not tried: the door steers it live (door/limit.py); while it is still moving
toward targets it misses, restart knobs wait (`restart_wait`, tune/proposer.py).

A trial is `trials.Trial`'s: the judge of the one change, whose phases and change its `Experiment`
runs (tune/experiment.py); the tuner is its source: it evaluates the rules, asks `policy.fired.decide`
what a fired rule does, proposes the change (`proposer`), and keeps the windows the trial measures.
The second mode, exploration, is `explorer`'s (started by `explore_triggers`); the probe is
`prober`'s; the baseline `baseline`'s; the door's concurrency curve `curve.CurveSlot`'s; the fleet's
proposals `fleet`'s. Over 400 lines (about 610): the rules, the start of a trial and what may run
beside what (one experiment at a time) read in order as one source of changes; its decisions are the
policy modules', its memory is `tune.memory`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from datetime import datetime
from functools import partial

import structlog

from tunerd.config import Config
from tunerd.config.rules import Rule, RuleSet
from tunerd.core.params import EngineParams, batch_defaults
from tunerd.core.states import EngineState
from tunerd.engine.process import EngineRun
from tunerd.observe.poller import PollSample
from tunerd.policy.evidence import (
    Point,
    WindowStats,
    per_poll_rates,
    signal_values,
    slo_counts,
    window_signals,
    window_stats,
)
from tunerd.policy.fired import Act, Alert, Defer, Facts, Mute, decide
from tunerd.policy.first_step import LostCap
from tunerd.policy.gates import window_open
from tunerd.policy.objective import Goodput, Throughput, configured, objective
from tunerd.policy.rules import RuleState, TermValue, evaluate
from tunerd.policy.tunables import NoProposal, Proposal
from tunerd.policy.verdict import objective_in_force
from tunerd.policy.weigh import noise_meter
from tunerd.records.metrics import Metrics
from tunerd.records.recorder import Recorder
from tunerd.records.state import DaemonState
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.change import ChangeEvent
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.baseline import Baselines
from tunerd.tune.curve import CapCurve, CurveSlot, DoorCap
from tunerd.tune.explore_triggers import ExploreTriggers
from tunerd.tune.explorer import Explorer
from tunerd.tune.fleet import Fleet
from tunerd.tune.memory import TuningMemory
from tunerd.tune.prober import Prober
from tunerd.tune.proposer import Proposer
from tunerd.tune.recall import Recall
from tunerd.tune.trials import RunSamples, Trial, TrialContext

log = structlog.get_logger("tunerd")


class Tuner:
    """Owns the rules' states, the trial in progress and the tuning memory (in the state file)."""

    def __init__(
        self,
        config: Config,
        rules: RuleSet | None,
        lifecycle: Lifecycle,
        *,
        recorder: Recorder,
        dstate: DaemonState,
        save_state: Callable[[], None],
        metrics: Metrics,
        submit: Callable[[Callable[[], PlanOutcome]], Future[PlanOutcome]],
        wallclock: Callable[[], datetime],
        prober: Prober | None = None,
        recall: Recall | None = None,
        fleet: Fleet | None = None,
        restart_wait: Callable[[], str | None] | None = None,
        door_lost: Callable[[], Sequence[LostCap]] | None = None,
        door: DoorCap | None = None,
    ) -> None:
        self.config = config
        self.rules = rules.rules if rules is not None else ()
        self.life = lifecycle
        self.rec = recorder
        self.dstate = dstate
        self.save_state = save_state
        self.metrics = metrics
        self.submit = submit
        self.wallclock = wallclock
        self.states: dict[str, RuleState] = {}
        self.samples = RunSamples()
        self.live: Mapping[str, float | None] = {}
        self.trial: Trial | None = None
        self.curves = CurveSlot()  # `tunerd door --curve`, or a rule's step measured through the cap
        self.memory = TuningMemory(
            dstate.tuning,
            lambda: self.config.tuning,
            recorder=recorder,
            save_state=save_state,
            wallclock=wallclock,
        )
        self.prober = prober
        self.baselines = Baselines(self.memory, prober, lambda: self.config, recorder=recorder)
        self.recall = recall
        self.fleet = fleet  # the shared tuning memory ([memory] url), None: this box alone
        self.door = door  # the front door's cap, for a curve (None: the door is off)
        self._after_curve: tuple[Rule, WindowStats] | None = None  # a rule's step waiting on its curve

        def lost() -> tuple[LostCap, ...]:
            """What the door's cap lost: its steered controller's memory, and this run's last curve's."""
            steered = tuple(door_lost()) if door_lost is not None else ()
            by_curve = self.curves.lost(self._serving_run())
            return steered if by_curve is None else (*steered, by_curve)

        steered = door.steered_cap if door is not None else None
        self.proposer = Proposer(lifecycle, self.memory, lambda: self.config, restart_wait, lost, steered)
        self._trial_ctx = TrialContext(
            config=lambda: self.config,
            lifecycle=lifecycle,
            recorder=recorder,
            memory=self.memory,
            metrics=metrics,
            submit=submit,
            window=self._window,
            rule_values=self._rule_values,
            on_kept=self.baselines.probe,
            recall=recall,
        )
        self.explorer = (
            Explorer(
                lambda: self.config,
                lifecycle,
                prober,
                self.memory,
                recorder=recorder,
                monotonic=lifecycle.monotonic,
                recall=recall,
                on_kept=self.baselines.probe,
                submit=submit,
                window=self._window,
            )
            if prober is not None
            else None
        )
        self.triggers = (
            ExploreTriggers(
                self.explorer,
                lifecycle,
                self.memory,
                recall,
                lambda: self.config,
                recorder=recorder,
                wallclock=wallclock,
                why_not=self._why_not_explore,
            )
            if self.explorer is not None
            else None
        )
        self._publish_mode()

    @property
    def exploring(self) -> bool:
        return self.explorer is not None and self.explorer.current is not None

    def explore(self, params: list[str], reason: str) -> str | None:
        """Start an exploration of `params` (`tunerd explore`); None when it started, else why not."""
        if self.triggers is None:
            return "the probe is off: an exploration measures with it"
        return self.triggers.explore(params, reason)

    def on_identity(self) -> None:
        """vLLM's identity is known: the tuning memory is consulted (tune/explore_triggers.py)."""
        if self.triggers is not None:
            self.triggers.on_identity()

    def _why_not_explore(self) -> str | None:
        if self.config.tuning.mode != "auto":
            return f"tuning.mode is {self.config.tuning.mode}"
        if self.paused:
            return "tuning is paused (tunerd resume)"
        if self.trial is not None:
            return "a trial is running"
        if self.curves.busy:
            return "the door's concurrency curve is being measured"
        return None

    # -- configuration and operator commands ---------------------------------------------------

    def reload(self, config: Config, rules: RuleSet | None) -> None:
        """New config and rules (SIGHUP): rules keep their state by name; a trial runs on."""
        self.config = config
        self.rules = rules.rules if rules is not None else ()
        names = {rule.name for rule in self.rules}
        self.states = {name: state for name, state in self.states.items() if name in names}
        self._publish_mode()

    def pause(self) -> bool:
        """Freeze tuning (persisted): no rule acts until `resume`; a trial in progress finishes."""
        changed = self.memory.set_paused(True)
        self._publish_mode()
        return changed

    def resume(self) -> bool:
        changed = self.memory.set_paused(False)
        self._publish_mode()
        return changed

    @property
    def paused(self) -> bool:
        return self.memory.state.paused

    def _publish_mode(self) -> None:
        mode = self.config.tuning.mode
        value = {"off": 0, "dry-run": 1, "auto": 2}[mode]
        self.metrics.tuning_mode.set(-1 if self.paused else value)

    # -- observation ---------------------------------------------------------------------------

    def on_poll(self, sample: PollSample, signals: Mapping[str, float | None], now: float) -> None:
        """One poll: keep the serving run's sample; with no trial, evaluate the rules."""
        run = self.life.engine.run
        if run is None or self.life.engine.state is not EngineState.RUNNING or sample.run_id != run.run_id:
            return
        if run.run_id != self.samples.run_id:
            self._new_run(run.run_id)
        scrape = sample.scrape
        if scrape is not None:  # the poll as the rules' window was fed it (a failed scrape too)
            points = self.samples.points
            points.append(Point(sample.taken_at, scrape.sample, sample.readings))
            horizon = 3 * self.config.tuning.window_s + self.config.tuning.max_extend_s + 60
            while points and points[0].t < now - horizon:
                points.popleft()
        self.live = signals
        if self.trial is None and not self.exploring and not self.curves.busy:
            self._evaluate_rules(run, now)

    def noise(self, now: float) -> dict[str, object] | None:
        """The noise meter (`tunerd status`): the objective's relative noise over the serving run's last
        `[tuning] window_s`, the smallest change a trial window of that length detects and the window
        that would detect the tolerance (policy/weigh.noise_meter); None without enough polls."""
        tuning = self.config.tuning
        start = now - tuning.window_s
        run = self.life.engine.run
        if run is not None and run.ready_mono is not None:  # the warm-up's polls are not the configuration's
            start = max(start, run.ready_mono + tuning.warmup_s)
        points = [p for p in self.samples.points if p.t >= start]
        name = objective_in_force(tuning, self.config.objective, self.config.door.enabled).name
        if name == Goodput.name:
            counts = slo_counts(points, start, now)
            samples: Sequence[float] = counts.samples(self.config.objective.count) if counts else ()
        else:
            name = Throughput.name  # a latency quantile has no per-poll samples: throughput's noise
            samples = per_poll_rates([p for p in points if p.sample is not None], "generation_tokens_total")
        meter = noise_meter(
            samples,
            window_s=tuning.window_s,
            tolerance=tuning.tolerance,
            confidence=tuning.confidence,
            start_noise=tuning.start_noise,
        )
        return None if meter is None else {"objective": name, **meter}

    def _new_run(self, run_id: int) -> None:
        self.samples = RunSamples(run_id)
        self.states = {name: state.fresh() for name, state in self.states.items()}

    def _window(self, start: float, end: float) -> WindowStats | None:
        """The serving run's window [start, end]."""
        run = self.life.engine.run
        params = run.params if run is not None else self.life.params
        return window_stats(
            self.samples.points,
            start,
            end,
            max_num_seqs=params.max_num_seqs,
            saturated_waiting=self.config.tuning.saturated_waiting,
            saturated_kv_usage=self.config.tuning.saturated_kv_usage,
        )

    def _rule_values(self, end: float, not_before: float = float("-inf")) -> dict[str, float | None]:
        """The rules' window (`observe.window_s`) of the serving run, ending at its last poll at or before
        `end` and reaching back no further than `not_before`, computed as the rules' live window computes
        it (one definition per name; ending at the poll, as the live window does, so that at a firing it
        is the very statistic the rule read), with the probe's figures from the live signals: what a
        rule's terms are evaluated against in a trial, and what a baseline records."""
        points = self.samples.points
        last = next((p.t for p in reversed(points) if p.t <= end), end)
        start = max(not_before, last - self.config.observe.window_s)
        return signal_values(window_signals(points, start, last), self.live)

    def _settled(self, run: EngineRun, now: float) -> bool:
        """Past the warm-up and one whole signal window: the window holds this run only."""
        assert run.ready_mono is not None
        return now - run.ready_mono >= self.config.tuning.warmup_s + self.config.observe.window_s

    # -- rules -----------------------------------------------------------------------------------

    def _evaluate_rules(self, run: EngineRun, now: float) -> None:
        if not self.rules or self.config.tuning.mode == "off" or not self._settled(run, now):
            return
        self.baselines.step(self.live, partial(self._rule_values, now))
        for rule in self.rules:
            state = self.states.get(rule.name, RuleState())
            mute = self.memory.muted(rule.name)
            if mute is not None:
                state = replace(state, muted_until=now + mute[0])
            result = evaluate(rule, state, self.live, self.memory.baseline, now)
            self.states[rule.name] = result.state
            self.metrics.rule_active.labels(rule=rule.name).set(1 if result.holds else 0)
            if result.resolved:
                self.rec.record(
                    "rule.resolved",
                    rule=rule.name,
                    reason=f"its condition has not held for {rule.for_s:g} s",
                    terms=[t.as_dict() for t in result.terms],
                )
                log.info("rule.resolved", rule=rule.name)
            if result.fired:
                self._fired(rule, result.state, result.terms, run, now)
                if self.trial is not None or self.curves.busy or self.exploring:
                    # One experiment at a time: a rule firing in the same poll would otherwise start a
                    # trial whose restart aborts the curve the first one just began (seen on the goodput
                    # proof's closed loop: the KV rule's curve, then the TTFT rule's restart, one poll).
                    return

    def _fired(
        self, rule: Rule, state: RuleState, terms: tuple[TermValue, ...], run: EngineRun, now: float
    ) -> None:
        self.rec.record(
            "rule.fired",
            rule=rule.name,
            why=rule.why,
            terms=[t.as_dict() for t in terms],
            held_s=rule.for_s,
            action=rule.action.model_dump(),
        )
        log.info("rule.fired", rule=rule.name, terms=[str(t.term) for t in terms])
        tuning = self.config.tuning
        wall = self.wallclock()
        assert run.ready_mono is not None
        facts = Facts(
            paused=self.paused,
            change_in_flight=self.trial is not None,
            budget=self.memory.budget(),
            served_s=now - run.ready_mono,
            window_open=window_open(tuning.maintenance, wall.astimezone()),  # windows are in local time
            before=self._window(now - tuning.window_s, now),
            kept=self.memory.kept_changes(),
            probe_quiet_s=self.prober.quiet_for(now) if self.prober is not None else None,
        )
        propose = partial(self._propose, rule)  # asked at most once, past the gates
        decision = decide(rule, state, facts, propose, tuning=tuning, now=now, now_wall=wall.timestamp())
        if isinstance(decision, Alert):
            extra = {"reason": decision.reason} if decision.reason is not None else {}
            self.rec.record("rule.alert", rule=rule.name, why=rule.why, **extra)
            log.warning("rule.alert", rule=rule.name, why=rule.why, **extra)
        elif isinstance(decision, Defer):
            if decision.state is not None:
                self.states[rule.name] = decision.state
            self.rec.record("rule.deferred", rule=rule.name, reason=decision.reason)
        elif isinstance(decision, Mute):
            if decision.exhausted is not None:
                self.rec.record("rule.exhausted", rule=rule.name, reason=decision.exhausted)
            self.memory.mute(rule.name, decision.reason)
        else:
            self._act(rule, decision, now)

    def _propose(self, rule: Rule, before: WindowStats) -> Proposal | NoProposal:
        """The proposer's change for `rule`, once what the memory knows to be bad under this load is tabu."""
        if self.recall is not None:
            for param, value, why in self.recall.bad_values(before):
                if (param, value) not in self.memory.tabu():
                    self.memory.add_tabu(param, value, f"tuning memory: {why}")
        history = None if before.generation_tokens_per_request else self._window(-math.inf, before.end)
        ask = partial(self.proposer.propose, rule, running=before.running_avg, window=before, history=history)
        proposal = ask()
        if self.fleet is None or self.recall is None:
            return proposal
        # The fleet's best kept value replaces the rule's own step (which may be a value that lost
        # elsewhere: the step says which way, the fleet how far); then what lost elsewhere is tabu, and a
        # step that landed on it is proposed again (the proposer says why not, or takes the next).
        key = self.recall.live_key(before)
        if isinstance(proposal, Proposal):
            first = self.fleet.take_first(key, proposal, self.memory.tabu())
            if first is not proposal:
                self.fleet.take_bad_values(key, self.memory)
                return first
        self.fleet.take_bad_values(key, self.memory)
        if isinstance(proposal, Proposal) and (proposal.param, proposal.new) in self.memory.tabu():
            return ask()
        return proposal

    def _act(self, rule: Rule, decision: Act, now: float) -> None:
        """Run the decided proposal as a trial (in dry-run: journal it only)."""
        proposal, before = decision.proposal, decision.before
        if proposal.param == "max_num_seqs" and isinstance(proposal.new, int):
            note = self.curves.expected(self._serving_run(), proposal.new, self._concurrency_in_force())
            if note is not None:  # what the door's cap at that value served, without a restart
                proposal = replace(proposal, notes=(*proposal.notes, note))
        if not decision.dry_run and self._curve_first(rule, proposal, before, now):
            return
        # The rule's terms before the change: its own window (`observe.window_s`) of this run, where
        # it just fired; `eased` reads the same statistic over the same length after the change.
        before_values = self._rule_values(now)
        if decision.dry_run:
            self.rec.record(
                "trial.proposed",
                rule=rule.name,
                param=proposal.param,
                old=proposal.old,
                new=proposal.new,
                notes=list(proposal.notes),
                proposed_by=proposal.proposed_by,
                arithmetic=proposal.arithmetic,
                before=before.as_dict(),
                mode="dry-run: nothing changes",
            )
            return
        run = self.life.engine.run
        since = (run.ready_mono if run is not None and run.ready_mono is not None else now) + (
            self.config.tuning.warmup_s
        )
        params = run.params if run is not None else self.life.params
        # The run ends with the change's restart: its polls and parameters are taken now.
        before_for = partial(self._before_window, now, since, params, tuple(self.samples.points))
        trial = Trial(
            self._trial_ctx, self.memory.next_trial(), rule, proposal, before, before_values, before_for
        )
        self.trial = trial
        trial.start(now)

    def _before_window(
        self, fired: float, since: float, params: EngineParams, points: Sequence[Point], length: float
    ) -> WindowStats | None:
        """The serving run's window of `length` ending where the rule fired, over its polls past its
        warm-up (`since`): a trial's before window, grown with its after window (tune/trials.py)."""
        return window_stats(
            points,
            max(since, fired - length),
            fired,
            max_num_seqs=params.max_num_seqs,
            saturated_waiting=self.config.tuning.saturated_waiting,
            saturated_kv_usage=self.config.tuning.saturated_kv_usage,
        )

    # -- the loop's step -----------------------------------------------------------------------------

    def measure_curve(
        self, caps: Sequence[int], *, point_s: float, settle_s: float, trigger: str, now: float
    ) -> str | None:
        """Measure the door's concurrency curve at `caps` (`tunerd door --curve`, or before a restart of
        max_num_seqs): None when it started, else why not (one experiment at a time, on a serving vLLM)."""
        run = self.life.engine.run
        door = self.door
        if door is None:
            return "the front door is off: the curve moves its cap"
        if run is None or self.life.engine.state is not EngineState.RUNNING:
            return "vLLM is not serving"
        if self.trial is not None:
            return "a trial is running"
        if self.exploring:
            return "an exploration is running"
        if self.curves.busy:
            return "a curve is already being measured"
        config = self.config
        name = objective_in_force(config.tuning, config.objective, config.door.enabled).name
        goal = configured(config.objective) if name == Goodput.name else objective(name)
        curve = CapCurve(
            caps,
            point_s=point_s,
            settle_s=settle_s,
            goal=goal,
            pin=door.try_cap,
            give_back=lambda: door.restore(f"{trigger}: the curve is over"),
            window=self._window,
            recorder=self.rec,
            trigger=trigger,
            now=now,
        )
        self.curves.begin(curve, run.run_id)
        return None

    def _curve_first(self, rule: Rule, proposal: Proposal, before: WindowStats, now: float) -> bool:
        """Before a restart that lowers max_num_seqs, with the door on: the door's cap at the new value and
        at the concurrency in force (max_num_seqs, or the door's steered cap where lower), measured on this
        run in seconds a point (no restart), unless one of this run's curves measured the new value
        already. The step is proposed again once the curve is over, and is not taken unless the cap at the
        new value served strictly more (tune/curve.curve_lost_below_best). True when the curve started
        (the restart waits)."""
        if self.door is None or proposal.param != "max_num_seqs" or not isinstance(proposal.new, int):
            return False
        run = self.life.engine.run
        if run is None or self.curves.measured(run.run_id, proposal.new):
            return False
        seqs, current = self._max_num_seqs_in_force(), self._concurrency_in_force()
        if current is None or proposal.new >= current:
            return False
        tuning = self.config.tuning
        trigger = (
            f"rule {rule.name}: max_num_seqs {seqs} → {proposal.new} measured through the door's cap first"
        )
        if current != seqs:
            trigger += f", against the cap it steers ({current})"
        if (
            self.measure_curve(
                (proposal.new, current), point_s=tuning.window_s / 2, settle_s=5.0, trigger=trigger, now=now
            )
            is not None
        ):
            return False
        self._after_curve = (rule, before)
        return True

    def _serving_run(self) -> int | None:
        """The run id of the vLLM serving now (None: none is)."""
        run = self.life.engine.run
        return run.run_id if run is not None and self.life.engine.state is EngineState.RUNNING else None

    def _max_num_seqs_in_force(self) -> int | None:
        """The serving run's max_num_seqs, vLLM's default for its machine when unset (None: unknown)."""
        run = self.life.engine.run
        if run is None:
            return None
        if run.params.max_num_seqs is not None:
            return run.params.max_num_seqs
        if run.machine is None:
            return None
        return batch_defaults(run.machine.backend, run.machine.memory.gpu_total_bytes)[0]

    def _concurrency_in_force(self) -> int | None:
        """The most requests vLLM runs at once now: max_num_seqs in force, or the door's steered cap where
        it is lower (None: unknown)."""
        seqs = self._max_num_seqs_in_force()
        steered = self.door.steered_cap() if self.door is not None else None
        if steered is None:
            return seqs
        return steered if seqs is None else min(seqs, steered)

    def _after_the_curve(self, now: float) -> None:
        """The curve a rule's step waited on is over: propose the step again (the curve's lost caps and
        expected gain now known) and act on it, or journal why not."""
        if self._after_curve is None:
            return
        (rule, before), self._after_curve = self._after_curve, None
        proposal = self._propose(rule, before)
        if isinstance(proposal, NoProposal):
            self.rec.record("rule.deferred", rule=rule.name, reason=f"max_num_seqs: {proposal.reason}")
            return
        self._act(rule, Act(proposal, before, dry_run=False), now)

    def step(self, now: float) -> None:
        """Drive the trial, the exploration or the curve in progress (every loop tick)."""
        if self.fleet is not None:
            self.fleet.step(now)
        if self.curves.busy:
            if self.curves.step(now, self._serving_run()):
                self._after_the_curve(now)
            elif not self.curves.busy:  # aborted: the step that waited on it is dropped
                self._after_curve = None
        if self.explorer is not None and self.triggers is not None:
            self.explorer.step(now)
            run = self.life.engine.run
            settled = run is not None and run.ready_mono is not None and self._settled(run, now)
            self.triggers.step(now, settled)
        if self.trial is not None:
            self.trial.experiment.step(now)
            self._let_go()

    # -- what became of the change (ChangeEvent, from the loop's queue) -----------------------------

    def on_change(self, event: ChangeEvent) -> None:
        """The outcome of a change this tuner requested: an exploration's goes to the explorer, a trial's
        is handled here; one about an earlier change (superseded, ended) is ignored."""
        if event.owner != "trial":
            if self.explorer is not None:
                self.explorer.on_change(event)
        elif self.trial is not None:
            self.trial.experiment.on_change(event)
            self._let_go()

    def _let_go(self) -> None:
        """A trial that is over is let go: the rules are evaluated again."""
        if self.trial is not None and self.trial.over:
            self.trial = None
