"""A rule's trial: the tuner's one change (tune/tuner.py), judged on like-with-like live evidence.

A `Trial` is the `Subject` of its `Experiment` (tune/experiment.py), which runs the phases and the
change (the planner, the request, the warm-up, the outcomes, keep or revert). The trial says what to
apply — the proposal, by a restart —, measures the *after* window of the change's run only, and judges
it by the objective in force (policy/verdict.py: goodput with its targets and the door, else throughput,
`objective_reason` saying why) on the evidence of both windows: while it cannot tell, the after window
doubles (`Windows`: `[tuning] window_s`, then twice that, ... up to `max_extend_s` more in all) and the
before window grows with it, as far back as the run before the change served past its warm-up (the
same run's polls; the tuner's `before_for`), so that the evidence on both sides grows together.
When the spread between vLLM starts is the larger part of a straddling ratio's noise (no window removes
it: `[tuning] start_noise`, docs/noise.md), the trial compares over more starts a side instead, up to
`[tuning] max_starts`: it restarts to the configuration before and measures a window, restarts to the
change again and measures a window, and judges every start of both sides together (policy/weigh.py);
each such start is an applying of this same experiment (the change left un-promoted in between), and the
verdict is always taken with the change in force, so keep and revert stay what they were.
Kept (the parameters become
last-known-good and the new baseline) or reverted (the value goes tabu; a rule that keeps losing is
muted). It tells
its story in the journal: `trial.refused`, `trial.started`, `trial.extended`, `trial.decided`,
`trial.ended`, `trial.aborted`. Over 400 lines: one trial's judge — its windows, their extensions, the
starts a side and what a verdict does — is one story, read in the order it happens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import structlog

from tunerd.config import Config
from tunerd.config.rules import Rule
from tunerd.core.failures import EngineFailure
from tunerd.core.params import EngineParams
from tunerd.engine.process import EngineRun
from tunerd.policy.evidence import Point, WindowStats
from tunerd.policy.rules import TermValue, eased, term_value
from tunerd.policy.tunables import Proposal
from tunerd.policy.verdict import Verdict, judge
from tunerd.records.metrics import Metrics
from tunerd.records.recorder import Recorder
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.experiment import Experiment, Phase
from tunerd.tune.memory import TuningMemory
from tunerd.tune.recall import Recall

log = structlog.get_logger("tunerd")


# The starts a side at which a comparison over several starts looks at its evidence: √2 apart (1, 2, 3, 4,
# 6, 8, 11, 16, 23, 32, 45, 64), as the window doubles in length.
_LOOKS = frozenset(round(2 ** (i / 2)) for i in range(13))


@dataclass(frozen=True)
class Windows:
    """A trial's window length and its extension budget (pure): the first window is `window_s`; each
    extension doubles it (the evidence of a mean grows as √length: doubling buys as much at each look,
    and the few looks keep the chance of a keep on noise near the interval's own), until `max_extend_s`
    more in all are spent."""

    window_s: float
    max_extend_s: float
    extended_s: float = 0.0
    extensions: int = 0
    starts: int = 1  # vLLM starts a side measured so far (a comparison over several: `another_start`)
    max_starts: int = 1  # `[tuning] max_starts`

    @property
    def length(self) -> float:
        return self.window_s + self.extended_s

    @property
    def spent(self) -> bool:
        """No extension is left: the next verdict is final."""
        return self.extended_s >= self.max_extend_s

    def extend(self) -> Windows:
        """The window doubled (capped by the budget left)."""
        step = min(self.length, self.max_extend_s - self.extended_s)
        return replace(self, extended_s=self.extended_s + max(step, 0.0), extensions=self.extensions + 1)

    @property
    def starts_left(self) -> bool:
        """Another vLLM start a side may be spent."""
        return self.starts < self.max_starts

    @property
    def look_due(self) -> bool:
        """The evidence is looked at when the starts a side reach one of `_LOOKS` or `max_starts`: like the
        window's doubling, few looks keep the chance of a keep on noise near the interval's own. Simulated
        at a 7 % spread between starts (tests/unit/test_verdict_noise.py's model, 200 trials): a look at
        every start kept a true +2.5 % in 5.0 %, looks √2 apart in 3.5 %, looks 2× apart in 2.0 % but
        needed a median of 16 starts a side against 8-11 to find +10 %."""
        return self.starts in _LOOKS or self.starts >= self.max_starts

    def another_start(self) -> Windows:
        """One more start a side, each measured in a window of the length reached: the window stops
        growing once starts are added (the spread between starts is then the larger part)."""
        return replace(self, starts=self.starts + 1, max_extend_s=self.extended_s)


def judge_windows(
    windows: Windows,
    before: WindowStats,
    after: WindowStats | None,
    judge_with: Callable[[WindowStats, WindowStats, Windows], Verdict],
) -> Verdict:
    """One look at a trial's evidence: `judge_with(before, after, windows)` (policy/verdict.judge with
    the trial's settings, `windows.spent` its budget_spent and `windows.starts_left` its starts_left) on
    the latest windows of `windows.length`, when a look is due (`Windows.look_due`; else another start a
    side, unjudged); no after window: no evidence. A verdict "extend" asks for
    `windows.extend()` and another look, or (`Verdict.more` "start", while `windows.starts_left`)
    `windows.another_start()` and a start of each side (the trial's loop; the unit tier's simulation
    runs this same loop, tests/unit/test_verdict_noise.py)."""
    if after is None:
        return Verdict("revert", "no evidence: too few samples in the after window")
    if not windows.look_due:
        nxt = min(min(n for n in _LOOKS if n > windows.starts), windows.max_starts)
        return Verdict("extend", f"another vLLM start a side: the next look at {nxt} a side", more="start")
    return judge_with(before, after, windows)


def spent_figures(windows: Windows, before: WindowStats, after: WindowStats | None) -> dict[str, object]:
    """The windows a verdict spent, for `trial.decided`."""
    return {
        "extensions": windows.extensions,
        "extended_s": round(windows.extended_s, 1),
        "window_s": round(windows.length, 1),
        "before_s": round(before.seconds, 1),
        "after_s": round(after.seconds, 1) if after is not None else None,
        "starts_a_side": windows.starts,
    }


@dataclass(frozen=True)
class TrialContext:
    """What every trial of one tuner reads and tells (built once by the tuner)."""

    config: Callable[[], Config]
    lifecycle: Lifecycle
    recorder: Recorder
    memory: TuningMemory
    metrics: Metrics
    submit: Callable[[Callable[[], PlanOutcome]], Future[PlanOutcome]]
    window: Callable[[float, float], WindowStats | None]  # the serving run's window [start, end]
    # The rules' window ending at the last poll at or before `end`, not before `not_before`.
    rule_values: Callable[[float, float], dict[str, float | None]]
    on_kept: Callable[[str], None]  # a change was kept: the probe's figures join the new baseline
    recall: Recall | None = None


class Trial:
    """One rule's trial, from its planning to its end (`over`)."""

    def __init__(
        self,
        ctx: TrialContext,
        trial_id: int,
        rule: Rule,
        proposal: Proposal,
        before: WindowStats,
        before_values: dict[str, float | None],
        before_for: Callable[[float], WindowStats | None] | None = None,
    ) -> None:
        """`before`: the window the rule fired on; `before_for(length)`: the run's window of `length`
        ending where the rule fired (its settled polls only; None: `before` whatever the length)."""
        self.ctx = ctx
        self.trial_id = trial_id
        self.rule = rule
        self.proposal = proposal
        self.before = before
        self.before_values = before_values  # the rule's window where it fired
        self.before_for = before_for
        self.window_start: float | None = None
        self.windows = self._windows()
        # A comparison over several vLLM starts a side (`[tuning] max_starts`): the side the running start
        # measures, the configuration before the change (what its starts restart to), the windows of the
        # earlier starts of each side, and the latest start's window of the configuration before.
        self.leg: Literal["after", "before"] = "after"
        self.params_before = ctx.lifecycle.params
        self.earlier: tuple[list[WindowStats], list[WindowStats]] = ([], [])
        self.before_start: WindowStats | None = None
        self.verdict: Verdict | None = None
        self.after: WindowStats | None = None
        self.experiment = Experiment(
            self,
            ctx.lifecycle,
            owner="trial",
            ref=trial_id,
            submit=ctx.submit,
            warmup_s=lambda: ctx.config().tuning.warmup_s,
            count_restart=ctx.memory.count_restart,
            on_phase=self._publish_phase,
        )
        self.over = False

    @property
    def phase(self) -> Phase:
        return self.experiment.phase

    @property
    def phase_since(self) -> float:
        return self.experiment.since

    def describe(self) -> dict[str, Any]:
        p = self.proposal
        return {"trial": self.trial_id, "rule": self.rule.name, "param": p.param, "old": p.old, "new": p.new}

    def start(self, now: float) -> None:
        """The change is planned first (a refusal costs no restart), then applied by a restart."""
        p = self.proposal
        self.experiment.plan(p.params, f"rule {self.rule.name}: {p.param} {p.old} → {p.new}", now)

    # -- tune/experiment.py's Subject: its Experiment calls these -----------------------------------

    def on_refused(self, plan: PlanOutcome, now: float) -> None:
        """The planner refused the change: no restart; the value goes tabu."""
        p = self.proposal
        self.ctx.recorder.record("trial.refused", **self.describe(), reason=plan.refusal, plan=plan.figures)
        self.ctx.memory.add_tabu(p.param, p.new, f"the planner refused it: {plan.refusal}")
        self._count("refused")
        self._end()

    def on_accepted(self, plan: PlanOutcome) -> None:
        p = self.proposal
        self.ctx.recorder.record(
            "trial.started",
            **self.describe(),
            params_before=self.ctx.lifecycle.params,
            params_after=p.params,
            notes=list(p.notes),
            proposed_by=p.proposed_by,  # "kv model", "rule step", "fleet" (issue 22)
            arithmetic=p.arithmetic,
            before=self.before.as_dict(),
            plan={k: plan.figures.get(k) for k in ("band", "ratio", "kv_cache_tokens") if k in plan.figures},
        )

    def on_unannounced(self, now: float) -> None:
        self.ctx.recorder.record(
            "trial.aborted", **self.describe(), reason="the restart could not be announced"
        )
        self._end()

    def on_warm(self, now: float) -> None:
        self.window_start = now  # the after window (or a later start's window of either side) opens
        if self.windows.starts == 1:
            self.windows = self._windows()  # the settings in force when it opens (a reload: the next trial)

    def _windows(self) -> Windows:
        tuning = self.ctx.config().tuning
        return Windows(tuning.window_s, tuning.max_extend_s, max_starts=tuning.max_starts)

    def on_measuring(self, now: float) -> None:
        """The window of `windows.length` (doubled at each extension), then a look at the evidence, or,
        on a start of the configuration before, the restart to the change again."""
        assert self.window_start is not None
        if now - self.window_start < self.windows.length:
            return
        if self.leg == "before":
            self._before_measured(now)
        else:
            self._decide(now)

    def on_served(self, now: float) -> None:
        """Not a trial's: a trial never restarts to a best point (FINISHING)."""

    def on_failed(self, failure: EngineFailure, now: float) -> None:
        """Its start or run failed: a loss; the lifecycle reverts at once (its Experiment: REVERTING). A
        start of the configuration before that fails during a comparison over several starts is not the
        change's loss: the trial is aborted (the lifecycle restarts the configuration before)."""
        if self.leg == "before":
            self.ctx.recorder.record(
                "trial.aborted",
                **self.describe(),
                reason=f"the configuration before failed to start during the comparison: {failure.kind}",
                failure=failure.as_dict(),
            )
            self._count("aborted")
            return  # on_reverted ends it
        self.ctx.recorder.record(
            "trial.decided",
            **self.describe(),
            decision="failed",
            reason=f"the start with the change failed: {failure.kind}",
            failure=failure.as_dict(),
            before=self.before.as_dict(),
        )
        self._lost(f"failed: {failure.kind}")
        if self.ctx.recall is not None:
            p = self.proposal
            self.ctx.recall.trial(
                p.params, p.param, "failed", self.before, f"its start failed: {failure.kind}", old=p.old
            )
        self._count("failed")

    def on_reverted(self, run: EngineRun | None, failure: EngineFailure | None) -> None:
        if run is not None:
            self.ctx.recorder.record("trial.ended", **self.describe(), outcome="reverted", params=run.params)
        else:
            detail = failure.as_dict() if failure is not None else None
            self.ctx.recorder.record(
                "trial.ended", **self.describe(), outcome="revert failed", failure=detail
            )
        self._end()

    def on_aborted(self, reason: str) -> None:
        self.ctx.recorder.record("trial.aborted", **self.describe(), reason=reason)
        self._count("aborted")
        self._end()

    # -- the verdict ---------------------------------------------------------------------------------

    def _decide(self, now: float) -> None:
        assert self.window_start is not None
        ctx, rule, windows = self.ctx, self.rule, self.windows
        config = ctx.config()
        tuning = config.tuning
        after = ctx.window(self.window_start, now)
        before = self.before_start or self._before(windows.length)
        # Another start a side costs two restarts: with fewer left in the budget, this look has no start left.
        looked = windows if ctx.memory.budget().left >= 2 else replace(windows, max_starts=windows.starts)

        def judge_with(b: WindowStats, a: WindowStats, w: Windows) -> Verdict:
            # The rule's window at the end of the after window (never before its start: one run's
            # polls, past the warm-up), as before_values was the rule's window where it fired.
            after_values = ctx.rule_values(now, self.window_start or now)
            terms_before = self._terms(rule, self.before_values)
            terms_after = self._terms(rule, after_values)
            return judge(
                b,
                a,
                tuning=tuning,
                purpose=rule.purpose,
                eased=eased(rule, terms_before, terms_after, tuning.tolerance),
                budget_spent=w.spent,
                objective=config.objective,
                door_enabled=config.door.enabled,
                earlier=(tuple(self.earlier[0]), tuple(self.earlier[1])),
                starts_left=w.starts_left,
            )

        verdict = judge_windows(looked, before, after, judge_with)
        if verdict.decision == "extend" and verdict.more == "start" and after is not None:
            self._another_start(verdict, before, after, now)
            return
        if verdict.decision == "extend":
            self.windows = windows.extend()
            ctx.recorder.record(
                "trial.extended",
                **self.describe(),
                reason=verdict.reason,
                by="window",
                by_s=round(self.windows.extended_s - windows.extended_s, 1),
                window_s=round(self.windows.length, 1),
                budget_left_s=round(self.windows.max_extend_s - self.windows.extended_s, 1),
                evidence=dict(verdict.figures) or None,
            )
            return
        self.verdict, self.after = verdict, after
        self.experiment.decide(now)
        decision = "kept" if verdict.decision == "keep" else "reverted"
        ctx.recorder.record(
            "trial.decided",
            **self.describe(),
            decision=decision,
            reason=verdict.reason,
            evidence=verdict.evidence,
            objective=verdict.objective,
            objective_unit=verdict.unit or None,
            objective_before=verdict.before,
            objective_after=verdict.after,
            # Why the objective compared is not the configured one (goodput without targets or the door).
            objective_reason=verdict.objective_reason or None,
            ratio_interval=[round(x, 4) for x in verdict.interval] if verdict.interval else None,
            confidence=tuning.confidence,
            inconclusive=verdict.inconclusive,
            # the samples (n, effective n), each window's noise and the minimum detectable effect they
            # implied, the attainment's intervals (goodput), saturation
            figures={k: v for k, v in verdict.figures.items() if k not in ("ratio_interval", "confidence")},
            windows=spent_figures(windows, before, after),
            **verdict.service,  # both windows' attainment, goodput, feasibility and requests
            before=before.as_dict(),
            after=after.as_dict() if after is not None else None,
        )
        log.info("trial.decided", **self.describe(), decision=decision, reason=verdict.reason)
        p = self.proposal
        if ctx.recall is not None:
            ctx.recall.trial(
                p.params, p.param, verdict.decision, self.before, verdict.reason, verdict, old=p.old
            )
        if verdict.decision == "keep":
            self._kept(after)
        else:
            self._reverted(verdict, now)

    def _another_start(self, verdict: Verdict, before: WindowStats, after: WindowStats, now: float) -> None:
        """The spread between starts hides the answer: one more start of each side, the configuration
        before first (the change is left un-promoted; its parameters were measured), then the change
        again, a window each (`Windows.another_start`), and another look over all the starts."""
        self.earlier[0].append(before)
        self.earlier[1].append(after)
        self.windows = self.windows.another_start()
        self.before_start = None
        windows = self.windows
        self.ctx.recorder.record(
            "trial.extended",
            **self.describe(),
            reason=verdict.reason,
            by="start",
            starts_a_side=windows.starts,
            max_starts=windows.max_starts,
            window_s=round(windows.length, 1),
            evidence=dict(verdict.figures) or None,
        )
        self.experiment.decide(now)
        self.experiment.keep(f"trial {self.trial_id}: measured; the configuration before next", promote=False)
        self.leg = "before"
        what = (
            f"trial {self.trial_id}: the configuration before, start {windows.starts} of {windows.max_starts}"
        )
        self._apply(self.params_before, what, now)

    def _before_measured(self, now: float) -> None:
        """A start of the configuration before is measured: the change again (a restart), or, without
        evidence of this start, the end (the configuration before serves: the change is not kept)."""
        assert self.window_start is not None
        window = self.ctx.window(self.window_start, now)
        self.experiment.decide(now)
        self.experiment.keep(f"trial {self.trial_id}: the configuration before measured", promote=False)
        if window is None:
            reason = "no evidence: too few samples in the window of the configuration before"
            self.ctx.recorder.record("trial.decided", **self.describe(), decision="reverted", reason=reason)
            self._lost(f"reverted: {reason}")
            self._count("reverted")
            self._end()
            return
        self.before_start, self.leg = window, "after"
        p, windows = self.proposal, self.windows
        of = f"start {windows.starts} of {windows.max_starts}"
        self._apply(p.params, f"rule {self.rule.name}: {p.param} {p.old} → {p.new}, {of}", now)

    def _apply(self, params: EngineParams, reason: str, now: float) -> None:
        """Restart with `params` for the comparison's next start, a failure of which reverts to the
        configuration before the change (whichever side serves now); when the restart cannot be announced
        (the journal unwritable, vLLM not serving), the trial is aborted where it stands."""
        if not self.experiment.apply(params, reason, now, revert_to=self.params_before):
            self.ctx.recorder.record(
                "trial.aborted",
                **self.describe(),
                reason="the restart for another start could not be announced",
            )
            self._count("aborted")
            self._end()

    def _before(self, length: float) -> WindowStats:
        """The before window as long as the after window, where the run before the change served that
        long past its warm-up; else as long as it served (never shorter than the window the rule fired on)."""
        if self.before_for is None or length <= self.before.seconds:
            return self.before
        longer = self.before_for(length)
        return longer if longer is not None and longer.seconds > self.before.seconds else self.before

    def _kept(self, after: WindowStats | None) -> None:
        ctx, p = self.ctx, self.proposal
        self.experiment.keep(self.verdict.reason if self.verdict else "kept")
        ctx.memory.kept(self.trial_id, self.rule.name, p.param, p.old, p.new)
        if after is not None:
            # The rule's window at the end of the after window: what relative terms will compare with.
            values = ctx.rule_values(after.end, after.start)
            ctx.memory.set_baseline(values, f"trial {self.trial_id} kept")
            ctx.on_kept(f"trial {self.trial_id} kept")
        self._count("kept")
        self._end()

    def _reverted(self, verdict: Verdict, now: float) -> None:
        self._lost(f"reverted: {verdict.reason}")
        self._count("reverted")
        if not self.experiment.revert(f"trial {self.trial_id} reverted: {verdict.reason}", now):
            # Not started (its intent could not be made durable): the trial waits for its change's
            # outcome as a started revert's would (an operator restart or a reload ends it).
            self.experiment.enter(Phase.REVERTING, now)

    def _lost(self, why: str) -> None:
        """The change lost (reverted or failed): its value goes tabu; a rule that keeps losing is muted."""
        memory, p = self.ctx.memory, self.proposal
        memory.add_tabu(p.param, p.new, why)
        losses = memory.lost(self.rule.name)
        if losses >= self.ctx.config().tuning.mute_after_losses:
            memory.mute(self.rule.name, f"{losses} trials in a row lost")

    def _terms(self, rule: Rule, values: Mapping[str, float | None]) -> tuple[TermValue, ...]:
        baseline = self.ctx.memory.baseline
        return tuple(term_value(term, values, baseline, False, 0.0) for term in rule.terms)

    def _count(self, outcome: str) -> None:
        self.ctx.metrics.trials.labels(outcome=outcome).inc()

    def _end(self) -> None:
        """The trial is over: its experiment's phase is NONE (exported); the tuner lets it go."""
        self.experiment.end()
        self.over = True

    def _publish_phase(self, phase: Phase) -> None:
        """Export the trial's phase (`tunerd_trial_phase`) and the restart budget left."""
        self.ctx.metrics.trial_phase.set(phase)
        self.ctx.metrics.restart_budget.set(self.ctx.memory.budget().left)


@dataclass
class RunSamples:
    """The per-poll samples of the serving run (a trial's windows never straddle a restart)."""

    run_id: int | None = None
    points: deque[Point] = field(default_factory=deque)
