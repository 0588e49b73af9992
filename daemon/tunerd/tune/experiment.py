"""One experiment machine for a rule's trial (tune/trials.py), an exploration's points and a recall
(tune/explorer.py): its phases as one state machine with a transition table, checked like the engine's
(core/states.py), and the `Experiment` that runs them.

    planning → applying (a restart) → warm-up → measuring → decided → (reverting)

`Experiment` owns the mechanics every experiment shares: the phase (every assignment through `check`),
the planner's verdict before a restart (a refusal costs no restart; an accepted plan travels with the
request, so the start's preflight does not ask the planner again: supervise/preflight.py), the request
to the lifecycle's change slot (supervise/change.py) and the restarts it counts, the `ChangeEvent`s that
come back (serving → warm-up; failed → reverting; reverted; aborted), the warm-up clock, the hand-off to
the measurement, and the decision's keep or revert through the slot. Its owner — the `Subject` — says
what to apply, how to measure and how to judge, and is called back at each turn: the rule's trial
(the live window, the verdict, tabu and mutes) and the explorer (a probe, the search, the recall).

`NONE` is no experiment (a trial's or an exploration's end: kept, reverted, refused, aborted). Two
phases are the exploration's own, because only a search has them: `BASELINE`, the probe of the
configuration in force before any change (a measurement with nothing applied: it leads to the first
point's planning, to a recall's restart, or straight to the end), and `FINISHING`, the restart to the
search's best point (an applying that ends the exploration whatever becomes of it, so it has no warm-up
or verdict of its own). `DECIDED` is the moment the verdict is in (a point measured, a change refused
or failed, a trial judged), before the change is kept, reverted or the next point planned: it makes
"what follows a verdict" one row of the table.

The integer values of a trial's phases are exported as `tunerd_trial_phase` and keep the numbers they
had (0 none, 1 planning, 2 applying — "restarting" before —, 3 warm-up, 4 measuring — "evaluating"
before —, 5 reverting); `DECIDED` is set and left within one step, so the gauge never holds 6. The
exploration's phases are shown by name (`tunerd status`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Protocol

from tunerd.core.failures import EngineFailure
from tunerd.core.params import EngineParams
from tunerd.engine.process import EngineRun
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.change import ChangeEvent, Outcome, Owner
from tunerd.supervise.lifecycle import Lifecycle


class Phase(IntEnum):
    """Where an experiment is. A trial's value is exported as `tunerd_trial_phase`."""

    NONE = 0  # no experiment
    PLANNING = 1  # the planner is asked whether the change fits (a refusal costs no restart)
    APPLYING = 2  # intent journaled; vLLM restarting with the change
    WARMUP = 3  # serving; the first seconds are skipped (compile and cache warm-up)
    MEASURING = 4  # the after window (a trial), the probe of the point (an exploration)
    REVERTING = 5  # the change lost or its start failed: vLLM restarting with the parameters before
    DECIDED = 6  # the verdict is in: keep, revert, or the exploration's next point
    BASELINE = 7  # an exploration probes the configuration in force, before any change
    FINISHING = 8  # an exploration restarts with its best point


# Which changes are legal. Every phase assignment goes through `check`, which reads this table.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.NONE: frozenset({Phase.PLANNING, Phase.BASELINE}),
    # BASELINE → APPLYING: a recall restarts with the one configuration, nothing to plan; → FINISHING:
    # no point to measure (all known) and the best known is not in force.
    Phase.BASELINE: frozenset({Phase.PLANNING, Phase.APPLYING, Phase.FINISHING, Phase.NONE}),
    # PLANNING → DECIDED: the planner refused the change (no restart); → NONE: its restart could not be
    # announced.
    Phase.PLANNING: frozenset({Phase.APPLYING, Phase.DECIDED, Phase.NONE}),
    # → REVERTING: the start with the change failed (or its run crashed) and the lifecycle reverts at once.
    Phase.APPLYING: frozenset({Phase.WARMUP, Phase.REVERTING, Phase.NONE}),
    Phase.WARMUP: frozenset({Phase.MEASURING, Phase.REVERTING, Phase.NONE}),
    Phase.MEASURING: frozenset({Phase.DECIDED, Phase.REVERTING, Phase.NONE}),
    # → PLANNING | FINISHING: an exploration's next point, or its best; → APPLYING: a trial's next start of
    # a comparison over several starts a side (both sides planned already); → NONE: kept (or refused).
    Phase.DECIDED: frozenset({Phase.PLANNING, Phase.APPLYING, Phase.FINISHING, Phase.REVERTING, Phase.NONE}),
    # An exploration goes on after a failed point's revert; a trial's revert ends it.
    Phase.REVERTING: frozenset({Phase.PLANNING, Phase.FINISHING, Phase.NONE}),
    Phase.FINISHING: frozenset({Phase.NONE}),
}


class InvalidPhase(RuntimeError):
    """Raised when code asks for a phase change the table above does not allow (a bug, not a fault)."""


def check(old: Phase, new: Phase) -> Phase:
    """`new`, unless `old -> new` is not in TRANSITIONS: then raise InvalidPhase."""
    if new not in TRANSITIONS[old]:
        raise InvalidPhase(f"experiment phase {old.name} -> {new.name} is not allowed")
    return new


class Subject(Protocol):
    """An experiment's owner, called back by its `Experiment` at each turn (tune/trials.py's trial,
    tune/explorer.py's exploration). Each call may end the experiment (`Experiment.end`) or move it on
    (`plan`, `apply`, `decide`, `keep`, `revert`); what the owner journals is its own."""

    def on_refused(self, plan: PlanOutcome, now: float) -> None:
        """The planner refused the change: nothing was stopped. The phase is DECIDED."""

    def on_accepted(self, plan: PlanOutcome) -> None:
        """The planner accepted the change; its request to the lifecycle follows at once."""

    def on_unannounced(self, now: float) -> None:
        """The accepted change's restart could not be announced (journal unwritable, vLLM not serving):
        nothing changed. The phase is still PLANNING."""

    def on_warm(self, now: float) -> None:
        """The warm-up is over and the phase is MEASURING: the measurement begins."""

    def on_measuring(self, now: float) -> None:
        """A step while MEASURING (the change's outcome not pending): once the evidence is in, `decide`
        and then `keep` or `revert` (or plan the next change)."""

    def on_served(self, now: float) -> None:
        """A FINISHING change serves (an exploration's best point)."""

    def on_failed(self, failure: EngineFailure, now: float) -> None:
        """The change's start or run failed: the lifecycle reverts at once (the phase is REVERTING,
        counted as a restart), or, while FINISHING, the experiment should end."""

    def on_reverted(self, run: EngineRun | None, failure: EngineFailure | None) -> None:
        """The parameters before serve again (`run`), or their start failed (`failure`)."""

    def on_aborted(self, reason: str) -> None:
        """Something superseded the change (operator restart, reload, resume): it is over."""


class Experiment:
    """One experiment — a trial, or an exploration with its points — from its first phase to NONE.

    Driven by its owner: `step` every loop tick, `on_change` with each `ChangeEvent` the loop delivers.
    At most one change is in flight (`change_id`); `restarts` counts those it caused (each also counted
    against the tuning budget by `count_restart`)."""

    def __init__(
        self,
        subject: Subject,
        lifecycle: Lifecycle,
        *,
        owner: Owner,
        ref: int,
        submit: Callable[[Callable[[], PlanOutcome]], Future[PlanOutcome]],
        warmup_s: Callable[[], float],
        count_restart: Callable[[], None],
        on_phase: Callable[[Phase], None] = lambda phase: None,
    ) -> None:
        self.subject = subject
        self.life = lifecycle
        self.owner = owner
        self.ref = ref  # the owner's number in the journal (a trial's, an exploration's)
        self.submit = submit  # the planner's check runs as a worker job (it reads the model, /proc)
        self.warmup_s = warmup_s
        self.count_restart = count_restart
        self.on_phase = on_phase  # the phase changed (a trial exports its)
        self.phase = Phase.NONE
        self.since = 0.0  # monotonic: when the phase began
        self.change_id: int | None = None  # the lifecycle's change in flight, once requested
        self.restarts = 0
        self._plan: Future[PlanOutcome] | None = None
        self._planned: tuple[EngineParams, str] | None = None  # what the plan is for, and why

    def enter(self, phase: Phase, now: float) -> None:
        """The next phase, checked against the table (the owner's own: BASELINE)."""
        self.phase, self.since = check(self.phase, phase), now
        self.on_phase(phase)

    def end(self) -> None:
        """The experiment is over (phase NONE)."""
        self.phase = check(self.phase, Phase.NONE)
        self.on_phase(Phase.NONE)

    @property
    def outcome_pending(self) -> bool:
        """Its change ended in the lifecycle (aborted, reverted) and the outcome is on the loop's queue:
        nothing is decided about it until it arrives."""
        return self.change_id is not None and not self.life.slot.holds(self.change_id)

    # -- planning and applying -------------------------------------------------------------------

    def plan(self, params: EngineParams, reason: str, now: float) -> None:
        """Ask the planner whether `params` fit (a worker job); applied with `reason` when they do."""
        check_fit = self.life.capacity.check
        self._plan = self.submit(lambda: check_fit(params))
        self._planned = (params, reason)
        self.enter(Phase.PLANNING, now)

    def _on_plan(self, now: float) -> None:
        assert self._plan is not None and self._planned is not None
        try:
            outcome = self._plan.result()
        except Exception as exc:  # the planner is advice: a bug in it does not stop the experiment
            outcome = PlanOutcome(None, {"planner": f"no plan: {type(exc).__name__}: {exc}"})
        (params, reason), self._plan, self._planned = self._planned, None, None
        if outcome.refusal is not None:
            self.decide(now)
            self.subject.on_refused(outcome, now)
            return
        self.subject.on_accepted(outcome)
        if not self.apply(params, reason, now, plan=outcome):
            self.subject.on_unannounced(now)

    def apply(
        self,
        params: EngineParams,
        reason: str,
        now: float,
        *,
        plan: PlanOutcome | None = None,
        phase: Phase = Phase.APPLYING,
        revert_to: EngineParams | None = None,
    ) -> bool:
        """Restart with `params` as this experiment's change (phase `phase`: APPLYING, or FINISHING for
        an exploration's best point), with the planner's outcome when it was asked; a revert restarts
        with `revert_to` (default: the parameters in force). False, nothing done, when the restart
        could not be announced."""
        self.change_id = self.life.request(params, reason, self.owner, self.ref, plan, revert_to)
        if self.change_id is None:
            return False
        self._restarted()
        self.enter(phase, now)
        return True

    def _restarted(self) -> None:
        self.restarts += 1
        self.count_restart()

    # -- the loop's step ---------------------------------------------------------------------------

    def step(self, now: float) -> None:
        """Planning done → refused or applied; warm-up over → measuring; measuring → the owner's look."""
        if self.outcome_pending:
            return
        if self.phase is Phase.PLANNING and self._plan is not None and self._plan.done():
            self._on_plan(now)
        elif self.phase is Phase.WARMUP and now - self.since >= self.warmup_s():
            self.enter(Phase.MEASURING, now)
            self.subject.on_warm(now)
        elif self.phase is Phase.MEASURING:
            self.subject.on_measuring(now)

    @property
    def measuring(self) -> bool:
        """Measuring, and its change still in flight (a probe's result may be used)."""
        return self.phase is Phase.MEASURING and not self.outcome_pending

    # -- the decision ------------------------------------------------------------------------------

    def decide(self, now: float) -> None:
        """The verdict is in (DECIDED): `keep`, `revert`, plan the next change, or `end`."""
        self.enter(Phase.DECIDED, now)

    def keep(self, reason: str, *, promote: bool = True) -> bool:
        """Keep the change in flight: its parameters stay in force (and, with `promote`, become
        last-known-good). False when none is in flight."""
        if self.change_id is None:
            return False
        kept = self.life.slot.end(self.change_id, keep=True, reason=reason, promote=promote)
        if kept:
            self.change_id = None  # nothing of it is in flight any more
        return kept

    def revert(self, reason: str, now: float) -> bool:
        """Revert the change in flight: a restart with the parameters before (REVERTING, counted); the
        outcome (`on_reverted`) follows when they serve. False when it could not be started."""
        if self.change_id is None or not self.life.slot.end(self.change_id, keep=False, reason=reason):
            return False
        self._restarted()
        self.enter(Phase.REVERTING, now)
        return True

    # -- what became of the change (ChangeEvent, from the loop's queue) ----------------------------

    def on_change(self, event: ChangeEvent) -> bool:
        """The outcome of this experiment's change, handed to the owner; False (ignored) when it is
        about another change (superseded, ended)."""
        if self.change_id is None or event.change_id != self.change_id:
            return False
        if event.outcome in (Outcome.REVERTED, Outcome.ABORTED):
            self.change_id = None  # the change is over
        if event.outcome is Outcome.SERVING:
            if self.phase is Phase.APPLYING:
                self.enter(Phase.WARMUP, event.at)
            elif self.phase is Phase.FINISHING:
                self.subject.on_served(event.at)
        elif event.outcome is Outcome.FAILED:
            assert event.failure is not None
            if self.phase is not Phase.FINISHING:
                self._restarted()  # the revert the lifecycle started at once
                self.enter(Phase.REVERTING, event.at)
            self.subject.on_failed(event.failure, event.at)
        elif event.outcome is Outcome.REVERTED:
            self.subject.on_reverted(event.run, event.failure)
        else:
            self.subject.on_aborted(event.reason)
        return True
