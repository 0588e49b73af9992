"""The tuning loop: rules fire, the tuner proposes one change, runs it as a trial through the lifecycle's
normal start path, decides keep or revert from like-with-like evidence, and tells the story in the journal.

A stateful peer of the lifecycle, driven by the main loop (`on_poll` every poll, `step` every tick); it
asks the lifecycle for a change (`Lifecycle.request`, decided with `ChangeSlot.end`) and learns its
outcome as a `ChangeEvent` the loop delivers (`on_change`). Every decision is pure and lives in
`tunerd.policy`: rule evaluation (`rules`), what a fired rule does (`fired`), the proposal (`tunables`),
the gates (`gates`), the evidence (`evidence`) and the verdict (`verdict`).

A trial, in order: the rule fired on the *before* window of the serving run → the planner is asked
(a refused change costs no restart) → the intent is journaled and vLLM restarted with the one change →
warm-up → the *after* window, of the same length, of that run only → keep (the parameters become
last-known-good and the new baseline) or revert (a restart like any other; the value goes tabu). A
live knob's trial (the front door's in-flight cap) changes it on the running daemon instead of
restarting: no planner, no restart, the same windows and verdict, a revert that is one call.

The trial's phases and its change are run by its `Experiment` (tune/experiment.py: the planner, the
request, the warm-up, the change's outcomes, keep or revert); the tuner is its `Subject`: it says what
to apply (the proposal), measures the after window and judges it. The second mode, exploration, is
`explorer`'s (started by `explore_triggers`); the proposal is `proposer`'s; the probe is `prober`'s.
Over 400 lines on purpose: the rules, the baseline and the trial's judgement (rules → proposal → trial →
verdict) read in order; its decisions are the policy modules', its memory is `tune.memory`'s, its
machine tune/experiment.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from datetime import datetime
from functools import partial

import structlog

from tunerd.config import Config
from tunerd.config.rules import Rule, RuleSet
from tunerd.core.failures import EngineFailure
from tunerd.core.states import EngineState
from tunerd.engine.process import EngineRun
from tunerd.observe.poller import PollSample
from tunerd.observe.probe import ProbeResult
from tunerd.policy.evidence import Point, WindowStats, signal_values, window_signals, window_stats
from tunerd.policy.fired import Act, Alert, Defer, Facts, Mute, decide
from tunerd.policy.gates import window_open
from tunerd.policy.rules import RuleState, TermValue, eased, evaluate, term_value
from tunerd.policy.tunables import NoProposal, Proposal
from tunerd.policy.verdict import Verdict, judge
from tunerd.records.metrics import Metrics
from tunerd.records.recorder import Recorder
from tunerd.records.state import DaemonState
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.change import ChangeEvent
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.experiment import Experiment, Phase
from tunerd.tune.explore_triggers import ExploreTriggers
from tunerd.tune.explorer import Explorer
from tunerd.tune.memory import TuningMemory
from tunerd.tune.prober import Prober
from tunerd.tune.proposer import Proposer
from tunerd.tune.recall import Recall
from tunerd.tune.trials import LiveKnobs, RunSamples, Trial

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
        knobs: LiveKnobs | None = None,
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
        self.memory = TuningMemory(
            dstate.tuning,
            lambda: self.config.tuning,
            recorder=recorder,
            save_state=save_state,
            wallclock=wallclock,
        )
        self.prober = prober
        self.recall = recall
        self.knobs = knobs
        self.proposer = Proposer(lifecycle, self.memory, knobs, lambda: self.config)
        self.explorer = (
            Explorer(
                lambda: self.config,
                lifecycle,
                prober,
                self.memory,
                recorder=recorder,
                monotonic=lifecycle.monotonic,
                recall=recall,
                on_kept=self._probe_for_baseline,
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
        self._baseline_probed = False  # the first probe baseline was asked for in this daemon run
        self._baseline_waits = False  # ... and journaled as waiting for live traffic to ease
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
        if self.trial is None and not self.exploring:
            self._evaluate_rules(run, now)

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
        self._maybe_record_baseline(now)
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
                if self.trial is not None:
                    return  # one change at a time

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
        return self.proposer.propose(rule, running=before.running_avg)

    def _act(self, rule: Rule, decision: Act, now: float) -> None:
        """Run the decided proposal as a trial (in dry-run: journal it only)."""
        proposal, before = decision.proposal, decision.before
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
                before=before.as_dict(),
                mode="dry-run: nothing changes",
            )
            return
        trial_id = self.memory.next_trial()
        experiment = Experiment(
            self,
            self.life,
            owner="trial",
            ref=trial_id,
            submit=self.submit,
            warmup_s=lambda: self.config.tuning.warmup_s,
            count_restart=self.memory.count_restart,
            on_phase=self._publish_phase,
        )
        self.trial = Trial(trial_id, rule, proposal, before, before_values, experiment)
        if proposal.live:  # no restart, nothing for the planner: the change applies at once
            self._apply_live(self.trial, now)
        else:
            reason = f"rule {rule.name}: {proposal.param} {proposal.old} → {proposal.new}"
            experiment.plan(proposal.params, reason, now)

    # -- the loop's step -----------------------------------------------------------------------------

    def step(self, now: float) -> None:
        """Drive the trial or the exploration in progress (every loop tick)."""
        if self.explorer is not None and self.triggers is not None:
            self.explorer.step(now)
            run = self.life.engine.run
            settled = run is not None and run.ready_mono is not None and self._settled(run, now)
            self.triggers.step(now, settled)
        if self.trial is not None:
            self.trial.experiment.step(now)

    # -- the trial's judge (tune/experiment.py's Subject: its Experiment calls these) ----------------

    def on_refused(self, plan: PlanOutcome, now: float) -> None:
        """The planner refused the change: no restart; the value goes tabu."""
        trial = self._trial()
        p = trial.proposal
        self.rec.record("trial.refused", **trial.describe(), reason=plan.refusal, plan=plan.figures)
        self.memory.add_tabu(p.param, p.new, f"the planner refused it: {plan.refusal}")
        self.metrics.trials.labels(outcome="refused").inc()
        self._end()

    def on_accepted(self, plan: PlanOutcome) -> None:
        trial = self._trial()
        p = trial.proposal
        self.rec.record(
            "trial.started",
            **trial.describe(),
            params_before=self.life.params,
            params_after=p.params,
            notes=list(p.notes),
            before=trial.before.as_dict(),
            plan={k: plan.figures.get(k) for k in ("band", "ratio", "kv_cache_tokens") if k in plan.figures},
        )

    def on_unannounced(self, now: float) -> None:
        trial = self._trial()
        self.rec.record("trial.aborted", **trial.describe(), reason="the restart could not be announced")
        self._end()

    def on_warm(self, now: float) -> None:
        self._trial().window_start = now  # the after window opens

    def on_measuring(self, now: float) -> None:
        """The after window, as long as the before window (longer once extended), then the verdict."""
        trial = self._trial()
        tuning = self.config.tuning
        assert trial.window_start is not None
        length = tuning.window_s + (tuning.max_extend_s if trial.extended else 0.0)
        if now - trial.window_start >= length:
            self._decide(trial, now)

    def on_served(self, now: float) -> None:
        """Not a trial's: a trial never restarts to a best point (FINISHING)."""

    def _trial(self) -> Trial:
        assert self.trial is not None
        return self.trial

    def _apply_live(self, trial: Trial, now: float) -> None:
        """A live knob's trial: the change now, on the running daemon; then warm-up and the after window
        as for any trial."""
        assert self.knobs is not None
        p = trial.proposal
        self.rec.record(
            "trial.started",
            **trial.describe(),
            restart=False,
            notes=list(p.notes),
            before=trial.before.as_dict(),
        )
        knobs, why = self.knobs, f"trial {trial.trial_id} (rule {trial.rule.name})"
        trial.experiment.apply_live(lambda: knobs.set(p.param, p.new, why), now)

    def _decide(self, trial: Trial, now: float) -> None:
        assert trial.window_start is not None
        tuning = self.config.tuning
        after = self._window(trial.window_start, now)
        rule = trial.rule
        if after is None:
            verdict = Verdict("revert", "no evidence: too few samples in the after window")
        else:
            # The rule's window at the end of the after window (never before its start: one run's
            # polls, past the warm-up), as before_values was the rule's window where it fired.
            after_values = self._rule_values(now, not_before=trial.window_start)
            terms_before = self._terms(rule, trial.before_values)
            terms_after = self._terms(rule, after_values)
            verdict = judge(
                trial.before,
                after,
                tuning=tuning,
                purpose=rule.purpose,
                eased=eased(rule, terms_before, terms_after, tuning.tolerance),
                extended=trial.extended,
            )
        if verdict.decision == "extend":
            trial.extended = True
            self.rec.record(
                "trial.extended", **trial.describe(), reason=verdict.reason, by_s=tuning.max_extend_s
            )
            return
        trial.verdict, trial.after = verdict, after
        trial.experiment.decide(now)
        decision = "kept" if verdict.decision == "keep" else "reverted"
        self.rec.record(
            "trial.decided",
            **trial.describe(),
            decision=decision,
            reason=verdict.reason,
            objective=verdict.objective,
            objective_unit=verdict.unit or None,
            objective_before=verdict.before,
            objective_after=verdict.after,
            ratio_interval_90=list(verdict.interval) if verdict.interval else None,
            inconclusive=verdict.inconclusive,
            before=trial.before.as_dict(),
            after=after.as_dict() if after is not None else None,
        )
        log.info("trial.decided", **trial.describe(), decision=decision, reason=verdict.reason)
        if self.recall is not None:
            p = trial.proposal
            self.recall.trial(p.params, p.param, verdict.decision, trial.before, verdict.reason, verdict)
        if verdict.decision == "keep":
            self._kept(trial, after)
            return
        self._lost(trial, f"reverted: {verdict.reason}")
        self.metrics.trials.labels(outcome="reverted").inc()
        if trial.proposal.live:  # back at once, no restart
            assert self.knobs is not None
            p = trial.proposal
            self.knobs.set(p.param, p.old, f"trial {trial.trial_id} reverted")
            self.rec.record("trial.ended", **trial.describe(), outcome="reverted", restart=False)
            self._end()
            return
        reason = f"trial {trial.trial_id} reverted: {verdict.reason}"
        if not trial.experiment.revert(reason, now):
            # Not started (its intent could not be made durable): the trial waits for its change's
            # outcome as a started revert's would (an operator restart or a reload ends it).
            trial.experiment.enter(Phase.REVERTING, now)

    def _kept(self, trial: Trial, after: WindowStats | None) -> None:
        p = trial.proposal
        if not p.live:
            trial.experiment.keep(trial.verdict.reason if trial.verdict else "kept")
        self.memory.kept(trial.trial_id, trial.rule.name, p.param, p.old, p.new)
        if after is not None:
            # The rule's window at the end of the after window: what relative terms will compare with.
            values = self._rule_values(after.end, not_before=after.start)
            self.memory.set_baseline(values, f"trial {trial.trial_id} kept")
            self._probe_for_baseline(f"trial {trial.trial_id} kept")
        self.metrics.trials.labels(outcome="kept").inc()
        self._end()

    def _lost(self, trial: Trial, why: str) -> None:
        """The change lost (reverted or failed): its value goes tabu; a rule that keeps losing is muted."""
        p, rule = trial.proposal, trial.rule
        self.memory.add_tabu(p.param, p.new, why)
        losses = self.memory.lost(rule.name)
        if losses >= self.config.tuning.mute_after_losses:
            self.memory.mute(rule.name, f"{losses} trials in a row lost")

    def _terms(self, rule: Rule, values: Mapping[str, float | None]) -> tuple[TermValue, ...]:
        return tuple(term_value(term, values, self.memory.baseline, False, 0.0) for term in rule.terms)

    def _end(self) -> None:
        """The trial is over (its experiment's phase NONE, exported)."""
        if self.trial is not None:
            self.trial.experiment.end()
        self.trial = None

    def _publish_phase(self, phase: Phase = Phase.NONE) -> None:
        """Export the trial's phase (`tunerd_trial_phase`) and the restart budget left."""
        self.metrics.trial_phase.set(phase)
        self.metrics.restart_budget.set(self.memory.budget().left)

    # -- what became of the change (ChangeEvent, from the loop's queue) -----------------------------

    def _probe_for_baseline(self, why: str) -> None:
        """The probe's figures join the baseline (the 30 % rule works from them where live load is not
        comparable)."""
        if self.prober is None or not self.config.probe.enabled:
            return

        def done(result: ProbeResult | None, _why: str | None) -> None:
            if result is not None and not result.errors:
                self.memory.set_baseline(result.signals(), f"probe: {why}", merge=True)

        self.prober.request(f"baseline: {why}", done)

    def on_change(self, event: ChangeEvent) -> None:
        """The outcome of a change this tuner requested: an exploration's goes to the explorer, a trial's
        is handled here; one about an earlier change (superseded, ended) is ignored."""
        if event.owner != "trial":
            if self.explorer is not None:
                self.explorer.on_change(event)
        elif self.trial is not None:
            self.trial.experiment.on_change(event)

    def on_aborted(self, reason: str) -> None:
        self.rec.record("trial.aborted", **self._trial().describe(), reason=reason)
        self.metrics.trials.labels(outcome="aborted").inc()
        self._end()

    def on_failed(self, failure: EngineFailure, now: float) -> None:
        """Its start or run failed: a loss; the lifecycle reverts at once (its Experiment: REVERTING)."""
        trial = self._trial()
        self.rec.record(
            "trial.decided",
            **trial.describe(),
            decision="failed",
            reason=f"the start with the change failed: {failure.kind}",
            failure=failure.as_dict(),
            before=trial.before.as_dict(),
        )
        self._lost(trial, f"failed: {failure.kind}")
        if self.recall is not None:
            p = trial.proposal
            self.recall.trial(p.params, p.param, "failed", trial.before, f"its start failed: {failure.kind}")
        self.metrics.trials.labels(outcome="failed").inc()

    def on_reverted(self, run: EngineRun | None, failure: EngineFailure | None) -> None:
        trial = self._trial()
        if run is not None:
            self.rec.record("trial.ended", **trial.describe(), outcome="reverted", params=run.params)
        else:
            detail = failure.as_dict() if failure is not None else None
            self.rec.record("trial.ended", **trial.describe(), outcome="revert failed", failure=detail)
        self._end()

    def _first_probe_baseline(self) -> None:
        """The first start's probe baseline, when live traffic is no busier than the periodic probe
        allows (`probe.skip_when_running_above`): a probe competing with a heavy load measures its
        share of the engine, not the engine (journaled once; asked again at the next evaluation)."""
        if self.prober is None or not self.config.probe.enabled:
            return
        busy = self.live.get("requests.running")
        threshold = self.config.probe.skip_when_running_above
        if busy is not None and busy > threshold:
            if not self._baseline_waits:
                self._baseline_waits = True
                self.rec.record(
                    "probe.skipped",
                    trigger="baseline: the first start",
                    reason=f"{busy:g} requests running (probe.skip_when_running_above {threshold:g}): "
                    "the baseline probe waits for live traffic to ease",
                )
            return
        self._baseline_probed = True
        self._probe_for_baseline("the first start")

    def _maybe_record_baseline(self, now: float) -> None:
        """The first baseline: the probe's at once (it needs no live load), the live window's once
        requests are served (an idle engine has no live figures worth comparing with)."""
        baseline = self.memory.baseline
        if "probe.throughput" not in baseline and not self._baseline_probed:
            self._first_probe_baseline()
        if "throughput.generation" in baseline:
            return
        if not self.live.get("requests.completed_rate"):  # settled: the live window is this run's
            return
        self.memory.set_baseline(self._rule_values(now), "first window of serving", merge=True)
