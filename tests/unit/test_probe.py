"""The benchmark probe: statistics, cache-cold prompts, and `run_probe` against a fake streaming server.

The fake server (http.server on a loopback port) streams SSE events in vLLM 0.32's form, as a real
0.32.0 server answered `POST /v1/completions` with `stream` and `include_usage`: one
`data: {"choices": [{"text": …, "finish_reason": null, …}]}` per token step, the last with
`finish_reason: "length"`, then `{"choices": [], "usage": {…}}`, then `data: [DONE]`. Timings come from an
injected clock that returns scripted values; nothing waits on wall time except the one timeout test,
whose server holds its answer until the test ends.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tunerd.config import ProbeConfig
from tunerd.core.signal_catalog import SIGNAL_NAMES
from tunerd.faces.http import SHUTDOWN_POLL_S  # shutdown() waits up to one poll
from tunerd.observe.probe import (
    FIRST_TOKEN_ID,
    RequestOutcome,
    cache_cold_prompts,
    head_tokens,
    quantile,
    run_probe,
    summarize,
)

MODEL = "/models/qwen3-tiny"
VLLM_ERROR = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def token(text: str = "6", finish: str | None = None) -> dict[str, Any]:
    """A completion chunk as vLLM 0.32 streams it."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL, "choices": [choice]}


def usage(completion: int, prompt: int = 16) -> dict[str, Any]:
    totals = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
    return {**head, "choices": [], "usage": totals}


def answer(tokens: int, *, per_chunk: int = 1) -> list[Any]:
    """The events of a complete answer of `tokens` tokens, `per_chunk` tokens per event."""
    chunks = tokens // per_chunk
    events: list[Any] = [token("6" * per_chunk) for _ in range(chunks - 1)]
    return [*events, token("6" * per_chunk, "length"), usage(tokens), "[DONE]"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (the timeout test)


class FakeServer:
    """Answers `POST /v1/completions` with `respond(body)`: (status, events) — events are dicts (sent
    as JSON), strings (sent as is after `data: `) or a threading.Event to wait on before the rest."""

    def __init__(self, respond: Callable[[dict[str, Any]], tuple[int, list[Any]]]) -> None:
        self.respond = respond
        self.bodies: list[dict[str, Any]] = []
        self.release = threading.Event()  # set at teardown: frees a handler that holds its answer
        self.inflight = self.max_inflight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with server._lock:
                    server.bodies.append(body)
                    server.inflight += 1
                    server.max_inflight = max(server.max_inflight, server.inflight)
                try:
                    status, events = server.respond(body)
                    self._answer(status, events)
                finally:
                    with server._lock:
                        server.inflight -= 1

            def _answer(self, status: int, events: list[Any]) -> None:
                if status != 200:
                    data = json.dumps(events[0] if events else {}).encode()
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for event in events:
                    if isinstance(event, threading.Event):
                        event.wait()
                        continue
                    text = event if isinstance(event, str) else json.dumps(event)
                    data = f"data: {text}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def start(respond: Callable[[dict[str, Any]], tuple[int, list[Any]]]) -> FakeServer:
        servers.append(FakeServer(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


class ScriptClock:
    """Returns the scripted times in order; a call past the script fails the probe (and the test)."""

    def __init__(self, times: list[float]) -> None:
        self.times = list(times)
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        if not self.times:
            raise AssertionError(f"clock read {self.calls} times, more than scripted")
        return self.times.pop(0)


def cfg(**changes: Any) -> ProbeConfig:
    return ProbeConfig(**{"prompt_tokens": 16, "max_tokens": 3, "requests": 2, "concurrency": 1, **changes})


# -- statistics -------------------------------------------------------------------------------------


def test_quantile_matches_statistics_inclusive() -> None:
    rng = random.Random(7)
    for size in (2, 3, 5, 10, 37):
        values = [rng.expovariate(20.0) for _ in range(size)]
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        for i in (1, 5, 25, 50, 75, 95, 99):
            assert quantile(values, i / 100) == pytest.approx(cuts[i - 1])


def test_quantile_edges() -> None:
    assert quantile([], 0.5) is None
    assert quantile([0.25], 0.95) == 0.25
    assert quantile([3.0, 1.0, 2.0], 0.0) == 1.0
    assert quantile([3.0, 1.0, 2.0], 1.0) == 3.0
    assert quantile([1.0, 2.0], 0.5) == 1.5
    with pytest.raises(ValueError):
        quantile([1.0], 1.5)


def test_summarize_synthetic_timings() -> None:
    outcomes = [
        RequestOutcome(None, ttft=0.1, gaps=(0.01, 0.02, 0.03), tokens=4),
        RequestOutcome(None, ttft=0.3, gaps=(0.05,), tokens=2),
        RequestOutcome(
            "timeout after 5 s", ttft=2.0, gaps=(1.0,), tokens=2
        ),  # failed: its latencies left out
        RequestOutcome("HTTP 500: boom"),
    ]
    result = summarize(outcomes, run_id=3, seed=9, started="t", seconds=2.0, cfg=cfg(requests=4))
    assert (result.requests, result.ok, result.tokens) == (4, 2, 8)
    assert result.errors == ("timeout after 5 s", "HTTP 500: boom")
    assert result.throughput == pytest.approx(4.0)
    assert result.ttft_p50 == pytest.approx(0.2)
    assert result.ttft_p95 == pytest.approx(0.1 + 0.2 * 0.95)
    assert result.itl_p50 == pytest.approx(0.025)  # of 0.01 0.02 0.03 0.05
    assert result.itl_p95 == pytest.approx(0.03 + 0.02 * 0.85)
    assert result.signals()["probe.errors"] == 2.0
    assert not result.no_tokens


def test_summarize_without_data() -> None:
    result = summarize([RequestOutcome("HTTP 500")], run_id=1, seed=1, started="t", seconds=1.0, cfg=cfg())
    assert result.no_tokens and result.throughput is None
    assert (result.ttft_p50, result.ttft_p95, result.itl_p50, result.itl_p95) == (None, None, None, None)


def test_signal_names_are_the_catalogs() -> None:
    result = summarize([], run_id=1, seed=1, started="t", seconds=1.0, cfg=cfg())
    names = set(result.signals())
    assert names == {n for n in SIGNAL_NAMES if n.startswith("probe.")} - {"probe.age_s"}
    expected = ("throughput", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "errors")
    assert names == {f"probe.{name}" for name in expected}


# -- cache-cold prompts -----------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_prompts_reproducible_and_in_range() -> None:
    prompts = cache_cold_prompts(42, 8, 128, 1024)
    assert prompts == cache_cold_prompts(42, 8, 128, 1024)
    assert len(prompts) == 8 and all(len(p) == 128 for p in prompts)
    assert all(FIRST_TOKEN_ID <= t <= 1023 for p in prompts for t in p)
    assert cache_cold_prompts(42, 8, 128, 1024) != cache_cold_prompts(43, 8, 128, 1024)


@pytest.mark.parametrize("vocab", [1024, 32000, 151936])
def test_two_runs_share_no_prefix(vocab: int) -> None:
    head = head_tokens(8, vocab)
    assert head <= 8  # shorter than any KV block vLLM uses (16 on GPU by default, 32 on CPU)
    rng = random.Random(1)
    seeds = [*range(40), *(rng.getrandbits(64) for _ in range(20)), 2**64 - 1]
    runs = {seed: cache_cold_prompts(seed, 8, 64, vocab) for seed in seeds}
    for a in seeds:
        for b in seeds:
            for i, pa in enumerate(runs[a]):
                for j, pb in enumerate(runs[b]):
                    if (a, i) == (b, j):
                        continue
                    assert common_prefix(pa, pb) < head, (a, i, b, j)
                    if (a - b) % (vocab - FIRST_TOKEN_ID):
                        assert pa[0] != pb[0], (a, i, b, j)


def test_prompt_arguments() -> None:
    assert cache_cold_prompts(1, 0, 16, 1024) == []
    assert [len(p) for p in cache_cold_prompts(1, 2, 3, 1024)] == [3, 3]  # the head is truncated
    with pytest.raises(ValueError):
        cache_cold_prompts(1, 1, 16, 11)


# -- run_probe against a fake server -----------------------------------------------------------------


def test_figures_from_known_chunk_timings(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (200, answer(3)))
    # start; request 1 sent, its 5 data lines (3 tokens, usage, [DONE]); request 2 likewise; end.
    clock = ScriptClock([0.0, 1.0, 1.5, 1.6, 1.8, 1.8, 1.8, 2.0, 2.2, 2.5, 2.6, 2.6, 2.6, 4.0])
    result = run_probe(7, server.url, MODEL, cfg(), seed=5, vocab=1024, clock=clock)
    assert result.errors == ()
    assert (result.run_id, result.seed, result.requests, result.ok, result.tokens) == (7, 5, 2, 2, 6)
    assert result.seconds == 4.0
    assert result.throughput == pytest.approx(1.5)
    assert result.ttft_p50 == pytest.approx(0.35)  # ttfts 0.5 and 0.2
    assert result.ttft_p95 == pytest.approx(0.2 + 0.3 * 0.95)
    assert result.itl_p50 == pytest.approx(0.15)  # gaps 0.1 0.2 0.3 0.1
    assert result.itl_p95 == pytest.approx(0.2 + 0.1 * 0.85)
    assert (result.prompt_tokens, result.max_tokens, result.concurrency) == (16, 3, 1)
    json.dumps(result.as_dict())  # the journal's record
    assert result.as_dict()["errors"] == []


def test_requests_sent_as_specified(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (200, answer(3)))
    result = run_probe(1, server.url, MODEL, cfg(requests=3), seed=11, vocab=1024)
    assert result.ok == 3
    prompts = cache_cold_prompts(11, 3, 16, 1024)
    assert sorted(b["prompt"] for b in server.bodies) == sorted(prompts)
    for body in server.bodies:
        assert body["model"] == MODEL
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 3


def test_several_tokens_per_chunk_counted_from_usage(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (200, answer(6, per_chunk=2)))
    clock = ScriptClock([0.0, 0.0, 0.4, 0.6, 0.9, 0.9, 0.9, 1.0])
    result = run_probe(1, server.url, MODEL, cfg(requests=1, max_tokens=6), seed=1, vocab=1024, clock=clock)
    assert result.tokens == 6 and result.throughput == pytest.approx(6.0)
    assert result.ttft_p50 == pytest.approx(0.4)
    assert result.itl_p50 == pytest.approx(0.25)  # two gaps (0.2, 0.3) between three chunks


def test_without_usage_chunk_counts_token_events(serve: Callable[..., FakeServer]) -> None:
    # The fake vLLM's form: one chunk per token, then an empty closing chunk, no usage.
    events = [token("y"), token("y"), token("y"), token("", "length"), "[DONE]"]
    server = serve(lambda body: (200, events))
    clock = ScriptClock([0.0, 0.0, 0.1, 0.2, 0.3, 0.9, 0.9, 1.0])
    result = run_probe(1, server.url, MODEL, cfg(requests=1), seed=1, vocab=1024, clock=clock)
    assert result.tokens == 3
    assert result.itl_p95 == pytest.approx(0.1)  # the empty closing chunk is no token


def test_concurrency_is_kept(serve: Callable[..., FakeServer]) -> None:
    # Two requests must be in flight together to pass the barrier; a broken barrier answers 500.
    barrier = threading.Barrier(2, timeout=30)

    def respond(body: dict[str, Any]) -> tuple[int, list[Any]]:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return 500, [VLLM_ERROR]
        return 200, answer(3)

    server = serve(respond)
    result = run_probe(1, server.url, MODEL, cfg(requests=4, concurrency=2), seed=1, vocab=1024)
    assert result.errors == () and result.ok == 4 and result.tokens == 12
    assert server.max_inflight == 2


def test_request_that_times_out_is_an_error(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (200, [server.release, *answer(3)]))  # held until the test ends
    result = run_probe(1, server.url, MODEL, cfg(requests=1, timeout_s=0.2), seed=1, vocab=1024)
    assert result.ok == 0 and result.errors == ("timeout after 0.2 s",)
    assert result.no_tokens and result.signals()["probe.errors"] == 1.0


def test_server_error_500(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (500, [VLLM_ERROR]))
    result = run_probe(1, server.url, MODEL, cfg(requests=3, concurrency=2), seed=1, vocab=1024)
    assert result.ok == 0 and len(result.errors) == 3
    assert all(e.startswith("HTTP 500: EngineCore encountered an issue") for e in result.errors)
    assert result.no_tokens and result.throughput is None
    assert result.signals()["probe.errors"] == 3.0


def test_stream_that_carries_no_token(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (200, [usage(0), "[DONE]"]))
    result = run_probe(1, server.url, MODEL, cfg(), seed=1, vocab=1024)
    assert result.no_tokens and result.throughput is None and result.ttft_p50 is None
    assert result.errors == ()  # HTTP 200 to [DONE]: not an error, but no token (a wedge with /health 200)


def test_error_mid_stream(serve: Callable[..., FakeServer]) -> None:
    # sigterm_shutdown_notes.txt: HTTP 200, token chunks, then an error event, then [DONE].
    server = serve(lambda body: (200, [token(), token(), VLLM_ERROR, "[DONE]"]))
    result = run_probe(1, server.url, MODEL, cfg(requests=1), seed=1, vocab=1024)
    assert result.ok == 0 and result.tokens == 2
    assert result.errors[0].startswith("stream error: EngineCore encountered")


def test_stream_cut_before_done(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (200, [token(), token()]))
    result = run_probe(1, server.url, MODEL, cfg(requests=1), seed=1, vocab=1024)
    assert result.errors == ("stream ended without [DONE]",) and result.tokens == 2


def test_connection_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    result = run_probe(1, f"http://127.0.0.1:{port}", MODEL, cfg(), seed=1, vocab=1024)
    assert result.ok == 0 and len(result.errors) == 2
    assert all(e.startswith("connection: ConnectError") for e in result.errors)


def test_never_raises_on_bad_arguments() -> None:
    result = run_probe(1, "http://127.0.0.1:9", MODEL, cfg(), seed=1, vocab=5)
    assert result.ok == 0 and result.errors[0].startswith("probe failed: ValueError")
    assert result.signals()["probe.errors"] == 2.0
