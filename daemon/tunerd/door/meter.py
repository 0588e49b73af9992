"""One generation request's timings as the door forwards it (door/proxy.py fills a `Meter`; core/slo.py
says how each figure counts), and vLLM's `usage` read from the end of its answer. The door's loop only;
kept apart from the proxy so that the hot path's bookkeeping is one small class with its own tests.
"""

from __future__ import annotations

import re

from tunerd.core.slo import RequestSample, tpot


class Meter:
    """One generation request's timings as it goes (door's loop only): filled by `_forward`, turned into a
    `RequestSample` (core/slo.py) when the answer ends. `first`/`last`: monotonic times of the first and
    the latest body bytes; `events`: SSE `data: ` events seen; `tail`/`prev`: the last two body chunks
    (kept by reference; vLLM's `usage` is in the answer's last event or object, read once at the end)."""

    __slots__ = ("events", "first", "gone", "last", "ok", "prev", "sse", "tail", "upstream_ttft", "waited")

    def __init__(self) -> None:
        self.waited = 0.0
        self.gone = False
        self.first: float | None = None
        self.last = 0.0
        self.upstream_ttft: float | None = None
        self.events = 0
        self.sse = False
        self.ok = True
        self.prev = self.tail = b""

    def sample(self, arrived: float, done: float) -> RequestSample:
        """What the request measured (see core/slo.py for how each figure counts)."""
        # `usage` ends the answer (a few hundred bytes): at most 8 KiB are copied, once a request.
        end = self.prev[-4096:] + self.tail[-4096:] if self.first is not None else b""
        tokens = usage_tokens(end) if end else None
        exact = tokens is not None
        split = vllm_split(end, tokens) if end else None
        if tokens is None and self.sse and self.first is not None:
            # No `usage` (the client did not ask for stream_options.include_usage): count token events,
            # less `[DONE]` — an estimate, and an undercount when one event carries several tokens.
            tokens = max(0, self.events - 1)
        first = self.first
        ttft = None if first is None else (first if self.sse else done) - arrived
        return RequestSample(
            done=done,
            wait_s=self.waited,
            upstream_ttft_s=self.upstream_ttft,
            ttft_s=ttft,
            tokens=tokens,
            tokens_exact=exact,
            tpot_s=tpot(first, self.last, tokens) if self.sse and first is not None else None,
            e2e_s=done - arrived,
            streamed=self.sse,
            ok=self.ok,
            queue_s=split[0] if split else None,
            prefill_s=split[1] if split else None,
            decode_s=split[2] if split else None,
        )


USAGE_KEY = b'"completion_tokens":'


def usage_tokens(tail: bytes) -> int | None:
    """`usage.completion_tokens` of the last usage object in `tail` (vLLM's final stream event with
    `stream_options.include_usage`, or a whole answer's `usage`), None when there is none."""
    at = tail.rfind(USAGE_KEY)
    if at < 0:
        return None
    digits = tail[at + len(USAGE_KEY) :].lstrip()[:12]
    end = 0
    while end < len(digits) and 48 <= digits[end] <= 57:
        end += 1
    return int(digits[:end]) if end else None


METRICS_KEY = b'"metrics":'
_NUMBER = rb"\s*(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)"
_MS = {
    name: re.compile(b'"' + name.encode() + b'":' + _NUMBER)
    for name in ("queue_time_ms", "time_to_first_token_ms", "mean_itl_ms")
}


def vllm_split(tail: bytes, tokens: int | None) -> tuple[float | None, float | None, float | None] | None:
    """(queue, prefill, decode) seconds from the last `metrics` object in `tail` — what vLLM adds to an
    answer with `--enable-per-request-metrics` (vllm-facts.md: `queue_time_ms`, `time_to_first_token_ms`
    from scheduling, `generation_time_ms`, `mean_itl_ms`; streamed, on the final usage chunk only). None
    when the tail has no `metrics` object. Decode = mean ITL × (tokens − 1), only with `tokens` from
    `usage` (None below 2 tokens); `generation_time_ms` is not used: its span is not documented.
    """
    at = tail.rfind(METRICS_KEY)
    if at < 0:
        return None
    body = tail[at + len(METRICS_KEY) :]
    close = body.find(b"}")
    body = body[: close if close >= 0 else len(body)]  # the flat object only: no key of a later one
    found = {name: _ms(pattern, body) for name, pattern in _MS.items()}
    itl = found["mean_itl_ms"]
    decode = itl * (tokens - 1) if itl is not None and tokens is not None and tokens >= 2 else None
    return found["queue_time_ms"], found["time_to_first_token_ms"], decode


def _ms(pattern: re.Pattern[bytes], body: bytes) -> float | None:
    m = pattern.search(body)
    if m is None:
        return None
    value = float(m.group(1)) / 1000.0
    return value if value >= 0 else None
