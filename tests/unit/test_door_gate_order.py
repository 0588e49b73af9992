"""The door's queue order (door/gate.py) in-process, on a fake clock: first come, first served, and on time
first — a request that has waited its TTFT target goes only when none that can still meet it waits.

The Gate is driven directly on an event loop that never runs: its futures settle synchronously and its
hold timers never fire, so every step is a method call and every time is the fake clock's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tunerd.config import ConfigError, load_config
from tunerd.door.gate import Gate, Ticket
from tunerd.door.metrics import DoorMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def serving_gate(loop: asyncio.AbstractEventLoop, clock: Clock, late_after_s: float | None) -> Gate:
    """A gate with one slot, serving, on time first after `late_after_s` (None: arrival order)."""
    gate = Gate(loop, DoorMetrics(CollectorRegistry()), lambda event: None, max_queue=100,
                hold_timeout_s=300.0, drain_timeout_s=30.0, max_in_flight=1, clock=clock)  # fmt: skip
    gate.set_upstream("http://127.0.0.1:18000", "serving")
    gate.set_late_after(late_after_s)
    return gate


class Queue:
    """Requests through `gate`: each arrival's sequence number and its future; the order of release."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.waiting: dict[int, asyncio.Future[Ticket]] = {}
        self.released: list[int] = []

    def arrive(self) -> int | Ticket:
        seq = self.gate.next_seq()
        granted = self.gate.acquire(seq)
        if isinstance(granted, Ticket):
            return granted
        self.waiting[seq] = granted
        return seq

    def finish_one(self) -> None:
        """The request in flight answers: its slot goes to the next waiter, noted in `released`."""
        self.gate.release(Ticket("http://127.0.0.1:18000", self.gate.epoch))
        done = [seq for seq, future in self.waiting.items() if future.done()]
        for seq in done:
            del self.waiting[seq]
        self.released += done


def test_arrival_order_releases_the_oldest_first_however_long_it_waited(
    loop: asyncio.AbstractEventLoop,
) -> None:
    clock = Clock()
    q = Queue(serving_gate(loop, clock, None))
    assert isinstance(q.arrive(), Ticket)  # the one slot
    old = [q.arrive(), q.arrive()]
    clock.now += 10.0
    new = q.arrive()
    for _ in range(3):
        q.finish_one()
    assert q.released == [*old, new]


def test_on_time_first_serves_who_can_still_meet_the_target_then_the_late_by_arrival(
    loop: asyncio.AbstractEventLoop,
) -> None:
    clock = Clock()
    gate = serving_gate(loop, clock, 3.0)
    q = Queue(gate)
    assert isinstance(q.arrive(), Ticket)
    late = [q.arrive(), q.arrive()]  # will have waited 10 s: past the 3 s target
    clock.now += 8.0
    recent = q.arrive()  # waited 2 s when the slot frees: can still meet it
    clock.now += 2.0
    newest = q.arrive()
    q.finish_one()
    q.finish_one()
    assert q.released == [recent, newest]  # arrival order among the ones still on time
    q.finish_one()
    q.finish_one()
    assert q.released == [recent, newest, *late]  # the late ones when nobody else waits, oldest first
    assert gate.snapshot.queued == 0


def test_a_late_request_is_served_as_soon_as_nothing_on_time_waits(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    q = Queue(serving_gate(loop, clock, 3.0))
    assert isinstance(q.arrive(), Ticket)
    late = q.arrive()
    clock.now += 5.0
    q.finish_one()
    assert q.released == [late]  # late, but alone: not held back for nobody


def test_back_to_arrival_order_puts_the_late_back_in_their_places(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    gate = serving_gate(loop, clock, 3.0)
    q = Queue(gate)
    assert isinstance(q.arrive(), Ticket)
    first, second = q.arrive(), q.arrive()
    clock.now += 5.0
    third = q.arrive()
    q.finish_one()  # on time first: third, and first and second set aside as late
    gate.set_late_after(None)
    fourth = q.arrive()
    for _ in range(3):
        q.finish_one()
    assert q.released == [third, first, second, fourth]


def test_a_replay_is_never_late(loop: asyncio.AbstractEventLoop) -> None:
    """A request cut mid-answer was admitted already: it goes back ahead of later arrivals (gate's order),
    whatever it waited."""
    clock = Clock()
    gate = serving_gate(loop, clock, 3.0)
    q = Queue(gate)
    cut_seq = gate.next_seq()
    ticket = gate.acquire(cut_seq)
    assert isinstance(ticket, Ticket)
    clock.now += 10.0
    later = q.arrive()
    gate.release(ticket)  # the attempt was cut: its slot goes to `later` …
    assert q.waiting[later].done()
    gate.set_upstream("http://127.0.0.1:18000", "restarting")
    gate.set_upstream("http://127.0.0.1:18000", "serving")  # a new epoch: the cut one may go again
    replay = gate.acquire(cut_seq, cut_epoch=ticket.epoch)  # waits: `later` holds the slot
    clock.now += 10.0  # the replay has now waited past the target, the next arrival not at all
    newer = q.arrive()
    q.finish_one()  # `later` answers
    assert replay.done() and not q.waiting[newer].done()  # type: ignore[union-attr]


def test_on_time_first_needs_a_goodput_ttft_target(tmp_path: Path) -> None:
    """Without a TTFT target nothing is ever late: the config says so instead of staying FIFO quietly."""
    config = tmp_path / "tunerd.toml"
    config.write_text(
        '[engine]\nport = 18000\nmodel = "/models/m"\n[door]\nenabled = true\norder = "on_time_first"\n'
        '[objective]\nkind = "goodput"\ntpot_s = 0.05\n'
    )
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert (
        f'{config}: (top level): door: order = "on_time_first" needs [objective] kind = "goodput" with ttft_s'
        in str(refused.value)
    )
    config.write_text(config.read_text() + "ttft_s = 3.0\n")
    assert load_config(config).door.order == "on_time_first"
