"""The benchmark probe: statistics, cache-cold prompts, and `run_probe` against a fake streaming server.

The fake server (http.server on a loopback port) streams SSE events in vLLM 0.32's form, as a real
0.32.0 server answered `POST /v1/completions` with `stream` and `include_usage`: one
`data: {"choices": [{"text": …, "finish_reason": null, …}]}` per token step, the last with
`finish_reason: "length"`, then `{"choices": [], "usage": {…}}`, then `data: [DONE]`; with
`continuous_usage_stats` each token step also carries the usage so far (vLLM's completion_stream_generator,
vllm/entrypoints/openai/completion/serving.py). Timings come from an injected clock that returns scripted
values; nothing waits on wall time except the one timeout test, whose server holds its answer until the
test ends.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fakes import make_rig
from tunerd.cli.probe import compare_with_baseline
from tunerd.cli.status import probe_line
from tunerd.config import ProbeConfig
from tunerd.core.signal_catalog import SIGNAL_NAMES
from tunerd.core.slo import Targets
from tunerd.faces.http import SHUTDOWN_POLL_S  # shutdown() waits up to one poll
from tunerd.observe.probe import (
    FIRST_TOKEN_ID,
    ProbeResult,
    RequestOutcome,
    cache_cold_prompts,
    head_tokens,
    probe_attainment,
    quantile,
    run_probe,
    summarize,
)
from tunerd.supervise.preflight import run_here
from tunerd.tune.prober import Prober

MODEL = "/models/qwen3-tiny"
VLLM_ERROR = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def token(text: str = "6", finish: str | None = None, so_far: int | None = None) -> dict[str, Any]:
    """A completion chunk as vLLM 0.32 streams it; `so_far`: the running usage (continuous_usage_stats)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL, "choices": [choice]}
    return chunk if so_far is None else {**chunk, "usage": totals(so_far)}


def totals(completion: int, prompt: int = 16) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def usage(completion: int, prompt: int = 16, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """The final usage event; `metrics`: vLLM's per-request metrics (--enable-per-request-metrics)."""
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
    event = {**head, "choices": [], "usage": totals(completion, prompt)}
    return event if metrics is None else {**event, "metrics": metrics}


def answer(tokens: int, *, per_chunk: int = 1, running: bool = False) -> list[Any]:
    """The events of a complete answer of `tokens` tokens, `per_chunk` tokens per event; `running`: each
    token event carries the usage so far."""
    chunks = tokens // per_chunk
    counts = [(i + 1) * per_chunk if running else None for i in range(chunks)]
    events: list[Any] = [token("6" * per_chunk, so_far=n) for n in counts[:-1]]
    return [*events, token("6" * per_chunk, "length", counts[-1]), usage(tokens), "[DONE]"]


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
        RequestOutcome(None, ttft=0.1, itl=0.01, tokens=4),
        RequestOutcome(None, ttft=0.3, itl=0.05, tokens=2),
        RequestOutcome("timeout after 5 s", ttft=2.0, itl=1.0, tokens=2),  # failed: its latencies left out
        RequestOutcome("HTTP 500: boom"),
        RequestOutcome(None, ttft=0.2, itl=None, tokens=1),  # one token: no inter-token latency
    ]
    result = summarize(outcomes, run_id=3, seed=9, started="t", seconds=2.0, cfg=cfg(requests=5))
    assert (result.requests, result.ok, result.tokens) == (5, 3, 9)
    assert result.errors == ("timeout after 5 s", "HTTP 500: boom")
    assert result.throughput == pytest.approx(4.5)
    assert result.ttft_p50 == pytest.approx(0.2)
    assert result.ttft_p95 == pytest.approx(0.2 + 0.1 * 0.9)
    assert result.itl_p50 == pytest.approx(0.03)  # one figure per request: 0.01 and 0.05
    assert result.itl_p95 == pytest.approx(0.01 + 0.04 * 0.95)
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
    expected = ("throughput", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "errors", "attainment")
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
    # each request's (last token event − first) / 2 tokens after the first: 0.3 / 2 and 0.4 / 2
    assert result.itl_p50 == pytest.approx(0.175)
    assert result.itl_p95 == pytest.approx(0.15 + 0.05 * 0.95)
    assert (result.prompt_tokens, result.max_tokens, result.concurrency) == (16, 3, 1)
    json.dumps(result.as_dict())  # the journal's record
    assert result.as_dict()["errors"] == []


@pytest.mark.parametrize(
    ("targets", "attainment"),
    [
        (Targets(ttft_s=0.3), 0.5),  # ttfts 0.5 and 0.2
        (Targets(tpot_s=0.16), 0.5),  # per-request times per output token 0.15 and 0.2
        (Targets(ttft_s=1.0, e2e_s=0.7), 0.5),  # [DONE] 0.8 and 0.6 after the send
        (Targets(ttft_s=1.0, tpot_s=1.0, e2e_s=1.0), 1.0),
        (Targets(), None),
    ],
)
def test_each_probe_request_is_judged_against_the_targets(
    serve: Callable[..., FakeServer], targets: Targets, attainment: float | None
) -> None:
    server = serve(lambda body: (200, answer(3)))
    clock = ScriptClock([0.0, 1.0, 1.5, 1.6, 1.8, 1.8, 1.8, 2.0, 2.2, 2.5, 2.6, 2.6, 2.6, 4.0])
    result = run_probe(7, server.url, MODEL, cfg(), seed=5, vocab=1024, clock=clock, targets=targets)
    assert result.attainment == attainment
    assert result.signals()["probe.attainment"] == attainment


def test_a_failed_probe_request_misses_every_target() -> None:
    outcomes = [
        RequestOutcome(None, ttft=0.1, itl=0.01, tokens=4, e2e=0.2),
        RequestOutcome("HTTP 500: boom"),
        RequestOutcome(None, ttft=0.1, itl=None, tokens=1, e2e=0.1),  # one token: TPOT not judged
    ]
    assert probe_attainment(outcomes, Targets(ttft_s=0.5, tpot_s=0.05)) == pytest.approx(2 / 3)
    assert probe_attainment([], Targets(ttft_s=0.5)) is None


def test_requests_sent_as_specified(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (200, answer(3)))
    result = run_probe(1, server.url, MODEL, cfg(requests=3), seed=11, vocab=1024)
    assert result.ok == 3
    prompts = cache_cold_prompts(11, 3, 16, 1024)
    assert sorted(b["prompt"] for b in server.bodies) == sorted(prompts)
    for body in server.bodies:
        assert body["model"] == MODEL
        options = {"include_usage": True, "continuous_usage_stats": True}
        assert body["stream"] is True and body["stream_options"] == options
        assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 3


def test_several_tokens_per_chunk_time_per_token_from_running_usage(serve: Callable[..., FakeServer]) -> None:
    # 12 tokens, one every 50 ms from 0.1 s, sent 3 to an event (vLLM merges the deltas of a stream whose
    # consumer lags): each event leaves when its third token is made, at 0.2, 0.35, 0.5 and 0.65 s.
    server = serve(lambda body: (200, answer(12, per_chunk=3, running=True)))
    clock = ScriptClock([0.0, 0.0, 0.2, 0.35, 0.5, 0.65, 0.65, 0.65, 1.0])
    result = run_probe(1, server.url, MODEL, cfg(requests=1, max_tokens=12), seed=1, vocab=1024, clock=clock)
    assert result.tokens == 12 and result.throughput == pytest.approx(12.0)
    assert result.ttft_p50 == pytest.approx(0.2)
    # 0.45 s for the 9 tokens after the first event's 3; the gap between events (0.15 s) is 3 tokens' time
    assert result.itl_p50 == pytest.approx(0.05) and result.itl_p95 == pytest.approx(0.05)


def test_several_tokens_per_chunk_with_final_usage_only(serve: Callable[..., FakeServer]) -> None:
    # No running counts: the first event is taken for one token, vLLM's (last − first) / (n − 1).
    server = serve(lambda body: (200, answer(6, per_chunk=2)))
    clock = ScriptClock([0.0, 0.0, 0.4, 0.6, 0.9, 0.9, 0.9, 1.0])
    result = run_probe(1, server.url, MODEL, cfg(requests=1, max_tokens=6), seed=1, vocab=1024, clock=clock)
    assert result.tokens == 6 and result.throughput == pytest.approx(6.0)
    assert result.ttft_p50 == pytest.approx(0.4)
    assert result.itl_p50 == pytest.approx(0.5 / 5)  # not the gaps between chunks (0.2, 0.3)


def test_events_delivered_in_bursts(serve: Callable[..., FakeServer]) -> None:
    # A CPU-starved API server delivers one-token events in bursts: two bursts of 4, 70 ms apart, with
    # 10 µs between the events of a burst. The gaps' median is 10 µs; the time per token is 10 ms.
    server = serve(lambda body: (200, answer(8, running=True)))
    burst = [1.0 + i * 1e-5 for i in range(4)]
    tokens = [*burst, *(t + 0.07 for t in burst)]
    clock = ScriptClock([0.0, 0.5, *tokens, tokens[-1], tokens[-1], 2.0])
    result = run_probe(1, server.url, MODEL, cfg(requests=1, max_tokens=8), seed=1, vocab=1024, clock=clock)
    assert result.errors == () and result.tokens == 8
    assert result.itl_p50 == pytest.approx(0.07 / 7 + 3e-5 / 7)


def test_the_servers_own_per_request_timing_wins(serve: Callable[..., FakeServer]) -> None:
    # With --enable-per-request-metrics the usage event carries vLLM's mean_itl_ms: its own
    # (last_token_ts − first_token_ts) / (n − 1), free of how the events reach the probe.
    events = [
        *answer(3)[:-2],
        usage(3, metrics={"mean_itl_ms": 25.0, "time_to_first_token_ms": 9.0}),
        "[DONE]",
    ]
    server = serve(lambda body: (200, events))
    clock = ScriptClock([0.0, 0.0, 0.1, 0.1, 0.1, 0.1, 0.1, 1.0])
    result = run_probe(1, server.url, MODEL, cfg(requests=1), seed=1, vocab=1024, clock=clock)
    assert result.itl_p50 == pytest.approx(0.025)
    assert result.ttft_p50 == pytest.approx(0.1)  # the probe's own: vLLM's leaves out the queue


def test_one_event_has_no_inter_token_latency(serve: Callable[..., FakeServer]) -> None:
    server = serve(lambda body: (200, answer(4, per_chunk=4, running=True)))
    result = run_probe(1, server.url, MODEL, cfg(requests=1, max_tokens=4), seed=1, vocab=1024)
    assert result.ok == 1 and result.tokens == 4 and result.ttft_p50 is not None
    assert result.itl_p50 is None and result.itl_p95 is None


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


# -- `tunerd probe --baseline`: the figures against the baseline's -----------------------------------


def test_baseline_comparison_never_shows_a_small_figure_as_zero() -> None:
    # issue 20: "itl_p95 1.5 ms = 86.42× the baseline's 0.0" — the baseline was 17.4 µs, not zero
    result = {"throughput": 978.3, "ttft_p95": 0.2363, "itl_p95": 0.0015}
    baseline = {"probe.throughput": 852.2, "probe.ttft_p95": 0.1149, "probe.itl_p95": 0.0000174}
    line = compare_with_baseline(result, baseline)
    assert "throughput 978.3 tok/s = 1.15× the baseline's 852.2" in line
    assert "ttft_p95 236.3 ms = 2.06× the baseline's 114.9" in line
    assert "itl_p95 1.5 ms = 86.21× the baseline's 0.0174" in line
    assert "the baseline's 0.0;" not in line and not line.endswith("the baseline's 0.0")


@pytest.mark.parametrize(
    ("figure", "expected"),
    [
        (0.0, "itl_p95 1.5 ms (baseline 0 ms: no ratio)"),
        (None, "itl_p95 1.5 ms (no baseline figure)"),
        ("0.002", "itl_p95 1.5 ms (no baseline figure)"),
        (float("nan"), "itl_p95 1.5 ms (no baseline figure)"),
    ],
)
def test_baseline_comparison_without_a_usable_baseline_gives_no_ratio(figure: Any, expected: str) -> None:
    baseline = {"probe.throughput": 852.2, "probe.itl_p95": figure}
    line = compare_with_baseline({"throughput": 900.0, "itl_p95": 0.0015}, baseline)
    assert expected in line
    assert "itl_p95 1.5 ms =" not in line and "inf" not in line
    assert "ttft_p95 ? (no baseline figure)" in line


def test_baseline_comparison_without_a_figure_now() -> None:
    line = compare_with_baseline({"itl_p95": None}, {"probe.itl_p95": 0.004})
    assert "itl_p95 ? (baseline 4.0 ms: no ratio)" in line and "×" not in line
    assert compare_with_baseline({"itl_p95": 0.001}, {}).startswith("baseline: none with probe figures")


def test_probe_line_shows_a_time_per_token_of_a_few_ms() -> None:
    figures = {
        "throughput": 978.3,
        "ttft_p50": 0.129,
        "ttft_p95": 0.236,
        "itl_p50": 0.0037,
        "itl_p95": 0.0052,
    }
    line = probe_line({**figures, "errors": [], "requests": 8})
    assert line == "978.3 tok/s, TTFT p50/p95 129/236 ms, ITL p50/p95 3.7/5.2 ms, 0 errors of 8 requests"
    line = probe_line({**figures, "errors": [], "requests": 8, "attainment": 0.875})
    assert line.endswith("0 errors of 8 requests, 87.5% within the targets")


def test_the_prober_hands_the_objectives_targets_to_the_probe(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {"objective": {"ttft_s": 1.5, "tpot_s": 0.05}, "probe": {"enabled": True}})
    rig.serve()
    asked: list[dict[str, Any]] = []

    def measure(run_id: int, base_url: str, model: str, cfg: ProbeConfig, **kwargs: Any) -> ProbeResult:
        asked.append(kwargs)
        return summarize([], run_id=run_id, seed=1, started="t", seconds=1.0, cfg=cfg)

    prober = Prober(rig.config, rig.lifecycle, recorder=rig.recorder, submit=run_here, vocab=lambda: 1000,
                    monotonic=rig.clock, run=measure)  # fmt: skip
    prober.request("test", lambda result, error: None, remember=False)
    assert asked and asked[0]["targets"] == Targets(ttft_s=1.5, tpot_s=0.05)
