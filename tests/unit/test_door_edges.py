"""The front door's edges: clients that leave, bodies that break off or are too large, `Expect`, the stop,
leaving FATAL, and `DoorConfig` (tests/unit/test_door_rig.py has the rig)."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from tests.unit.test_door_rig import EVENT_LOOPS, door_loop, rig, run, until
from tunerd.door import Door, DoorConfig


@pytest.fixture(autouse=True, params=EVENT_LOOPS)
def each_event_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(door_loop, "kind", request.param)


def test_a_client_that_leaves_mid_stream_frees_its_slot_and_vllm_s_request() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.upstream.plan = ["sse"]
            async with r.session.post(f"{r.url}/v1/completions", json={"n": 1, "stream": True}) as resp:
                assert b'"i": 0' in await resp.content.readany()
                resp.close()  # the client hangs up after the first chunk
            await until(lambda: r.door.drain_state().in_flight == 0, "the slot freed")
            r.upstream.gate("chunk-1").set()
            await until(lambda: r.upstream.cancelled == 1, "the upstream request closed too")
            await until(lambda: r.count("client_gone") == 1)

    run(scenario)


def test_a_plain_answer_cut_midway_closes_the_connection_and_is_counted() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.upstream.plan = ["body_cut"]
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.complete(1)
            assert r.count("upstream_error") == 1 and r.count("replayed") == 0
            assert (await r.complete(2))[0] == 200  # the door serves on

    run(scenario)


def test_a_body_over_the_limit_gets_413_and_is_not_forwarded() -> None:
    async def scenario() -> None:
        async with rig(max_body_bytes=2048) as r:
            async with r.session.post(f"{r.url}/v1/completions", data=b"x" * 4096) as resp:
                assert resp.status == 413
            assert r.upstream.arrivals == [] and r.count("rejected_too_large") == 1

    run(scenario)


def test_expect_100_continue_is_answered_by_the_door() -> None:
    async def scenario() -> None:
        async with rig() as r:
            async with r.session.post(f"{r.url}/echo/x", data=b"hello", expect100=True) as resp:
                echoed = json.loads(await resp.read())
            assert resp.status == 200 and echoed["body"] == "hello"
            assert "expect" not in {k.lower() for k, _ in echoed["headers"]}

    run(scenario)


def test_stop_answers_what_waits_with_503_never_a_reset() -> None:
    async def scenario() -> None:
        async with rig(serving=False) as r:
            waiting = [asyncio.create_task(r.complete(n)) for n in range(3)]
            await until(lambda: r.door.drain_state().queued == 3)
            await asyncio.to_thread(r.door.stop)
            for status, headers, body in await asyncio.gather(*waiting):
                assert status == 503 and headers["Retry-After"] == "5"
                assert "tunerd is stopping" in json.loads(body)["error"]["message"]

    run(scenario)


def test_after_fatal_a_resumed_engine_serves_again() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.door.set_upstream(None, "fatal", "out_of_memory")
            assert (await r.complete(1))[0] == 503
            r.door.set_upstream(None, "down", "operator resume")  # `tunerd resume`: starting again
            task = asyncio.create_task(r.complete(2))
            await until(lambda: r.door.drain_state().queued == 1, "held again, not refused")
            r.serve()
            assert (await task)[0] == 200

    run(scenario)


def test_set_upstream_refuses_what_it_cannot_do() -> None:
    async def scenario() -> None:
        async with rig(serving=False) as r:
            with pytest.raises(ValueError, match="serving needs an upstream URL"):
                r.door.set_upstream(None, "serving")
            with pytest.raises(ValueError, match="unknown upstream state"):
                r.door.set_upstream(None, "crashed")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="at least 1"):
                r.door.set_max_in_flight(0)

    run(scenario)


def test_door_config_defaults_and_validation() -> None:
    config = DoorConfig()
    assert (config.enabled, config.host, config.port) == (False, "127.0.0.1", 8000)
    assert config.max_in_flight is None and config.max_prompt_tokens is None
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DoorConfig(max_inflight=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        DoorConfig(max_in_flight=0)
    with pytest.raises(ValidationError, match="frozen"):
        config.port = 9000  # type: ignore[misc]


def test_start_raises_in_the_caller_when_the_port_is_taken() -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        door = Door(DoorConfig(port=port), post=lambda e: None, registry=CollectorRegistry())
        with pytest.raises(OSError):
            door.start()
        door.stop()
