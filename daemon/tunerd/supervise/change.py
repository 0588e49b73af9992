"""The change slot: the one owner of "a change of parameters is in flight" on the engine.

A tuning owner (a rule's trial, an exploration's point, a recall) asks the lifecycle for a change with
`Lifecycle.request(params, reason, owner, ref)`; the slot holds it from the request until its outcome,
and its outcome comes back as a `ChangeEvent` posted on the main loop's queue (the supervisor dispatches
it to the tuner or the explorer). The slot never calls up into `tune/`: it posts, the loop delivers.

A change runs through the normal start path (intent, drain, stop, preflight, start). While it is in
flight the lifecycle treats it apart: no promotion of its parameters by time (only the owner's decision,
`end`, promotes), and a failure of its start or run reverts at once instead of retrying (events `failed`,
then `reverted`). Anything that supersedes it (an operator restart, a config reload, a resume) ends it:
event `aborted`. An exploration `hold`s the slot between its points: nothing is promoted by time and
no probe or cache reset runs, though no change is in flight.

The slot does its restarts through the functions its lifecycle gives it (composition, no back-reference):
`restart` (a planned restart: intent, drain, stop, start), `revert_now` (the revert after a failure:
an intent and a start, the failed run is already stopping) and `promote` (last-known-good).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

from tunerd.core.failures import EngineFailure
from tunerd.core.params import EngineParams
from tunerd.engine.process import EngineRun
from tunerd.supervise.capacity import PlanOutcome

Owner = Literal["trial", "explore", "recall"]


class Outcome(StrEnum):
    SERVING = "serving"  # the change's parameters serve (its warm-up and evidence may begin)
    FAILED = "failed"  # the change's start or run failed: the revert has begun
    REVERTED = "reverted"  # the parameters before serve again (`run`), or their start failed (`failure`)
    ABORTED = "aborted"  # superseded (operator restart, reload, resume): the change is over


@dataclass(frozen=True)
class ChangeEvent:
    """What became of a requested change, posted on the loop's queue.

    `plan` is the capacity planner's outcome for the start that served (the preflight's): the figures
    travel with the outcome, nobody asks the planner again for them."""

    outcome: Outcome
    change_id: int
    owner: Owner
    ref: int  # the owner's number in the journal (a trial's, an exploration's)
    at: float  # monotonic: when it happened
    plan: PlanOutcome | None = None
    run: EngineRun | None = None
    failure: EngineFailure | None = None
    reason: str = ""


@dataclass
class Change:
    """The change in flight: its parameters and those to revert to."""

    change_id: int
    owner: Owner
    ref: int
    params: EngineParams
    before: EngineParams
    reverting: bool = False
    plan: PlanOutcome | None = None


class Restart(Protocol):
    def __call__(self, params: EngineParams, action: str, reason: str, **fields: Any) -> bool: ...


class RevertNow(Protocol):
    def __call__(self, params: EngineParams, reason: str, **fields: Any) -> bool: ...


class ChangeSlot:
    def __init__(
        self,
        *,
        post: Callable[[object], None],
        restart: Restart,
        revert_now: RevertNow,
        promote: Callable[[EngineParams, str], None],
        monotonic: Callable[[], float],
    ) -> None:
        self._post = post
        self._restart = restart
        self._revert_now = revert_now
        self._promote = promote
        self._monotonic = monotonic
        self._ids = itertools.count(1)
        self.current: Change | None = None
        self.held_by: Owner | None = None

    @property
    def in_flight(self) -> bool:
        """A change is in flight, or an owner holds the slot between its changes."""
        return self.current is not None or self.held_by is not None

    def holds(self, change_id: int) -> bool:
        """`change_id` is the change in flight. An owner whose change is not (any more) waits for its
        outcome, posted on the loop's queue, before deciding anything about it."""
        return self.current is not None and self.current.change_id == change_id

    def hold(self, owner: Owner) -> None:
        """`owner` works across several changes (an exploration): nothing is promoted by time until
        `release`."""
        self.held_by = owner

    def release(self) -> None:
        self.held_by = None

    def open(
        self, params: EngineParams, before: EngineParams, reason: str, owner: Owner, ref: int
    ) -> int | None:
        """Restart with `params` as a change of `owner` (the caller checked that vLLM serves). Its id, or
        None (nothing done) when a change is in flight or its intent could not be made durable."""
        if self.current is not None:
            return None
        if not self._restart(params, "trial", reason, trial=ref):
            return None
        change = Change(next(self._ids), owner, ref, params, before)
        self.current = change
        return change.change_id

    def end(self, change_id: int, *, keep: bool, reason: str, promote: bool = True) -> bool:
        """The owner's decision on change `change_id`. Keep: it ends, its parameters stay in force and,
        with `promote`, become last-known-good. Revert: a restart with the parameters before (action
        "revert"); the change ends when they serve again (event `reverted`)."""
        change = self.current
        if change is None or change.reverting or change.change_id != change_id:
            return False
        if keep:
            self.current = None
            if promote:
                self._promote(change.params, f"trial {change.ref} kept")
            return True
        change.reverting = True
        return self._restart(change.before, "revert", reason, trial=change.ref)

    # -- what the lifecycle tells the slot -----------------------------------------------------------

    def launched(self, params: EngineParams, plan: PlanOutcome | None) -> None:
        """A start was launched with `params` after the preflight's `plan`: the change's, keep it."""
        change = self.current
        if change is not None and params == (change.before if change.reverting else change.params):
            change.plan = plan

    def ready(self, run: EngineRun, now: float) -> None:
        """A run answered /health: the change serves, or its revert does (the change ends)."""
        change = self.current
        if change is None:
            return
        if change.reverting and run.params == change.before:
            self.current = None
            self._emit(Outcome.REVERTED, change, now, run=run)
        elif not change.reverting and run.params == change.params:
            self._emit(Outcome.SERVING, change, now, run=run)

    def failed(self, failure: EngineFailure) -> bool:
        """A failure while a change is in flight. Its own start or run: revert at once (True: handled).
        Its revert's: the change ends, and the lifecycle's normal policy (backoff, rollback, FATAL)
        takes over."""
        change = self.current
        if change is None:
            return False
        now = self._monotonic()
        if change.reverting:
            self.current = None
            self._emit(Outcome.REVERTED, change, now, failure=failure)
            return False
        change.reverting = True
        self._emit(Outcome.FAILED, change, now, failure=failure)
        reason = f"trial {change.ref} failed ({failure.kind}): back to the parameters before"
        if self._revert_now(change.before, reason, trial=change.ref, after=str(failure.kind)):
            return True
        self.current = None  # the revert could not be journaled: the normal policy takes over
        self._emit(Outcome.REVERTED, change, now, failure=failure)
        return False

    def abort(self, reason: str) -> None:
        """Something superseded the change (operator restart, reload, resume): it ends."""
        change = self.current
        if change is None:
            return
        self.current = None
        self._emit(Outcome.ABORTED, change, self._monotonic(), reason=reason)

    def _emit(self, outcome: Outcome, change: Change, now: float, **fields: Any) -> None:
        self._post(
            ChangeEvent(outcome, change.change_id, change.owner, change.ref, now, plan=change.plan, **fields)
        )
