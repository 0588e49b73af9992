"""One generation request's timings as the door forwards it (door/proxy.py fills a `Meter`; core/slo.py
says how each figure counts), and vLLM's `usage` read from the end of its answer. The door's loop only;
kept apart from the proxy so that the hot path's bookkeeping is one small class with its own tests.
"""

from __future__ import annotations

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
        tokens = usage_tokens(self.prev[-4096:] + self.tail[-4096:]) if self.first is not None else None
        exact = tokens is not None
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
