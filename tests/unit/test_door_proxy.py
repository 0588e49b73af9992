"""The front door in-process against a fake upstream: pass-through, streaming without buffering, holding,
refusals with Retry-After, replay of a cut request, cut streams, the in-flight cap, the drain, metrics.

Every wait is for a condition (`until`), never for a time; the door runs in its own thread and loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from structlog.testing import capture_logs
from yarl import URL

from tests.unit.test_door_rig import ENGINE_DEAD, EVENT_LOOPS, door_loop, rig, run, until
from tunerd.door import DoorDrained, DoorReleased


@pytest.fixture(autouse=True, params=EVENT_LOOPS)
def each_event_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs with the door on asyncio's loop and on uvloop ("auto" picks it where installed)."""
    monkeypatch.setattr(door_loop, "kind", request.param)


# -- pass-through --------------------------------------------------------------------------------------


def test_methods_paths_query_headers_bodies_and_status_pass_through_unchanged() -> None:
    async def scenario() -> None:
        async with rig() as r:
            body = bytes(range(256)) * 4
            for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
                headers = [
                    ("Authorization", "Bearer sk-secret"),
                    ("X-Custom", "one"),
                    ("X-Custom", "two"),
                    ("Connection", "keep-alive, X-Hop"),
                    ("X-Hop", "for this hop only"),
                    ("Keep-Alive", "timeout=5"),
                    ("TE", "trailers"),
                    ("Proxy-Authorization", "Basic cHJveHk="),
                    ("X-Want-Status", "418"),
                    ("X-Want-Header-Set-Cookie", "a=1"),
                    ("X-Want-Header-Set-Cookie", "b=2"),
                ]
                url = URL(f"{r.url}/echo/a%20b/%2F?x=1&y=%2Fz&x=3", encoded=True)  # sent as written
                async with r.session.request(method, url, headers=headers, data=body) as resp:
                    assert resp.status == 418
                    assert resp.headers.getall("Set-Cookie") == ["a=1", "b=2"]
                    echoed = json.loads(await resp.read())
                assert echoed["method"] == method
                assert echoed["path_qs"] == "/echo/a%20b/%2F?x=1&y=%2Fz&x=3"
                assert echoed["body"] == body.decode(errors="replace")
                seen = [(k.lower(), v) for k, v in echoed["headers"]]
                assert ("authorization", "Bearer sk-secret") in seen
                assert [v for k, v in seen if k == "x-custom"] == ["one", "two"]
                for hop in ("connection", "x-hop", "keep-alive", "te", "proxy-authorization"):
                    assert hop not in {k for k, _ in seen}, hop
            async with r.session.head(f"{r.url}/echo/head") as resp:
                assert resp.status == 200
                assert await resp.read() == b""
            assert r.count("forwarded") == 7

    run(scenario)


def test_sse_chunks_arrive_one_by_one_without_buffering() -> None:
    """The upstream sends a chunk, then waits for the test to see it through the door before the next:
    a door that buffered would never deliver the first (and the test would fail on its guard)."""

    async def scenario() -> None:
        async with rig() as r:
            r.upstream.plan = ["sse"]
            received: list[tuple[bytes, float]] = []
            async with r.session.post(f"{r.url}/v1/completions", json={"n": 1, "stream": True}) as resp:
                assert resp.headers["Content-Type"] == "text/event-stream"
                async for chunk in resp.content.iter_any():
                    received.append((chunk, time.monotonic()))
                    i = len(received)
                    if i < r.upstream.chunks:
                        assert f'"i": {i - 1}'.encode() in chunk
                        r.upstream.gate(f"chunk-{i}").set()  # only now may the upstream send the next
            sent = dict(r.upstream.sent)
            assert received[0][1] < sent["chunk-1"] and received[1][1] < sent["chunk-2"]
            assert b"".join(c for c, _ in received).endswith(b"data: [DONE]\n\n")
            assert r.count("stream_cut") == 0

    run(scenario)


# -- holding while vLLM is down ------------------------------------------------------------------------


def test_held_while_down_then_released_in_arrival_order() -> None:
    async def scenario() -> None:
        async with rig(serving=False, max_in_flight=1) as r:
            tasks = []
            for n in range(5):
                tasks.append(asyncio.create_task(r.complete(n)))
                await until(lambda n=n: r.door.drain_state().queued == n + 1, "request queued")
            assert r.upstream.arrivals == []
            r.serve()
            answers = await asyncio.gather(*tasks)
            assert [status for status, _, _ in answers] == [200] * 5
            assert [a.body["n"] for a in r.upstream.arrivals] == [0, 1, 2, 3, 4]
            released = [e for e in r.events if isinstance(e, DoorReleased)]
            assert released[0].waiting == 5 and released[0].replays == 0
            assert r.count("held") == 5 and r.count("released") == 5

    run(scenario)


def test_queue_full_gets_503_with_retry_after() -> None:
    async def scenario() -> None:
        async with rig(serving=False, max_queue=2, retry_after_s=7) as r:
            waiting = [asyncio.create_task(r.complete(n)) for n in range(2)]
            await until(lambda: r.door.drain_state().queued == 2, "two queued")
            status, headers, body = await r.complete(3)
            assert status == 503 and headers["Retry-After"] == "7"
            assert "max_queue = 2" in json.loads(body)["error"]["message"]
            assert r.count("rejected_queue_full") == 1
            r.serve()
            assert [s for s, _, _ in await asyncio.gather(*waiting)] == [200, 200]

    run(scenario)


def test_hold_timeout_gets_503_with_retry_after() -> None:
    async def scenario() -> None:
        async with rig(serving=False, hold_timeout_s=0.2) as r:
            r.door.set_upstream(None, "down", "engine restarting")
            status, headers, body = await r.complete(1)
            assert status == 503 and headers["Retry-After"] == "5"
            assert "hold_timeout_s = 0.2" in json.loads(body)["error"]["message"]
            assert r.count("rejected_hold_timeout") == 1 and r.upstream.arrivals == []
            assert r.door.drain_state().queued == 0

    run(scenario)


def test_fatal_answers_waiting_and_new_requests_503_with_the_reason() -> None:
    async def scenario() -> None:
        async with rig(serving=False) as r:
            waiting = [asyncio.create_task(r.complete(n)) for n in range(2)]
            await until(lambda: r.door.drain_state().queued == 2, "two queued")
            r.door.set_upstream(None, "fatal", "kv_cache_too_small: rolled back and failed again")
            answers = [*await asyncio.gather(*waiting), await r.complete(3)]
            for status, headers, body in answers:
                assert status == 503 and headers["Retry-After"] == "5"
                assert "kv_cache_too_small: rolled back" in json.loads(body)["error"]["message"]
            assert r.count("rejected_fatal") == 3 and r.upstream.arrivals == []

    run(scenario)


# -- a crash cannot drain: replay, cut streams ----------------------------------------------------------


def test_request_cut_before_any_byte_is_replayed_once_vllm_serves_again() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.upstream.health = 503  # the engine is dead: the door's probe does not release the request
            r.upstream.plan = ["close"]
            task = asyncio.create_task(r.complete(1))
            await until(lambda: len(r.upstream.arrivals) == 1 and r.door.drain_state().queued == 1, "cut")
            r.door.set_upstream(None, "down", "engine_dead")
            assert not task.done() and len(r.upstream.arrivals) == 1
            r.upstream.health = 200
            r.serve()  # a new serving epoch: the cut request goes first
            status, _, body = await task
            assert status == 200 and json.loads(body)["n"] == 1
            assert len(r.upstream.arrivals) == 2
            assert r.count("replayed") == 1 and r.count("forwarded") == 2
            released = [e for e in r.events if isinstance(e, DoorReleased)]
            assert released[-1].replays == 1

    run(scenario)


def test_engine_dead_answers_are_replayed_and_a_probe_releases_them_without_a_restart() -> None:
    """vLLM's EngineDeadError 500, and a stream whose first event is that error, reached no client
    byte: both are replayed; here the upstream's /health says 200, so the door's probe releases them."""

    async def scenario() -> None:
        async with rig() as r:
            r.upstream.plan = ["dead500", "ok", "sse_dead", "stream"]
            status, _, body = await r.complete(1)
            assert status == 200 and json.loads(body)["n"] == 1
            _, _, stream = await r.complete(2, stream=True)
            assert b'"error"' not in stream and stream.endswith(b"data: [DONE]\n\n")
            assert len(r.upstream.arrivals) == 4 and r.count("replayed") == 2

    run(scenario)


def test_a_request_cut_twice_gets_503_and_is_not_sent_a_third_time() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.upstream.plan = ["close", "close"]
            status, headers, body = await r.complete(1)
            assert status == 503 and headers["Retry-After"] == "5"
            assert "cut twice" in json.loads(body)["error"]["message"]
            assert len(r.upstream.arrivals) == 2 and r.count("upstream_error") == 1

    run(scenario)


def test_a_non_replayable_request_cut_gets_503_and_is_not_replayed() -> None:
    async def scenario() -> None:
        async with rig() as r:
            url = f"{r.url}/v1/load_lora_adapter"
            async with r.session.post(url, json={}, headers={"X-Want-Close": "1"}) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "5"
            assert len(r.upstream.arrivals) == 1 and r.count("replayed") == 0

    run(scenario)


def test_a_stream_cut_midway_ends_with_an_error_event_and_done() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.upstream.plan = ["sse_cut", "sse_eof"]
            for n in (1, 2):
                status, _, body = await r.complete(n, stream=True)
                assert status == 200
                events = [e for e in body.split(b"\n\n") if e]
                assert events[0].startswith(b"data: {") and b'"i": 1' in events[1]
                assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == 500
                assert events[-1] == b"data: [DONE]"
            assert r.count("stream_cut") == 2 and r.count("replayed") == 0

    run(scenario)


def test_a_stream_vllm_ends_with_its_own_error_event_passes_through_counted() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.upstream.plan = ["sse_dead", "sse_dead"]  # the replay meets a dead engine again
            _, _, body = await r.complete(1, stream=True)
            assert body == b"data: " + json.dumps(ENGINE_DEAD).encode() + b"\n\ndata: [DONE]\n\n"
            assert r.count("stream_cut") == 1 and r.count("replayed") == 1

    run(scenario)


# -- admission: prompt length, the in-flight cap ---------------------------------------------------------


def write_word_tokenizer(directory) -> None:  # type: ignore[no-untyped-def]
    """A tokenizer.json that makes one token of each whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_too_long_prompts_are_refused_naming_the_limit_and_never_forwarded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    write_word_tokenizer(tmp_path)

    async def scenario() -> None:
        async with rig(model_dir=tmp_path, max_prompt_tokens=5) as r:
            r.door.set_max_model_len(32)
            await until(
                lambda: r.door.limits_state().tokenizer_loaded and r.door.limits_state().max_model_len
            )
            status, _, body = await r.complete(1, prompt="w " * 6)
            error = json.loads(body)["error"]
            assert status == 413 and error["param"] == "max_prompt_tokens"
            assert "6 tokens" in error["message"] and "limit of 5 tokens" in error["message"]
            status, _, body = await r.complete(2, prompt=[[1] * 3, [1] * 7])  # a batch: its longest counts
            assert status == 413
            status, _, body = await r.complete(3, prompt="w", max_tokens=33)
            assert status == 400 and "max_tokens=33 cannot be greater than max_model_len=32" in body.decode()
            chat = {"messages": [{"role": "user", "content": "a " * 4}, {"role": "user", "content": "b b"}]}
            async with r.session.post(f"{r.url}/v1/chat/completions", json=chat) as resp:
                assert resp.status == 413 and "6 tokens" in (await resp.text())
            assert r.upstream.arrivals == [] and r.count("rejected_too_long") == 4
            status, _, _ = await r.complete(4, prompt="w " * 5, max_tokens=30)  # vLLM clamps max_tokens
            assert status == 200 and len(r.upstream.arrivals) == 1

    run(scenario)


def test_without_a_door_limit_the_max_model_len_in_force_applies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    write_word_tokenizer(tmp_path)

    async def scenario() -> None:
        async with rig(model_dir=tmp_path) as r:
            r.door.set_max_model_len(4)
            await until(
                lambda: r.door.limits_state().tokenizer_loaded and r.door.limits_state().max_model_len
            )
            status, _, body = await r.complete(1, prompt="a a a a a", max_tokens=1)
            assert status == 400 and "maximum context length is 4 tokens" in body.decode()
            assert "contains 5 input tokens" in body.decode()
            r.door.set_max_model_len(8)  # a new engine start with a longer max_model_len
            await until(lambda: r.door.limits_state().max_model_len == 8)
            assert (await r.complete(2, prompt="a a a a a", max_tokens=1))[0] == 200

    run(scenario)


def test_without_the_tokenizers_package_the_door_says_at_start_what_is_off_and_the_remedy(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # tunerd installed alone (`install.sh --engine none`, vLLM elsewhere) had no `tokenizers`: the door
    # warned `door.no_tokenizer` with "No module named 'tokenizers'" and nothing said admission was off.
    write_word_tokenizer(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError

    async def scenario() -> None:
        with capture_logs() as logs:
            async with rig(model_dir=tmp_path, max_prompt_tokens=5) as r:
                [warning] = await until(
                    lambda: [e for e in logs if e["event"] == "door.no_tokenizer"], "door.no_tokenizer"
                )
                assert not r.door.limits_state().tokenizer_loaded
                assert (await r.complete(1, prompt="w " * 6))[0] == 200  # not counted: what is off
        assert warning["log_level"] == "warning" and warning["model_dir"] == str(tmp_path)
        assert "tokenizers" in warning["error"]
        assert warning["off"].startswith("prompt-length admission is off: max_prompt_tokens is not enforced")
        assert "pip install 'vllm-tunerd[door]'" in warning["remedy"]

    run(scenario)


def test_a_model_dir_without_tokenizer_json_names_what_is_off_but_no_package_remedy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        with capture_logs() as logs:
            async with rig(model_dir=tmp_path):
                [warning] = await until(lambda: [e for e in logs if e["event"] == "door.no_tokenizer"])
        assert "no tokenizer.json" in warning["error"] and "admission is off" in warning["off"]
        assert "remedy" not in warning

    run(scenario)


def test_the_cap_changes_on_the_running_door_without_dropping_a_request() -> None:
    async def scenario() -> None:
        async with rig(max_in_flight=2) as r:
            r.upstream.plan = ["wait"] * 6
            tasks = [asyncio.create_task(r.complete(n)) for n in range(6)]
            state = r.door.drain_state
            await until(
                lambda: len(r.upstream.arrivals) == 2 and state().queued == 4, "2 forwarded, 4 queued"
            )
            r.door.set_max_in_flight(1)  # lower: the two in flight go on, nothing new is forwarded
            await until(lambda: state().max_in_flight == 1)
            r.upstream.gate(f"answer-{r.upstream.arrivals[0].body['n']}").set()
            await until(lambda: state().in_flight == 1, "one finished")
            assert len(r.upstream.arrivals) == 2  # still over the new cap's room
            r.upstream.gate(f"answer-{r.upstream.arrivals[1].body['n']}").set()
            await until(lambda: len(r.upstream.arrivals) == 3, "the next one forwarded under cap 1")
            r.door.set_max_in_flight(10)  # higher: every waiting one goes at once
            await until(lambda: len(r.upstream.arrivals) == 6, "all forwarded")
            for arrival in r.upstream.arrivals:
                r.upstream.gate(f"answer-{arrival.body['n']}").set()
            assert [s for s, _, _ in await asyncio.gather(*tasks)] == [200] * 6
            assert r.registry.get_sample_value("tunerd_door_max_in_flight") == 10

    run(scenario)


# -- the drain before a planned restart -------------------------------------------------------------------


def test_drain_waits_for_in_flight_to_reach_zero_while_new_requests_wait() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.upstream.plan = ["wait"] * 3
            busy = [asyncio.create_task(r.complete(n)) for n in range(3)]
            await until(lambda: r.door.drain_state().in_flight == 3, "three in flight")
            assert r.registry.get_sample_value("tunerd_door_in_flight") == 3
            r.door.set_upstream(None, "draining", "planned restart")
            await until(lambda: r.door.drain_state().draining_since is not None)
            late = asyncio.create_task(r.complete(9))
            await until(lambda: r.door.drain_state().queued == 1, "the late one waits")
            assert r.registry.get_sample_value("tunerd_door_queue_length") == 1
            for n in range(3):
                r.upstream.gate(f"answer-{n}").set()
            drained = await until(lambda: [e for e in r.events if isinstance(e, DoorDrained)], "drained")
            assert drained == [DoorDrained("idle", 3, 3, 0, 1, drained[0].seconds)]
            assert [s for s, _, _ in await asyncio.gather(*busy)] == [200] * 3
            assert len(r.upstream.arrivals) == 3 and not late.done()
            r.door.set_upstream(None, "down", "restarting")
            r.serve()
            assert (await late)[0] == 200 and r.count("drain_cut") == 0

    run(scenario)


def test_what_the_drain_timeout_cuts_is_counted_and_reported() -> None:
    async def scenario() -> None:
        async with rig(drain_timeout_s=0.05) as r:
            r.upstream.plan = ["wait"]
            task = asyncio.create_task(r.complete(1))
            await until(lambda: r.door.drain_state().in_flight == 1)
            r.door.set_upstream(None, "draining", "planned restart")
            drained = await until(lambda: [e for e in r.events if isinstance(e, DoorDrained)], "drain end")
            assert drained[0].ended == "timeout" and drained[0].cut == 1 and drained[0].finished == 0
            assert r.count("drain_cut") == 1
            r.upstream.gate("answer-1").set()  # here the engine let it finish after all
            assert (await task)[0] == 200

    run(scenario)


def test_a_client_that_leaves_while_waiting_is_forgotten() -> None:
    async def scenario() -> None:
        async with rig(serving=False) as r:
            task = asyncio.create_task(r.complete(1))
            await until(lambda: r.door.drain_state().queued == 1)
            task.cancel()
            await until(lambda: r.door.drain_state().queued == 0, "queue empty again")
            await until(lambda: r.count("client_gone") == 1)
            r.serve()
            assert (await r.complete(2))[0] == 200
            assert [a.body["n"] for a in r.upstream.arrivals] == [2]

    run(scenario)


def test_added_latency_and_hold_time_are_observed() -> None:
    async def scenario() -> None:
        async with rig() as r:
            for n in range(3):
                assert (await r.complete(n))[0] == 200
            added = r.registry.get_sample_value
            await until(
                lambda: added("tunerd_door_added_latency_seconds_count") == 3, "observed after the send"
            )
            r.door.set_upstream(None, "down")
            task = asyncio.create_task(r.complete(9))
            await until(lambda: r.door.drain_state().queued == 1)
            r.serve()
            assert (await task)[0] == 200
            assert r.registry.get_sample_value("tunerd_door_hold_seconds_count") == 1

    run(scenario)
