"""The lifecycle's side of the front door's drain: a planned stop of a serving vLLM waits until the door
has let the requests in flight finish (new ones wait in the door meanwhile), bounded by a deadline.

`DrainHost` is mixed into `Lifecycle`. The door's link (supervise/door_link.py) sets `drain` (start a
drain) and calls `drained` when the door reports it done. Without a door, or for a vLLM that is not
serving (starting, failed), a stop begins at once: a crash cannot drain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tunerd.core.states import EngineState

if TYPE_CHECKING:
    from tunerd.supervise.lifecycle import Lifecycle

# Beyond door.drain_timeout_s: the door posts its DoorDrained by then; this bounds a door that did not.
DRAIN_SLACK_S = 5.0


@dataclass
class Draining:
    """A planned stop waiting for the door's drain: the stop's action, its deadline (monotonic)."""

    action: str
    deadline: float
    done: bool = False


class DrainHost:
    """Drain support for `Lifecycle` (which provides the engine, the config and the stop's grace)."""

    drain: Callable[[str], None] | None = None  # the door's: hold new requests, let in-flight finish
    draining: Draining | None = None

    def _planned_stop(self: Lifecycle, action: str, reason: str) -> None:
        """Stop vLLM for a planned restart or the shutdown: a serving one is drained first when the front
        door is there (the stop begins at `drained`, or at the deadline); any other at once."""
        now = self.monotonic()
        if self.drain is not None and self.engine.state is EngineState.RUNNING:
            if self.draining is None:
                self.draining = Draining(action, now + self.config.door.drain_timeout_s + DRAIN_SLACK_S)
                self.drain(reason)
            return
        self.engine.begin_stop(now, action, self._stop_grace())

    def drained(self: Lifecycle) -> None:
        """The door says nothing is in flight any more (or its drain timed out): stop vLLM now."""
        if self.draining is not None:
            self.draining.done = True

    def _step_drain(self: Lifecycle, now: float) -> None:
        draining = self.draining
        if draining is None:
            return
        if self.engine.state is not EngineState.RUNNING:
            self.draining = None  # a failure stopped it first: nothing is left to drain
        elif draining.done or now >= draining.deadline:
            self.draining = None
            self.engine.begin_stop(now, draining.action, self._stop_grace())
