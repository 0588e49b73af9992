"""The lifecycle's side of a tuning trial: the narrow interface the tuner drives (tune/tuner.py).

`TrialHost` is mixed into `Lifecycle`: a trial is a planned restart through the normal start path
(preflight, memory gate, planner, drain), and while it runs the lifecycle treats it apart: no promotion
of its parameters by time (only the tuner's decision promotes), and a failure of its start or run
reverts at once instead of retrying. The tuner learns outcomes as the lifecycle's `TrialListener`.
Anything that supersedes a trial (an operator restart, a config reload) ends it, journaled as aborted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tunerd.core.failures import EngineFailure
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.engine.process import EngineRun

if TYPE_CHECKING:
    from tunerd.supervise.lifecycle import Lifecycle


@dataclass
class TrialContext:
    """The trial the tuner runs through this lifecycle: its parameters and those to revert to."""

    trial_id: int
    params: EngineParams
    before: EngineParams
    reverting: bool = False


class TrialListener(Protocol):
    """What the tuner learns from the lifecycle about the trial it started (tune/tuner.py)."""

    def trial_serving(self, run: EngineRun, now: float) -> None: ...

    def trial_failed(self, failure: EngineFailure) -> None: ...

    def trial_reverted(self, run: EngineRun | None, failure: EngineFailure | None) -> None: ...

    def trial_aborted(self, reason: str) -> None: ...


class TrialHost:
    """Trial support for `Lifecycle` (which provides the engine, the parameters and the restarts)."""

    trial: TrialContext | None = None
    trial_listener: TrialListener | None = None
    hold_promotion: bool = False  # an exploration between its points: nothing is promoted by time

    def start_trial(self: Lifecycle, trial_id: int, params: EngineParams, reason: str) -> bool:
        """Restart a serving engine with `params` as trial `trial_id`, through the normal start path.
        False (nothing done) unless the engine serves and no trial runs, or when the intent could not be
        made durable. From now on: no promotion by time; a failure of the trial's start or run reverts
        at once, without retries (the listener hears `trial_failed`, then `trial_reverted`)."""
        if self.trial is not None or self.engine.state is not EngineState.RUNNING or self.shutting_down:
            return False
        before = self.params
        if not self._planned_restart(params, "trial", reason, trial=trial_id):
            return False
        self.trial = TrialContext(trial_id, params, before)
        return True

    def end_trial(self: Lifecycle, *, keep: bool, reason: str, promote: bool = True) -> bool:
        """The tuner's decision. Keep: the trial ends, its parameters stay in force and, with `promote`,
        become last-known-good (an exploration keeps its points in force without promoting them).
        Revert: a restart with the parameters before (action "revert"); the trial ends when they serve
        again (`trial_reverted`)."""
        ctx = self.trial
        if ctx is None or ctx.reverting:
            return False
        if keep:
            self.trial = None
            if promote:
                self.promote(ctx.params, f"trial {ctx.trial_id} kept")
            return True
        ctx.reverting = True
        return self._planned_restart(ctx.before, "revert", reason, trial=ctx.trial_id)

    def _trial_run_ready(self: Lifecycle, run: EngineRun, now: float) -> None:
        ctx, listener = self.trial, self.trial_listener
        if ctx is None or listener is None:
            return
        if ctx.reverting and run.params == ctx.before:
            self.trial = None
            listener.trial_reverted(run, None)
        elif not ctx.reverting and run.params == ctx.params:
            listener.trial_serving(run, now)

    def _trial_failed(self: Lifecycle, failure: EngineFailure) -> bool:
        """A failure while a trial runs. The trial's own start or run: revert at once (True: handled).
        The revert's: the trial ends, and the normal policy (backoff, rollback, FATAL) takes over."""
        ctx, listener = self.trial, self.trial_listener
        if ctx is None:
            return False
        if ctx.reverting:
            self.trial = None
            if listener is not None:
                listener.trial_reverted(None, failure)
            return False
        ctx.reverting = True
        self.failures = 0
        if listener is not None:
            listener.trial_failed(failure)
        reason = f"trial {ctx.trial_id} failed ({failure.kind}): back to the parameters before"
        if self.schedule_start(
            ctx.before, "revert", reason, 0.0, trial=ctx.trial_id, after=str(failure.kind)
        ):
            return True
        self.trial = None  # the revert could not be journaled: the normal policy takes over
        if listener is not None:
            listener.trial_reverted(None, failure)
        return False

    def _abort_trial(self: Lifecycle, reason: str) -> None:
        ctx, listener = self.trial, self.trial_listener
        if ctx is None:
            return
        self.trial = None
        if listener is not None:
            listener.trial_aborted(reason)
