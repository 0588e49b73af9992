"""Stop and escalate: SIGTERM, wait a grace, SIGKILL, wait a little more, then name the survivors.

One machine for every set of processes tunerd stops — the engine's tree (`process.Engine`) and the
leftovers of an earlier run (`leftovers.LeftoverReaper`) — after gunicorn's `murder_workers` and
supervisor's `killasgroup`. It sends nothing itself: each `step` says whether the caller should send
SIGKILL now, and whether the stop is over (nothing alive, or survivors after the kill wait).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait before reporting survivors (e.g. stuck in D state)


@dataclass(frozen=True, slots=True)
class StopProgress:
    """One look at a stop in progress."""

    send_kill: bool  # the grace is over: send SIGKILL now (said once)
    done: bool  # nothing is alive, or survivors were given up on
    killed: bool  # SIGKILL was (or is now to be) sent
    elapsed: float  # seconds since the stop began
    survivors: tuple[int, ...] = ()  # alive KILL_WAIT_S after SIGKILL (done is then True)


class Escalation:
    """The clock of one stop. The caller sent SIGTERM when it created it."""

    def __init__(self, now: float, grace_s: float) -> None:
        self.started = now
        self.grace_s = grace_s
        self.killed = False

    def hasten(self, grace_s: float) -> None:
        """Shorten the grace (e.g. a memory emergency while a graceful stop runs); never lengthen it."""
        self.grace_s = min(self.grace_s, grace_s)

    def step(self, now: float, alive: Sequence[int]) -> StopProgress:
        """Where the stop stands with `alive` still running at monotonic time `now`."""
        elapsed = now - self.started
        if not alive:
            return StopProgress(False, True, self.killed, elapsed)
        send_kill = not self.killed and elapsed >= self.grace_s
        self.killed = self.killed or send_kill
        if self.killed and elapsed >= self.grace_s + KILL_WAIT_S:
            return StopProgress(send_kill, True, True, elapsed, tuple(sorted(alive)))
        return StopProgress(send_kill, False, self.killed, elapsed)
