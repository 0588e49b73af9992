"""The door times every generation request it answers (door/meter.py `Meter` → core/slo.RequestSample)
and hands the samples to the main loop in batches (`DoorRequests`, through `post`, as its other events):
streamed with and without usage, non-streamed, a cut stream, a refusal, a 4xx, the client's own clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.unit.test_door_rig import EVENT_LOOPS, door_loop, rig, run, until
from tunerd.core.slo import RequestSample
from tunerd.door import DoorRequests


@pytest.fixture(autouse=True, params=EVENT_LOOPS)
def each_event_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(door_loop, "kind", request.param)


def samples(events: list[object]) -> list[RequestSample]:
    return [s for e in events if isinstance(e, DoorRequests) for s in e.samples]


def test_each_generation_request_is_one_sample_with_its_tokens_and_times() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.upstream.chunks = 5
            r.upstream.plan = ["sse_usage", "stream", "ok_usage", "sse_cut", "bad400"]
            sent = time.monotonic()
            status, _, _ = await r.complete(1, stream=True)
            client_e2e = time.monotonic() - sent
            assert status == 200
            for n, stream in ((2, True), (3, False), (4, True), (5, False)):
                await r.complete(n, stream=stream)
            async with r.session.get(f"{r.url}/v1/models") as resp:  # not a generation request
                assert resp.status == 200
            got = await until(lambda: len(samples(r.events)) >= 4 and samples(r.events), "four samples")
            usage, counted, whole, cut = got
            assert len(got) == 4  # the 400 (the client's error) and the GET are not measured
            # Streamed, usage in the last event: vLLM's count; times on the door's clock, inside the client's.
            assert usage.streamed and usage.ok and (usage.tokens, usage.tokens_exact) == (5, True)
            assert usage.ttft_s is not None and 0 <= usage.ttft_s <= usage.e2e_s <= client_e2e
            assert usage.upstream_ttft_s is not None and usage.upstream_ttft_s <= usage.ttft_s
            assert usage.tpot_s is not None and usage.tpot_s >= 0 and usage.wait_s >= 0
            # Without usage: the data events less [DONE] (an estimate).
            assert counted.ok and (counted.tokens, counted.tokens_exact) == (5, False)
            # Non-streamed: TTFT is the end-to-end time, no TPOT.
            assert not whole.streamed and whole.ttft_s == whole.e2e_s and whole.tpot_s is None
            assert (whole.tokens, whole.tokens_exact) == (5, True)
            # A stream cut midway: not ok (it misses every target).
            assert cut.streamed and not cut.ok
            # Every request that came in is an arrival (the offered load: door.arrival_rate).
            assert r.door.drain_state().arrivals == 6

    run(scenario)


def test_a_refused_request_is_a_failed_sample_with_its_wait_in_the_door() -> None:
    async def scenario() -> None:
        async with rig(serving=False, hold_timeout_s=0.2) as r:
            status, _, _ = await r.complete(1)
            assert status == 503
            (refused,) = await until(lambda: samples(r.events), "the refusal's sample")
            assert not refused.ok and refused.ttft_s is None and refused.tokens is None
            assert refused.wait_s >= 0.2 and refused.e2e_s >= refused.wait_s
            assert r.door.drain_state().arrivals == 1  # a refused request arrived all the same

    run(scenario)


def test_the_wait_behind_the_cap_counts_in_the_clients_ttft() -> None:
    async def scenario() -> None:
        async with rig(max_in_flight=1) as r:
            r.upstream.plan = ["wait", "ok_usage"]
            first = asyncio.create_task(r.complete(1))
            await until(lambda: len(r.upstream.arrivals) == 1, "the first forwarded")
            second = asyncio.create_task(r.complete(2))
            await until(lambda: r.door.drain_state().queued == 1, "the second waiting in the door")
            r.upstream.gate("answer-1").set()
            await asyncio.gather(first, second)
            got = await until(lambda: len(samples(r.events)) == 2 and samples(r.events), "two samples")
            waited = next(s for s in got if s.wait_s > 0)
            assert waited.ttft_s is not None and waited.ttft_s >= waited.wait_s
            # vLLM's part of it excludes the door's wait: the two clocks differ by exactly that.
            assert waited.upstream_ttft_s is not None and waited.upstream_ttft_s < waited.ttft_s

    run(scenario)
