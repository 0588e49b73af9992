"""The front door's drain before a planned stop: a planned stop of a serving vLLM waits until the door
has let the requests in flight finish (new ones wait in the door meanwhile), bounded by a deadline.

`Drain` is held by the lifecycle, which gets the door's side (`DoorDrain`: start a drain) as a
constructor argument — None without a door. The door's link (supervise/door_link.py) tells the lifecycle
when the door reports the drain done (`drained`). Without a door, or for a vLLM that is not
serving (starting, failed), a stop begins at once: a crash cannot drain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tunerd.core.states import EngineState
from tunerd.engine.process import Engine

# Beyond door.drain_timeout_s: the door posts its DoorDrained by then; this bounds a door that did not.
DRAIN_SLACK_S = 5.0


class DoorDrain(Protocol):
    """The door's side: hold new requests, let those in flight finish, then report (DoorDrained)."""

    def drain(self, reason: str) -> None: ...


@dataclass
class Draining:
    """A planned stop waiting for the door's drain: the stop's action, its deadline (monotonic)."""

    action: str
    deadline: float
    done: bool = False


class Drain:
    """Planned stops of the lifecycle's engine, drained first when a door is there. `stop_grace`: the
    stop's SIGTERM → SIGKILL grace now; `timeout_s`: door.drain_timeout_s now (both follow a reload)."""

    def __init__(
        self,
        door: DoorDrain | None,
        engine: Engine,
        *,
        stop_grace: Callable[[], float],
        timeout_s: Callable[[], float],
    ) -> None:
        self.door = door
        self.engine = engine
        self.stop_grace = stop_grace
        self.timeout_s = timeout_s
        self.draining: Draining | None = None

    def planned_stop(self, now: float, action: str, reason: str) -> None:
        """Stop vLLM for a planned restart or the shutdown: a serving one is drained first when the front
        door is there (the stop begins when drained, or at the deadline); any other at once."""
        if self.door is not None and self.engine.state is EngineState.RUNNING:
            if self.draining is None:
                self.draining = Draining(action, now + self.timeout_s() + DRAIN_SLACK_S)
                self.door.drain(reason)
            return
        self.engine.begin_stop(now, action, self.stop_grace())

    def drained(self) -> None:
        """The door says nothing is in flight any more (or its drain timed out): stop vLLM now."""
        if self.draining is not None:
            self.draining.done = True

    def step(self, now: float) -> None:
        """Every loop step: begin the stop once the drain is over or its deadline passed."""
        draining = self.draining
        if draining is None:
            return
        if self.engine.state is not EngineState.RUNNING:
            self.draining = None  # a failure stopped it first: nothing is left to drain
        elif draining.done or now >= draining.deadline:
            self.draining = None
            self.engine.begin_stop(now, draining.action, self.stop_grace())
