"""The bench's loads (tests/load.py) against the fake vLLM: an open loop sends on its arrivals whatever is
in flight and counts every answer; its arrivals are a seeded Poisson process; a closed loop with a think
time pauses between a client's requests."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from itertools import islice, pairwise

from tests.harness import wait_until
from tests.integration import test_fake_vllm
from tests.integration.test_fake_vllm import Fake
from tests.load import ClosedLoopLoad, OpenLoopLoad, arrival_gaps

start_fake = test_fake_vllm.start_fake  # the fixture: fakes started as the supervisor starts vLLM


def test_the_arrivals_are_a_seeded_poisson_process() -> None:
    gaps = list(islice(arrival_gaps(4.0, seed=7), 20_000))
    assert abs(statistics.fmean(gaps) - 0.25) < 0.01
    assert abs(statistics.stdev(gaps) - 0.25) < 0.01  # exponential: the spread equals the mean
    assert list(islice(arrival_gaps(4.0, seed=7), 5)) == gaps[:5]
    assert list(islice(arrival_gaps(4.0, seed=8), 5)) != gaps[:5]


def test_an_open_loop_sends_on_arrival_and_counts_every_answer(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake()
    fake.wait_ready()
    load = OpenLoopLoad(fake.url(""), "model", rate_per_s=40.0, max_tokens=8, stream=True, seed=3)
    with load:
        wait_until(lambda: load.sent >= 40, 60, "40 arrivals")
    stats = load.stats  # stopped: the requests in flight were answered first
    assert load.sent >= 40 and load.dropped == 0 and not stats.errors
    assert stats.ok == load.sent and len(stats.streamed) == load.sent
    assert all(ttft >= 0 for _, ttft, _ in stats.streamed)


def test_an_open_loop_beyond_its_outstanding_limit_drops_arrivals_instead_of_waiting(
    start_fake: Callable[..., Fake],
) -> None:
    fake = start_fake()
    fake.wait_ready()
    # 2 at once, each answer long (400 tokens): arrivals at 50/s find both slots taken.
    load = OpenLoopLoad(fake.url(""), "model", rate_per_s=50.0, max_tokens=400, max_outstanding=2, seed=4)
    with load:
        wait_until(lambda: load.dropped >= 10, 60, "10 dropped arrivals")
    assert load.sent >= 2 and load.stats.ok + len(load.stats.errors) == load.sent


def test_a_closed_loop_with_a_think_time_pauses_between_a_clients_requests(
    start_fake: Callable[..., Fake],
) -> None:
    fake = start_fake()
    fake.wait_ready()
    load = ClosedLoopLoad(fake.url(""), "model", clients=1, think_s=0.3, max_tokens=4, stream=True, seed=5)
    with load:
        wait_until(lambda: len(load.stats.streamed) >= 6, 60, "6 answers")
    ends = [done for done, _, _ in load.stats.streamed]
    gaps = [b - a for a, b in pairwise(ends)]
    assert statistics.fmean(gaps) > 0.1  # the pauses (mean 0.3 s) between one client's answers
