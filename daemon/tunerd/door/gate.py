"""The door's admission: the upstream's state, the in-flight count and cap, the queue, the drain.

Lives in the door's event loop and is touched only there (no locks). A request asks `acquire` for a
`Ticket` (a slot to forward under); it gets one at once, or a future that resolves to one when it is its
turn, or a `Refused` (503 with Retry-After, or the reason). `release` gives the slot back.

Order: every request draws a sequence number on arrival; waiting requests are released by that number
(a heap), so a request the upstream cut goes back ahead of those that arrived after it. A cut request
waits for a *new* serving epoch (the loop said serving again after another state, or a new URL) or for
the door's own /health probe to confirm the same upstream alive after the cut (`confirm_alive`): sending
it straight back to an engine that just died would waste its one replay.

On time first (`late_after_s`, `[door] order = "on_time_first"` under a TTFT target): a request that has
waited that long has missed its first-token target whatever comes next, so it is released only when no
request that can still meet it waits; the late ones then go by arrival. In arrival order a backlog makes
every request late — each waits behind requests that already missed — and a queue that the cap answers
only about as fast as requests arrive never drains: the goodput proof's CPU open loop held every cap,
tunerd's and a static one, at 0 % after two minutes (docs/benchmarks.md). Replays are never late: they
were admitted already.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tunerd.door.events import DoorDrained, DoorReleased, DrainState, UpstreamState
from tunerd.door.metrics import DoorMetrics, Outcome


@dataclass(frozen=True)
class Ticket:
    """A slot to forward one attempt under: where to (`url`) and in which serving epoch."""

    url: str
    epoch: int


class Refused(Exception):
    """A request the door answers itself with 503 + Retry-After (`outcome` is what the metrics count)."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


@dataclass(eq=False)
class _Waiter:
    seq: int
    future: asyncio.Future[Ticket]
    since: float
    cut_epoch: int | None  # None: an arrival; else cut in this epoch (wants a newer one, or a probe)
    timer: asyncio.TimerHandle | None = None

    def __lt__(self, other: _Waiter) -> bool:
        return self.seq < other.seq


@dataclass
class _Drain:
    since: float
    at_start: int
    timer: asyncio.TimerHandle | None
    finished: int = 0


@dataclass
class Gate:
    """See the module docstring. `post` puts an event on the main loop's queue (thread-safe)."""

    loop: asyncio.AbstractEventLoop
    metrics: DoorMetrics
    post: Callable[[object], None]
    max_queue: int
    hold_timeout_s: float
    drain_timeout_s: float
    max_in_flight: int | None = None
    late_after_s: float | None = None  # on time first (module doc); None: arrival order
    clock: Callable[[], float] = time.monotonic  # the loop's clock (the unit tests give a fake one)
    state: UpstreamState = "down"
    url: str | None = None
    reason: str = ""
    epoch: int = 0
    in_flight: int = 0
    snapshot: DrainState = field(init=False)
    _ready: list[_Waiter] = field(default_factory=list)  # a heap by arrival: released when it is their turn
    _late: deque[_Waiter] = field(default_factory=deque)  # on time first: waited too long, by arrival
    _cut: list[_Waiter] = field(default_factory=list)  # cut ones waiting for a new epoch or a probe
    _queued: int = 0  # live waiters in all three (cancelled ones leave them lazily)
    _arrivals: int = 0  # requests that arrived so far; the next one's sequence number
    _drain: _Drain | None = None
    _closed: str | None = None

    def __post_init__(self) -> None:
        self.metrics.max_in_flight.set(self.max_in_flight or 0)
        self._publish()

    # -- requests ----------------------------------------------------------------------------------

    def next_seq(self) -> int:
        """An arrival's sequence number (its place in the queue); arrivals are counted by it."""
        seq = self._arrivals
        self._arrivals += 1
        return seq

    def acquire(self, seq: int, cut_epoch: int | None = None) -> Ticket | asyncio.Future[Ticket]:
        """A ticket now, or a future for one (await it with `wait`). Raises Refused when the request
        cannot be held: engine fatal, door closing, queue full (arrivals only: a cut request was admitted
        already and goes back in whatever the queue holds)."""
        if self._closed is not None:
            raise Refused("rejected_fatal", self._closed)
        if self.state == "fatal":
            raise Refused("rejected_fatal", f"vLLM is not available: {self.reason or 'engine FATAL'}")
        if cut_epoch is None and self.state == "serving" and not self._queued and self._has_room():
            ticket = self._grant()
            self._publish()
            return ticket
        if cut_epoch is None and self._queued >= self.max_queue:
            raise Refused(
                "rejected_queue_full", f"the front door's queue is full (max_queue = {self.max_queue})"
            )
        waiter = _Waiter(seq, self.loop.create_future(), self.clock(), cut_epoch)
        waiter.timer = self.loop.call_later(self.hold_timeout_s, self._expire, waiter)
        waiter.future.add_done_callback(lambda fut: self._on_done(waiter))
        heapq.heappush(
            self._cut if cut_epoch is not None and cut_epoch >= self.epoch else self._ready, waiter
        )
        self._queued += 1
        self.metrics.count("held")
        self._pump()
        self._publish()
        return waiter.future

    async def wait(self, future: asyncio.Future[Ticket]) -> Ticket:
        """Await a queued request's ticket; a ticket granted just as the waiting task is cancelled (its
        client went away) is given back, so no slot leaks."""
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result())
            raise

    def release(self, ticket: Ticket) -> None:
        """One attempt is over (answered in full, cut, or its client gone): its slot is free."""
        del ticket
        self.in_flight -= 1
        drain = self._drain
        if drain is not None:
            drain.finished += 1
            if self.in_flight <= 0:
                self._end_drain("idle")
        self._pump()
        self._publish()

    # -- the main loop's settings (scheduled here by Door's thread-safe methods) ----------------------

    def set_upstream(self, url: str | None, state: UpstreamState, reason: str = "") -> None:
        old_state, old_url = self.state, self.url
        self.state, self.reason = state, reason
        if url is not None:
            self.url = url
        if state != "draining" and self._drain is not None:
            self._end_drain("superseded")
        if state == "serving" and (old_state != "serving" or old_url != self.url):
            self.epoch += 1
            self._readmit_cut(lambda w: True)
            if self._queued:
                longest = self.clock() - min(w.since for w in self._live())
                replays = sum(1 for w in self._live() if w.cut_epoch is not None)
                self.post(DoorReleased(self._queued, replays, round(longest, 3)))
        elif state == "draining" and self._drain is None:
            timer = self.loop.call_later(self.drain_timeout_s, self._end_drain, "timeout")
            self._drain = _Drain(self.clock(), self.in_flight, timer)
            if self.in_flight <= 0:
                self._end_drain("idle")
        elif state == "fatal":
            message = f"vLLM is not available: {reason or 'engine FATAL'}"
            for waiter in self._live():
                self._refuse(waiter, Refused("rejected_fatal", message))
        self._pump()
        self._publish()

    def set_max_in_flight(self, cap: int | None) -> None:
        """A lower cap lets the surplus finish and queues new requests; a higher one releases waiters."""
        self.max_in_flight = cap
        self.metrics.max_in_flight.set(cap or 0)
        self._pump()
        self._publish()

    def set_late_after(self, seconds: float | None) -> None:
        """On time first after `seconds` of waiting (module doc); None: arrival order again, the late ones
        back in their places."""
        self.late_after_s = seconds
        if seconds is None:
            for waiter in self._late:
                heapq.heappush(self._ready, waiter)
            self._late.clear()
        self._pump()
        self._publish()

    def confirm_alive(self, epoch: int, probe_sent: float) -> None:
        """The door's /health probe, sent at `probe_sent`, got 200 within `epoch`: the requests cut in that
        epoch before the probe was sent may be replayed (the cut was not the engine's death)."""
        if epoch == self.epoch and self.state == "serving":
            self._readmit_cut(lambda w: w.since <= probe_sent)
            self._pump()
            self._publish()

    def wants_probe(self) -> bool:
        """Requests cut in the current serving epoch wait for a new epoch or a probe's confirmation."""
        return self.state == "serving" and any(not w.future.done() for w in self._cut)

    def close(self, reason: str) -> None:
        """The door stops: everything waiting, and every later arrival, gets 503 with `reason`."""
        self._closed = reason
        for waiter in self._live():
            self._refuse(waiter, Refused("rejected_fatal", reason))
        self._publish()

    # -- inside ---------------------------------------------------------------------------------

    def _has_room(self) -> bool:
        return self.max_in_flight is None or self.in_flight < self.max_in_flight

    def _grant(self) -> Ticket:
        assert self.url is not None
        self.in_flight += 1
        return Ticket(self.url, self.epoch)

    def _pump(self) -> None:
        """Release waiters while the upstream serves and the cap has room: in arrival order, or on time
        first (`late_after_s`)."""
        while self.state == "serving" and self._has_room():
            waiter = self._next()
            if waiter is None:
                return
            if waiter.timer is not None:
                waiter.timer.cancel()
            self.metrics.hold.observe(self.clock() - waiter.since)
            self.metrics.count("released")
            waiter.future.set_result(self._grant())
            self._queued -= 1

    def _next(self) -> _Waiter | None:
        """The live waiter to release next, taken out of its queue; None when none waits. On time first,
        the arrivals that waited `late_after_s` met on the way are set aside in `_late` (by arrival: a
        request once late stays late) and are taken only when no other waits."""
        ready, late = self._ready, self._late
        cutoff = None if self.late_after_s is None else self.clock() - self.late_after_s
        while ready:
            waiter = heapq.heappop(ready)
            if waiter.future.done():
                continue  # cancelled or refused: accounted for in _on_done
            if cutoff is not None and waiter.cut_epoch is None and waiter.since <= cutoff:
                late.append(waiter)
                continue
            return waiter
        while late:
            waiter = late.popleft()
            if not waiter.future.done():
                return waiter
        return None

    def _readmit_cut(self, which: Callable[[_Waiter], bool]) -> None:
        keep = []
        for waiter in self._cut:
            if waiter.future.done():
                continue
            if which(waiter):
                heapq.heappush(self._ready, waiter)
            else:
                keep.append(waiter)
        heapq.heapify(keep)
        self._cut = keep

    def _live(self) -> list[_Waiter]:
        return [w for w in (*self._ready, *self._late, *self._cut) if not w.future.done()]

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        if self.state == "serving":
            why = f"no slot within the hold timeout (max_in_flight = {self.max_in_flight})"
        else:
            why = (
                f"vLLM did not serve again within the hold timeout ({self.state}: {self.reason or 'restart'})"
            )
        self._refuse(
            waiter, Refused("rejected_hold_timeout", f"{why}; hold_timeout_s = {self.hold_timeout_s:g}")
        )
        self._publish()

    def _refuse(self, waiter: _Waiter, refusal: Refused) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        self.metrics.hold.observe(self.clock() - waiter.since)
        self._queued -= 1
        waiter.future.set_exception(refusal)

    def _on_done(self, waiter: _Waiter) -> None:
        """A waiter's future settled; only a cancellation (its client went away) is not accounted yet."""
        if waiter.future.cancelled():
            if waiter.timer is not None:
                waiter.timer.cancel()
            self._queued -= 1
            self.metrics.count("client_gone")
            if len(self._ready) + len(self._late) > 2 * self._queued + 64:  # clients that left: compact
                self._ready = [w for w in self._ready if not w.future.done()]
                heapq.heapify(self._ready)
                self._late = deque(w for w in self._late if not w.future.done())
            self._publish()

    def _end_drain(self, ended: str) -> None:
        drain = self._drain
        if drain is None:
            return
        self._drain = None
        if drain.timer is not None:
            drain.timer.cancel()
        cut = max(self.in_flight, 0) if ended != "idle" else 0
        self.metrics.count("drain_cut", cut)
        seconds = round(self.clock() - drain.since, 3)
        self.post(DoorDrained(ended, drain.at_start, drain.finished, cut, self._queued, seconds))  # type: ignore[arg-type]
        self._publish()

    def _publish(self) -> None:
        """A fresh immutable snapshot for the main loop (an attribute swap: no lock needed)."""
        self.snapshot = DrainState(
            self.state,
            self.in_flight,
            self._queued,
            self.max_in_flight,
            self._drain.since if self._drain is not None else None,
            self.reason,
            self._arrivals,
        )
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.queued.set(self._queued)
