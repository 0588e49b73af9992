"""The door's cap controller (door/limit.py) on simulated latency curves, with a fake clock: it converges
on the largest cap that meets the targets, backs off when latency rises, holds its bounds, never lowers
the cap when the door's own wait is what misses, drops stale samples; and the journal's rate limit."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.unit.fakes import FakeClock
from tunerd.core.slo import RequestSample, Targets
from tunerd.door.limit import CEILING, Goodput, LimitChange, LimitLog, Static, judge

TOKENS = 100


def sample(
    forwarded: float, *, wait: float = 0.0, upstream_ttft: float = 0.05, tpot: float = 0.01
) -> RequestSample:
    """One streamed request forwarded at `forwarded` after `wait` in the door."""
    upstream_e2e = upstream_ttft + (TOKENS - 1) * tpot
    return RequestSample(
        done=forwarded + upstream_e2e,
        wait_s=wait,
        upstream_ttft_s=upstream_ttft,
        ttft_s=wait + upstream_ttft,
        tokens=TOKENS,
        tokens_exact=True,
        tpot_s=tpot,
        e2e_s=wait + upstream_e2e,
        streamed=True,
        ok=True,
    )


class ClosedLoop:
    """`clients` streaming clients against a server whose time per token grows with the batch
    (`tpot(c)`, c = min(cap, clients)); the rest of the clients wait in the door."""

    def __init__(self, clients: int, tpot: Callable[[int], float], upstream_ttft: float = 0.05) -> None:
        self.clients = clients
        self.tpot = tpot
        self.upstream_ttft = upstream_ttft

    def feed(self, limiter: Goodput, now: float, n: int = 20) -> int:
        """`n` requests forwarded just after `now` under the cap in force; returns how many wait now."""
        cap = limiter.limit
        c = min(cap, self.clients)
        per_token = self.tpot(c)
        service = self.upstream_ttft + (TOKENS - 1) * per_token
        waiting = max(0, self.clients - c)
        wait = waiting / c * service  # a closed loop: the queue ahead of a request drains c at a time
        for _ in range(n):
            limiter.record(sample(now + 0.01, wait=wait, upstream_ttft=self.upstream_ttft, tpot=per_token))
        return waiting


def run(limiter: Goodput, loop: ClosedLoop, clock: FakeClock, steps: int) -> list[int]:
    caps = []
    for _ in range(steps):
        queued = loop.feed(limiter, clock())
        clock.advance(limiter.interval_s)
        limiter.step(clock(), queued)
        caps.append(limiter.limit)
    return caps


def linear(a: float, b: float) -> Callable[[int], float]:
    return lambda c: a + b * c


def steered(clock: FakeClock, targets: Targets, **kw: object) -> Goodput:
    return Goodput(targets, 0.95, now=clock(), **kw)  # type: ignore[arg-type]


def test_converges_on_the_largest_cap_that_meets_the_tpot_target() -> None:
    # TPOT = 2 ms + 0.5 ms per sequence; target 20.2 ms: caps up to 36 meet it, 37 does not.
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.0202), low=1, high=256, memory_s=3600.0)
    caps = run(limiter, ClosedLoop(200, linear(0.002, 0.0005)), clock, 40)
    assert caps[-1] == 36
    assert set(caps[-10:]) == {36}  # settled, not a sawtooth
    assert limiter.state().verdict == "met"
    # A reload that changes neither bounds nor targets keeps what was learnt (no probe above 36 follows).
    assert limiter.set_bounds(1, 256, clock()) is None
    limiter.set_targets(Targets(tpot_s=0.0202), 0.95)
    assert run(limiter, ClosedLoop(200, linear(0.002, 0.0005)), clock, 1) == [36]


def test_converges_from_below_when_requests_wait_in_the_door() -> None:
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.0202), low=1, high=256, start=2)
    caps = run(limiter, ClosedLoop(200, linear(0.002, 0.0005)), clock, 40)
    assert caps[-1] == 36


def test_backs_off_when_latency_rises_and_climbs_back_when_it_falls() -> None:
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.0202), low=1, high=256, memory_s=30.0)
    caps = run(limiter, ClosedLoop(200, linear(0.002, 0.0005)), clock, 40)
    # Settled on 36; once the memory of the miss at 37 ages out (30 s) it tries one above, once.
    assert set(caps[-12:]) <= {36, 37} and caps[-12:].count(36) >= 10
    while limiter.limit != 36:
        caps = run(limiter, ClosedLoop(200, linear(0.002, 0.0005)), clock, 1)
    # Longer prompts arrive: every sequence costs twice as much. 18 caps meet 20.2 ms now.
    caps = run(limiter, ClosedLoop(200, linear(0.002, 0.001)), clock, 40)
    assert caps[0] < 36  # the first interval's misses step it down at once
    assert set(caps[-12:]) <= {18, 19} and 18 in caps[-2:]
    # The load lightens again: once its memory of the miss ages out, it finds 36 again.
    caps = run(limiter, ClosedLoop(200, linear(0.002, 0.0005)), clock, 60)
    assert set(caps[-12:]) <= {36, 37} and 36 in caps[-2:]


def test_holds_its_bounds_and_says_when_the_cap_cannot_meet_the_targets() -> None:
    clock = FakeClock()
    # Even one sequence misses (TPOT 30 ms at c = 1, target 20 ms): down to the lower bound, then it says so.
    limiter = steered(clock, Targets(tpot_s=0.020), low=4, high=64)
    caps = run(limiter, ClosedLoop(200, linear(0.03, 0.001)), clock, 30)
    assert min(caps) == 4 and caps[-1] == 4
    state = limiter.state()
    assert state.verdict == "upstream" and state.cannot_meet and not state.steering
    # Everything meets: up to the upper bound (max_num_seqs), never past it.
    limiter = steered(clock, Targets(tpot_s=0.020), low=1, high=48, start=1)
    caps = run(limiter, ClosedLoop(200, linear(0.001, 0.0001)), clock, 30)
    assert max(caps) == 48 and caps[-1] == 48
    # max_num_seqs unknown: a sane ceiling.
    assert steered(clock, Targets(tpot_s=0.02)).limit == CEILING


class ServingLoop(ClosedLoop):
    """A ClosedLoop whose answers in an interval are what the batch serves in it: c requests every
    service time (fewer answers at a smaller cap, as on a real server)."""

    def answers(self, limiter: Goodput) -> int:
        """What the batch under the cap in force answers in one interval (at least 1)."""
        c = min(limiter.limit, self.clients)
        service = self.upstream_ttft + (TOKENS - 1) * self.tpot(c)
        return max(1, round(c / service * limiter.interval_s))

    def feed(self, limiter: Goodput, now: float, n: int = 0) -> int:
        return super().feed(limiter, now, self.answers(limiter))


def test_out_of_reach_it_goes_back_to_the_cap_that_served_best_and_holds_it() -> None:
    # TPOT 40 ms + 1 ms per sequence against a 20 ms target: every request misses upstream at every cap,
    # and a smaller batch only answers fewer. Down to the floor (to learn it), then back to the cap that
    # answered the most (the upper bound here), held there, saying why — not left at the floor.
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=3, high=16)
    caps = run(limiter, ServingLoop(32, linear(0.04, 0.001)), clock, 40)
    assert min(caps) == 3  # it walked down to learn it
    assert caps[-1] == 16 and set(caps[-10:]) == {16}, caps
    state = limiter.state()
    assert state.verdict == "upstream" and state.cannot_meet and not state.steering
    assert "out of the cap's reach; back to the cap that served best, 16" in state.last_why
    # Held for HOLD_MEMORIES memories, then the floor is checked again: the load may have changed.
    caps = run(limiter, ServingLoop(32, linear(0.04, 0.001)), clock, 80)
    assert min(caps) < 16 and caps[-1] == 16


def test_out_of_reach_it_holds_what_served_best_under_a_backlog_not_what_an_empty_queue_served() -> None:
    # The H200's open loop (docs/gpu.md, the fourth lease): in its first seconds the uncapped configuration
    # answered from an empty queue, just short of the targets; minutes later, with requests queued in the
    # door, every cap missed upstream, and the hold went back to the uncapped one's score.
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=3, high=16)
    for tpot in [0.012] * 18 + [0.05] * 2:  # 16 from an empty queue: 90 % of 20 answers meet
        limiter.record(sample(clock() + 0.01, tpot=tpot))
    clock.advance(limiter.interval_s)
    limiter.step(clock(), 0)
    assert limiter.limit == 12  # missed upstream: a smaller batch
    caps = run(limiter, ServingLoop(32, linear(0.04, 0.001)), clock, 30)  # now a backlog: all miss
    assert min(caps) == 3
    assert caps[-1] == 12 and set(caps[-5:]) == {12}, caps  # the most answers under a backlog, not 16
    assert "back to the cap that served best, 12" in limiter.state().last_why


def test_a_held_cap_lets_go_when_the_targets_come_within_reach() -> None:
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=3, high=16)
    run(limiter, ServingLoop(32, linear(0.04, 0.001)), clock, 40)
    assert limiter.limit == 16 and limiter.state().cannot_meet
    # Shorter outputs: 12 ms + 0.5 ms a sequence; 16 meets now, and requests wait in the door: held no more.
    caps = run(limiter, ServingLoop(32, linear(0.012, 0.0005)), clock, 5)
    assert set(caps) == {16} and limiter.state().verdict == "met" and not limiter.state().cannot_meet


def test_new_bounds_bring_the_cap_inside_them() -> None:
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=1, high=256)
    change = limiter.set_bounds(2, 16, clock())
    assert change == LimitChange(256, 16, clock(), "bounds 2..16")
    assert limiter.set_bounds(2, 16, clock()) is None  # nothing moved: nothing to tell
    with pytest.raises(ValueError):
        limiter.set_bounds(8, 4, clock())


def test_back_to_the_bounds_before_a_trial_the_cap_goes_back_to_what_it_was() -> None:
    # The H100's closed loop (docs/gpu.md, the seventh lease): the door steered to 18 under max_num_seqs
    # 1024, a trial's max_num_seqs 8 bounded it to 8, and after the revert it climbed from 8 again.
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=1, high=1024, start=18)
    assert limiter.set_bounds(1, 8, clock()) == LimitChange(18, 8, clock(), "bounds 1..8")
    change = limiter.set_bounds(1, 1024, clock())
    assert change is not None and change.new == 18
    assert change.why == "bounds 1..1024: back to the cap in force under them, 18"
    # Bounds that are not the last ones keep the cap in force: a kept trial, then another.
    limiter.set_bounds(1, 8, clock())
    limiter.set_bounds(1, 16, clock())
    assert limiter.limit == 8


def test_never_lowers_the_cap_when_the_doors_wait_is_what_misses() -> None:
    # The H200's closed loop (issue 21): vLLM's own TTFT is fine at any cap, the clients' TTFT target is
    # missed only by their wait in the door. Capping would only move the queue: the cap only rises.
    clock = FakeClock()
    limiter = steered(clock, Targets(ttft_s=0.5, tpot_s=0.05), low=1, high=128, start=8)
    caps = run(limiter, ClosedLoop(100, linear(0.005, 0.0001), upstream_ttft=0.05), clock, 30)
    assert all(b >= a for a, b in zip([8, *caps], caps, strict=False))
    assert caps[-1] >= 100  # every client admitted: nothing waits any more
    state = limiter.state()
    assert state.verdict == "met"


def test_the_cap_lost_to_the_doors_wait_is_shown_until_forgotten() -> None:
    # The tuner reads `too_low` from the snapshot as a concurrency lost under the load in force (issue 22):
    # the snapshot forgets it when the controller does — at a restart, and once it ages out.
    clock = FakeClock()
    limiter = steered(clock, Targets(ttft_s=0.5), low=1, high=128, start=8, memory_s=60.0)
    run(limiter, ClosedLoop(100, linear(0.005, 0.0001)), clock, 1)
    assert limiter.state().too_low == 8
    limiter.reset(clock())
    assert limiter.state().too_low is None
    clock.advance(10.0)  # requests that arrived after the restart (their wait in the door is ~7 s)
    run(limiter, ClosedLoop(100, linear(0.005, 0.0001)), clock, 1)
    lost = limiter.state().too_low
    assert lost is not None
    clock.advance(61.0)  # no judged step since: only the interval's look at the memory
    limiter.step(clock(), 0)
    assert limiter.state().too_low is None


def test_the_doors_wait_at_the_upper_bound_cannot_be_met_by_the_cap() -> None:
    clock = FakeClock()
    limiter = steered(clock, Targets(ttft_s=0.5), low=1, high=16)
    caps = run(limiter, ClosedLoop(100, linear(0.005, 0.0001)), clock, 5)
    assert caps == [16] * 5
    state = limiter.state()
    assert state.verdict == "door" and state.cannot_meet
    assert state.door_miss_share == 1.0 and state.wait_share is not None and state.wait_share > 0.9


def test_blames_each_miss_on_vllm_or_on_the_doors_wait() -> None:
    targets = Targets(ttft_s=1.0, tpot_s=0.02, e2e_s=10.0)
    j = judge(
        [
            sample(0, tpot=0.03),  # TPOT: vLLM's
            sample(0, wait=2.0, upstream_ttft=0.1),  # TTFT 2.1 s, vLLM's part 0.1 s: the door's
            sample(0, wait=0.1, upstream_ttft=1.5),  # vLLM's own TTFT misses: vLLM's
            sample(0, wait=9.0),  # e2e 10.04 s: only the wait made it miss
            sample(0),  # good
        ],
        targets,
    )
    assert (j.n, j.good, j.misses_upstream, j.misses_door) == (5, 1, 2, 2)


def test_drops_samples_forwarded_before_a_change() -> None:
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=1, high=64, min_samples=5)
    for _ in range(10):
        limiter.record(sample(clock(), tpot=0.05))  # misses at 64
    clock.advance(5)
    change = limiter.step(clock(), 0)
    assert change is not None and change.new == 48
    changed_at = clock()
    clock.advance(1)
    # Requests forwarded under 64 finish now: stale, they say nothing of 48.
    for _ in range(10):
        limiter.record(sample(changed_at - 0.5, tpot=0.05))
    assert limiter.state().samples == 0
    clock.advance(5)
    assert limiter.step(clock(), 0) is None  # nothing fresh: no verdict, no step
    assert limiter.state().stale == 10
    for _ in range(5):
        limiter.record(sample(changed_at + 0.1, tpot=0.01))
    clock.advance(5)
    limiter.step(clock(), 0)
    assert limiter.state().verdict == "met"


def test_a_restart_drops_what_arrived_before_it() -> None:
    clock = FakeClock()
    limiter = steered(clock, Targets(ttft_s=0.5), low=1, high=8, start=4, min_samples=3)
    limiter.reset(clock())  # vLLM serves again; these were held across the restart
    for _ in range(5):
        limiter.record(sample(clock() + 0.1, wait=60.0))
    clock.advance(5)
    assert limiter.step(clock(), 0) is None and limiter.limit == 4


def test_waits_for_enough_samples_and_steps_once_per_interval() -> None:
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=1, high=64, min_samples=10)
    for _ in range(9):
        limiter.record(sample(clock(), tpot=0.05))
    clock.advance(5)
    assert limiter.step(clock(), 0) is None  # nine: keep collecting
    limiter.record(sample(clock(), tpot=0.05))
    clock.advance(1)
    assert limiter.step(clock(), 0) is not None  # the tenth: the interval already passed
    for _ in range(20):
        limiter.record(sample(clock() + 0.01, tpot=0.05))
    clock.advance(4)
    assert limiter.step(clock(), 0) is None  # within the interval of the change
    clock.advance(1)
    assert limiter.step(clock(), 0) is not None


def test_static_never_moves() -> None:
    limiter = Static(12)
    limiter.record(sample(0, tpot=1.0))
    assert limiter.step(100.0, 50) is None and limiter.limit == 12
    assert limiter.state().mode == "static"


def test_a_steered_cap_needs_a_target() -> None:
    with pytest.raises(ValueError):
        Goodput(Targets(), 0.95)


def test_the_journal_hears_of_the_cap_at_most_once_per_interval() -> None:
    log = LimitLog(every_s=30.0)
    first = log.add(LimitChange(None, 64, 0.0, "bounds"))
    assert first == {"old": None, "new": 64, "why": "bounds", "steps": 1}
    told = [log.add(LimitChange(64 - i, 63 - i, 5.0 * i, f"step {i}")) for i in range(1, 6)]  # t = 5 … 25
    assert told == [None] * 5
    assert log.due(29.9) is None
    assert log.due(30.0) == {"old": 63, "new": 58, "why": "step 5", "steps": 5}
    assert log.due(100.0) is None  # nothing pending: nothing told
    assert log.add(LimitChange(58, 60, 100.0, "met")) == {"old": 58, "new": 60, "why": "met", "steps": 1}


class Backlogged(ServingLoop):
    """A ServingLoop whose clients always wait in the door (50 of them), and whose time per token varies
    from request to request (×0.5 to ×2.0 of the batch's), so a smaller batch meets the target more often
    while it answers fewer."""

    SPREAD = tuple(0.5 + 0.15 * i for i in range(11))

    def feed(self, limiter: Goodput, now: float, n: int = 0) -> int:
        per_token = self.tpot(min(limiter.limit, self.clients))
        for i in range(self.answers(limiter)):
            tpot = per_token * self.SPREAD[i % len(self.SPREAD)]
            limiter.record(sample(now + 0.01, upstream_ttft=self.upstream_ttft, tpot=tpot))
        return 50


def test_out_of_reach_in_a_closed_loop_it_holds_the_most_good_answers_not_the_most_answers() -> None:
    # CI's goodput story (fresh-clone run 21): a closed loop of clients waiting in the door, every cap
    # missing upstream on the busy box; the hold went to cap 13 for its 2.00 answers/s at 0 good/s, over
    # cap 2, which had met the targets. Clients waiting are not a backlog that grows: the hold ranks by
    # good requests a second. Here TPOT is 4 ms + 1 ms a sequence: cap 3 answers 4.0/s, 82 % good (3.3
    # good/s); cap 12 7.3/s, 18 % good (1.3); cap 16 7.9/s, 9 % good (0.7).
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.012), low=3, high=16)
    caps = run(limiter, Backlogged(64, linear(0.004, 0.001)), clock, 40)
    assert min(caps) == 3 and set(caps[-10:]) == {3}, caps
    assert limiter.state().keeps_up is None and limiter.state().cannot_meet


def test_a_down_step_from_a_cap_above_the_concurrency_starts_from_what_was_in_flight() -> None:
    # The goodput proof's open loop (CPU): vLLM's default max_num_seqs of 128 as the cap, ~10 in flight;
    # ×0.75 from 128 took four steps of ~30 s and still stood at 40.
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=1, high=128)
    for _ in range(10):
        limiter.record(sample(clock() + 0.01, tpot=0.05))
    for in_flight in (9, 12, 10):  # the door's ticks: the most in flight counts
        clock.advance(2.0)  # the third tick is past the 5 s interval
        limiter.step(clock(), 0, in_flight)
    assert limiter.limit == 9  # ×0.75 of the 12 in flight, not 96
    for _ in range(10):
        limiter.record(sample(clock() + 0.01, tpot=0.05))
    clock.advance(limiter.interval_s)
    limiter.step(clock(), 3, 9)
    assert limiter.limit == 6  # bound now: from the cap


def test_with_requests_in_flight_and_no_answer_yet_it_is_not_idle_and_still_steering() -> None:
    # Answers of several seconds leave an interval after a move without a fresh one. Read as "idle", the
    # cap stopped "steering" and a rule's restart went through while it was still walking down.
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.020), low=1, high=32)
    for _ in range(10):
        limiter.record(sample(clock() + 0.01, tpot=0.05))
    clock.advance(limiter.interval_s)
    limiter.step(clock(), 0, 20)
    assert limiter.limit < 32 and limiter.state().steering
    clock.advance(limiter.interval_s)
    limiter.step(clock(), 0, 12)  # no answer since the move, 12 in flight
    assert limiter.state().verdict == "upstream" and limiter.state().steering
    clock.advance(limiter.interval_s)
    limiter.step(clock(), 0, 0)  # nothing in flight, nothing waiting, no answer: idle
    assert limiter.state().verdict == "idle" and not limiter.state().steering


def test_what_missed_upstream_is_remembered_as_the_concurrency_that_ran_not_a_cap_above_it() -> None:
    # The goodput proof's CPU open loop: 128 remembered as too high with ~8 in flight, one interval later
    # a miss by the door's wait stepped halfway to it, to 67, and let in a backlog never drained again.
    clock = FakeClock()
    limiter = steered(clock, Targets(ttft_s=3.0, tpot_s=0.020), low=1, high=128)
    for _ in range(10):
        limiter.record(sample(clock() + 0.01, tpot=0.05))
    clock.advance(limiter.interval_s)
    limiter.step(clock(), 0, 8)
    assert limiter.limit == 6 and limiter.state().too_high == 8
    for _ in range(10):  # now the door's wait is what misses
        limiter.record(sample(clock() + 0.01, wait=5.0, tpot=0.01))
    clock.advance(limiter.interval_s)
    limiter.step(clock(), 4, 6)
    assert limiter.limit == 7  # halfway to the 8 that missed, not to 128


def test_boxed_in_between_the_doors_wait_and_upstream_it_holds_what_served_best() -> None:
    # The H100's closed loop (docs/gpu.md, the eighth lease): 10 missed upstream, 9 missed by the door's
    # wait, and the cap sat at 9 for 50 s at 0 good/s while 14 had served 2.80 good/s.
    clock = FakeClock()
    limiter = steered(clock, Targets(ttft_s=1.0, tpot_s=0.020), low=1, high=64, start=14)

    def interval(meet: int, upstream: int, door: int) -> None:
        for _ in range(meet):
            limiter.record(sample(clock() + 0.01, tpot=0.01))
        for _ in range(upstream):
            limiter.record(sample(clock() + 0.01, tpot=0.03))
        for _ in range(door):
            limiter.record(sample(clock() + 0.01, wait=2.0, tpot=0.01))
        clock.advance(limiter.interval_s)
        limiter.step(clock(), 50, limiter.limit)

    interval(meet=6, upstream=14, door=0)  # 14: 1.2 good/s, most misses upstream
    assert limiter.limit == 10
    interval(meet=0, upstream=15, door=0)
    assert limiter.limit == 7 and limiter.state().too_high == 10
    interval(meet=0, upstream=0, door=12)  # halfway up to the 10 that missed upstream
    assert limiter.limit == 9
    interval(meet=0, upstream=0, door=12)  # no up step left: back to 14, not left at 9
    state = limiter.state()
    assert limiter.limit == 14, state.last_why
    assert state.verdict == "door" and state.cannot_meet
    assert "back to the cap that served best, 14 (1.20 good/s" in state.last_why
    interval(meet=6, upstream=14, door=0)  # held there while it misses upstream
    assert limiter.limit == 14


class OpenLoop:
    """Arrivals at `rate` a second that do not wait for answers, against a server whose time per token
    grows with the batch (`tpot(c)`, c = min(cap, the backlog)): a cap that answers fewer grows the door's
    backlog (queued + in flight), which `step` sees beside the door's count of arrivals (`known`; else
    None). Times per token vary from request to request as in Backlogged."""

    def __init__(self, rate: float, tpot: Callable[[int], float], known: bool = True) -> None:
        self.rate, self.tpot, self.known = rate, tpot, known
        self.arrived = self.backlog = 0

    def interval(self, limiter: Goodput, clock: FakeClock) -> None:
        arrivals = round(self.rate * limiter.interval_s)
        present = self.backlog + arrivals
        c = max(1, min(limiter.limit, present))
        per_token = self.tpot(c)
        answers = min(present, round(c / (0.05 + (TOKENS - 1) * per_token) * limiter.interval_s))
        for i in range(answers):
            tpot = per_token * Backlogged.SPREAD[i % len(Backlogged.SPREAD)]
            limiter.record(sample(clock() + 0.01, tpot=tpot))
        self.arrived += arrivals
        self.backlog = present - answers
        clock.advance(limiter.interval_s)
        in_flight = min(limiter.limit, self.backlog)
        limiter.step(clock(), self.backlog - in_flight, in_flight, self.arrived if self.known else None)


def open_run(known: bool, intervals: int = 120) -> tuple[Goodput, list[int], list[int]]:
    """The cap and the backlog after each 5 s interval of an OpenLoop at 6.5 requests/s (see below)."""
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.012), low=1, high=64)
    loop = OpenLoop(6.5, linear(0.004, 0.001), known)
    caps, backlog = [], []
    for _ in range(intervals):
        loop.interval(limiter, clock)
        caps.append(limiter.limit)
        backlog.append(loop.backlog)
    return limiter, caps, backlog


def test_it_keeps_up_with_the_arrivals_rather_than_walk_below_what_they_need() -> None:
    # The goodput proof's CPU open loop at 0.57 req/s (docs/benchmarks.md): upstream misses walked the cap
    # to 3, which answers fewer than arrive, and the backlog made every request miss for three minutes.
    # Here TPOT is 4 ms + 1 ms a sequence against 12 ms, and cap c answers c / (0.05 + 99 × (0.004 +
    # 0.001 c)) a second: with 6.5 arriving, caps up to 7 answer fewer (7: 6.1/s), 8 answers 6.5.
    limiter, caps, backlog = open_run(known=True)
    assert min(caps[24:]) >= 8, caps  # after the first two minutes, never below what keeps up
    assert backlog[-1] <= backlog[24], backlog  # so the backlog stopped growing
    state = limiter.state()
    assert state.keeps_up is not None and state.keeps_up >= 8
    # Without the door's arrivals the same walk ends below them: ten minutes in, the backlog still grows.
    _, caps, backlog = open_run(known=False)
    assert min(caps[24:]) < 8 and backlog[-1] > backlog[24] + 100, (caps, backlog)


def test_out_of_reach_behind_the_arrivals_it_holds_a_cap_that_keeps_up_not_the_smallest_batch() -> None:
    # The H200's open loop at 8 req/s (docs/gpu.md, the fifth lease): every cap missed upstream; the holds
    # went by good/s to caps that met TPOT more often but answered 5.2-6.2/s, and the queue grew to 121.
    # Here 7 requests arrive a second, and of the caps above only 12 (7.3/s) and 16 keep up.
    clock = FakeClock()
    limiter = steered(clock, Targets(tpot_s=0.012), low=3, high=16)
    loop, caps, backlog = OpenLoop(7.0, linear(0.004, 0.001)), [], []
    for _ in range(40):
        loop.interval(limiter, clock)
        caps.append(limiter.limit)
        backlog.append(loop.backlog)
    assert min(caps) == 3  # it walked down to learn it
    assert min(caps[-20:]) >= 12 and backlog[-1] == 0, (caps, backlog)
    assert limiter.state().keeps_up is not None and limiter.state().keeps_up >= 12


def test_the_move_to_keep_up_says_why_and_a_restart_forgets_it() -> None:
    limiter, caps, _ = open_run(known=True, intervals=20)
    up = limiter.state()
    assert up.keeps_up == limiter.limit and up.cannot_meet, caps  # a batch that keeps up misses TPOT
    assert "answers fewer than the 6.40 arriving a second" in up.last_why
    assert "the concurrency that keeps up (Little's law" in up.last_why
    limiter.reset(1e6)  # the arrivals held across a restart are not the cap's doing
    assert limiter.state().keeps_up is None


def test_a_closed_loop_never_reads_as_falling_behind() -> None:
    # A closed loop's backlog cannot grow (a client sends after its answer), and clients joining raise it
    # once, a step: the door's arrivals passed beside it change nothing in the walk of
    # test_out_of_reach_it_goes_back_to_the_cap_that_served_best, with 32 clients joining the 32 at 50 s.
    def walk(known: bool) -> list[int]:
        clock = FakeClock()
        limiter = steered(clock, Targets(tpot_s=0.020), low=3, high=16)
        loop, arrived, caps = ServingLoop(32, linear(0.04, 0.001)), 32, []
        for i in range(40):
            if i == 10:
                loop.clients += 32
                arrived += 32
            answers = loop.answers(limiter)
            queued = loop.feed(limiter, clock())
            arrived += answers  # each answer's client sends again
            clock.advance(limiter.interval_s)
            limiter.step(clock(), queued, min(limiter.limit, loop.clients), arrived if known else None)
            caps.append(limiter.limit)
        assert limiter.state().keeps_up is None
        return caps

    assert walk(known=True) == walk(known=False)


def test_behind_the_arrivals_the_hold_ranks_the_caps_that_keep_up_by_good_answers_not_answers() -> None:
    # The H100's open loop at 8 req/s (docs/gpu.md, the sixth lease): once the door had fallen behind, the
    # hold went twice to no cap for the most answers a second (9.20, judged while it drained a queue) over
    # caps 13-16 that had met the targets; no cap then preempted and missed TPOT.
    clock = FakeClock()
    limiter = steered(clock, Targets(ttft_s=3.0, tpot_s=0.012), low=1, high=64, start=64)
    arrived = 0

    def interval(good: int, bad: int, backlog: int = 20, arrivals: int = 30) -> None:
        """`good` answers within the targets and `bad` missing TPOT; `backlog` queued and in flight."""
        nonlocal arrived
        for i in range(good + bad):
            limiter.record(sample(clock() + 0.01, tpot=0.01 if i < good else 0.05))
        arrived += arrivals
        clock.advance(limiter.interval_s)
        limiter.step(clock(), backlog - 20, 20, arrived)

    for backlog in (30, 60, 90):  # behind: met at the ceiling, and a queue that climbs
        interval(good=20, bad=0, backlog=backlog, arrivals=50)
    assert limiter.limit == 64 and limiter.state().keeps_up == 11  # 10 arriving a second × 1.04 s
    interval(good=4, bad=36)  # no cap, the queue gone: the most answers a second (8.0), 10 % good
    assert limiter.limit == 15  # ×0.75 of the 20 in flight
    interval(good=27, bad=3)  # 90 % good: 5.4 good/s, 6.0 answers/s
    assert limiter.limit == 11  # no lower than the cap that keeps up
    interval(good=10, bad=20)  # out of reach at the floor: back to what served best among those above it
    assert limiter.limit == 15, limiter.state().last_why
    assert "back to the cap that served best, 15 (5.40 good/s, 6.00 answers/s)" in limiter.state().last_why
