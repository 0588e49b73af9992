"""One request through the door: admission, the wait for a slot, the forward to vLLM, the answer streamed
back chunk by chunk — and the replay of an attempt the upstream cut before any byte reached the client.

aiohttp on both sides (server: the low-level `web.Server`; client: one `ClientSession` with a keep-alive
pool to vLLM); no HTTP is parsed here. Runs in the door's event loop only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from tunerd.core.slo import RequestSample
from tunerd.door.admission import PromptLimits
from tunerd.door.gate import Gate, Refused, Ticket
from tunerd.door.meter import Meter
from tunerd.door.metrics import DoorMetrics

# RFC 9110 §7.6.1: connection-specific fields a proxy must not forward, plus the ones a `Connection`
# header names. `Proxy-Authorization` is meant for the proxy (the door takes none); `Authorization` is
# the client's and is forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Also dropped from requests: aiohttp sets Content-Length from the body the door read; the door answered
# `Expect: 100-continue` itself (aiohttp's server does) and holds the whole body.
REQUEST_DROPPED = HOP_BY_HOP | {"content-length", "expect"}
# Replay-safe: generation and other requests that carry no server state (docs/door.md), and every
# GET/HEAD/OPTIONS (safe methods, RFC 9110 §9.2.1).
REPLAYABLE_POST = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/score",
        "/score",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/pooling",
        "/classify",
        "/tokenize",
        "/detokenize",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    }
)
SAFE_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))
# Streams of these paths end with `data: [DONE]` (OpenAI's protocol); a cut one gets an error event, then it.
DONE_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
DONE = b"data: [DONE]\n\n"
# vLLM's EngineDeadError message (vllm/v1/engine/exceptions.py): what in-flight requests get, as an HTTP 500
# or as a stream's error event, when its engine core dies or it is shut down (sigterm_shutdown_notes.txt).
ENGINE_DEAD = b"EngineCore encountered an issue"
UPSTREAM_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)
log = structlog.get_logger("tunerd")
MAX_REPLAYS = 1  # "exactly once": a request that kills the engine each time is not sent a third time


class _Answer(web.StreamResponse):
    """vLLM's answer as it goes out. The headers leave with the first chunk of the body, in one send, as
    aiohttp's own `Response` does (a send on loopback costs more than the rest of the door's work per
    request); the door prepares an answer only once that first chunk is there, so nothing waits."""

    _send_headers_immediately = False


class _ClientGone(Exception):
    """Writing to the client failed: it hung up (not an upstream error)."""

    def __init__(self, answer: web.StreamResponse) -> None:
        super().__init__("the client hung up")
        self.answer = answer


@dataclass(frozen=True)
class _Cut:
    """The upstream cut this attempt before any byte reached the client."""

    detail: str


class Proxy:
    """The request handler (`handle`) of the door's aiohttp server."""

    def __init__(
        self,
        gate: Gate,
        limits: PromptLimits,
        metrics: DoorMetrics,
        session: aiohttp.ClientSession,
        config,
        record: Callable[[RequestSample], None] | None = None,
    ) -> None:
        self.gate, self.limits, self.metrics, self.session = gate, limits, metrics, session
        self.record = record  # each generation request's RequestSample (the door batches them for the loop)
        self.retry_after = str(config.retry_after_s)
        self.loop = gate.loop
        self.probe: asyncio.Task[None] | None = None

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        arrived = time.monotonic()
        seq = self.gate.next_seq()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            self.metrics.count("rejected_too_large")
            return self._json(413, exc.text or "request body too large", "RequestTooLarge")
        path = request.path
        kind = self.limits.applies(path) if request.method == "POST" else None
        if kind is not None:
            # A long body is tokenized off the loop: the door keeps serving others meanwhile.
            if len(body) > 32 << 10:
                too_long = await self.loop.run_in_executor(None, self.limits.check, kind, body)
            else:
                too_long = self.limits.check(kind, body)
            if too_long is not None:
                self.metrics.count("rejected_too_long")
                return web.Response(
                    status=too_long.status, body=too_long.body(), content_type="application/json"
                )
        replayable = request.method in SAFE_METHODS or (request.method == "POST" and path in REPLAYABLE_POST)
        headers = request_headers(request.headers)
        # Generation requests are timed (core/slo.py): the client's TTFT, TPOT, e2e and the door's wait.
        meter = (
            Meter() if self.record is not None and path in DONE_PATHS and request.method == "POST" else None
        )
        cut_epoch: int | None = None
        replays = 0
        while True:
            waiting_since = time.monotonic() if meter is not None else 0.0
            try:
                granted = self.gate.acquire(seq, cut_epoch)
                ticket = granted if isinstance(granted, Ticket) else await self.gate.wait(granted)
            except Refused as refusal:
                self.metrics.count(refusal.outcome)
                if meter is not None:
                    meter.ok = False  # refused: the client got no answer
                    meter.waited += time.monotonic() - waiting_since
                    self._measured(meter, arrived, time.monotonic())
                return self._unavailable(refusal.message)
            if meter is not None:
                meter.waited += time.monotonic() - waiting_since
            if cut_epoch is not None:
                self.metrics.count("replayed")
            final = not replayable or replays >= MAX_REPLAYS
            try:
                result = await self._attempt(request, ticket, body, headers, arrived, final, meter)
            except asyncio.CancelledError:
                self.metrics.count("client_gone")  # not measured: it says nothing of the server's speed
                raise
            finally:
                self.gate.release(ticket)
            if not isinstance(result, _Cut):
                if meter is not None:
                    self._finished(meter, arrived, result)
                return result
            if final:
                self.metrics.count("upstream_error")
                if meter is not None:
                    meter.ok = False
                    self._measured(meter, arrived, time.monotonic())
                why = "was cut twice" if replayable else "is not replayed on this endpoint"
                return self._unavailable(
                    f"vLLM went away before answering ({result.detail}); the request {why}"
                )
            replays += 1
            cut_epoch = ticket.epoch
            self._ensure_probe()

    # -- per-request measurement -------------------------------------------------------------------

    def _finished(self, meter: Meter, arrived: float, answer: web.StreamResponse) -> None:
        """An answer went out: record it unless the client hung up (not the server's speed) or vLLM
        refused the request as invalid (a 4xx: the client's error, not a latency)."""
        status = answer.status
        if meter.gone or (meter.ok and 400 <= status < 500):
            return
        if status >= 500:
            meter.ok = False
        self._measured(meter, arrived, time.monotonic())

    def _measured(self, meter: Meter, arrived: float, done: float) -> None:
        assert self.record is not None
        self.record(meter.sample(arrived, done))

    # -- one attempt -----------------------------------------------------------------------------

    async def _attempt(
        self,
        request: web.BaseRequest,
        ticket: Ticket,
        body: bytes,
        headers: CIMultiDict[str],
        arrived: float,
        final: bool,
        meter: Meter | None = None,
    ) -> web.StreamResponse | _Cut:
        """Forward once. Returns the answer (sent) or a _Cut (nothing sent; not when `final`: then a 5xx
        passes through and a connection failure is a _Cut the caller answers with 503)."""
        self.metrics.count("forwarded")
        try:
            return await self._forward(request, ticket, body, headers, arrived, final, meter)
        except _ClientGone as gone:
            self.metrics.count("client_gone")  # nobody to answer; vLLM's request is closed with ours
            gone.answer.force_close()
            if meter is not None:
                meter.gone = True  # not measured: the client's hang-up is not the server's speed
            return gone.answer

    async def _forward(
        self,
        request: web.BaseRequest,
        ticket: Ticket,
        body: bytes,
        headers: CIMultiDict[str],
        arrived: float,
        final: bool,
        meter: Meter | None = None,
    ) -> web.StreamResponse | _Cut:
        """The forward itself (see `_attempt`); a failed write to the client raises _ClientGone. `meter`
        (generation requests): the answer's timings, filled once the attempt is the answer (not a _Cut)."""
        out: web.StreamResponse | None = None
        done_path = request.path in DONE_PATHS
        sse = False
        sent = time.monotonic()
        try:
            async with self.session.request(
                request.method,
                URL(ticket.url + request.raw_path, encoded=True),
                headers=headers,
                data=body or None,
                allow_redirects=False,
            ) as up:
                if up.status >= 500:
                    first = await up.read()  # an error answer is small: read it whole to judge it
                    if self._went_away(ticket, first):
                        if not final:
                            return _Cut(f"HTTP {up.status}")
                        self.metrics.count("upstream_error")  # cut again: vLLM's own answer goes through
                else:
                    first = await up.content.readany()
                upstream_ttfb = time.monotonic() - sent
                sse = up.content_type == "text/event-stream"
                if (
                    sse
                    and not final
                    and first.startswith(b'data: {"error"')
                    and self._went_away(ticket, first)
                ):
                    return _Cut("an error event before any token")
                out = _Answer(status=up.status, reason=up.reason, headers=response_headers(up.headers))
                await self._send(out.prepare(request), out)
                if first:
                    await self._send(out.write(first), out)
                self.metrics.added.observe(max(0.0, time.monotonic() - arrived - upstream_ttfb))
                if meter is not None:
                    meter.sse, meter.upstream_ttft = sse, upstream_ttfb
                    if first:
                        meter.first = meter.last = time.monotonic()
                        meter.events = first.count(b"data: ")
                        meter.tail = first
                tail = first[-len(DONE) :]
                if sse and ENGINE_DEAD in first:
                    self.metrics.count("stream_cut")
                    if meter is not None:
                        meter.ok = False
                async for chunk in up.content.iter_any():
                    await self._send(out.write(chunk), out)
                    tail = (tail + chunk)[-len(DONE) :]
                    if meter is not None:  # a few attribute writes and one C scan of the chunk
                        meter.last = time.monotonic()
                        if meter.first is None:
                            meter.first = meter.last
                        meter.events += chunk.count(b"data: ")
                        meter.prev, meter.tail = meter.tail, chunk
                    if sse and ENGINE_DEAD in chunk:
                        self.metrics.count("stream_cut")  # vLLM ended it cleanly itself: error event, [DONE]
                        if meter is not None:
                            meter.ok = False
                if sse and done_path and tail != DONE and up.status < 300:
                    await self._end_cut_stream(out, "the stream ended without [DONE]", meter=meter)
                await self._send(out.write_eof(), out)
                return out
        except UPSTREAM_ERRORS as exc:
            detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
            if out is None:
                return _Cut(detail)
            if sse:
                await self._end_cut_stream(out, detail, done_path, meter=meter)
                await self._send(out.write_eof(), out)
                return out
            # A plain body cut midway cannot be mended: the connection is closed (the client sees a short
            # body, never a hang).
            self.metrics.count("upstream_error")
            if meter is not None:
                meter.ok = False
            log.warning("door.body_cut", path=request.path, error=detail)
            out.force_close()
            return out

    async def _end_cut_stream(
        self, out: web.StreamResponse, detail: str, done: bool = True, *, meter: Meter | None = None
    ) -> None:
        """A stream the upstream cut after it had started: an error event (vLLM's shape), then the end."""
        self.metrics.count("stream_cut")
        if meter is not None:
            meter.ok = False
        message = f"vLLM went away mid-stream ({detail}); tunerd's front door ended the stream"
        error = {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}
        await self._send(
            out.write(b"data: " + json.dumps(error).encode() + b"\n\n" + (DONE if done else b"")), out
        )

    @staticmethod
    async def _send(write: Awaitable[None], out: web.StreamResponse) -> None:
        """One write to the client; its failure means the client hung up (not an upstream error)."""
        try:
            await write
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one too
            raise _ClientGone(out) from exc

    def _went_away(self, ticket: Ticket, answer: bytes) -> bool:
        """A 5xx (or a first error event) is the engine going away — replayable — when it carries vLLM's
        EngineDeadError message or the loop has said since that this upstream is going or gone."""
        gate = self.gate
        return ENGINE_DEAD in answer or gate.state != "serving" or gate.epoch != ticket.epoch

    # -- the /health probe after a cut -----------------------------------------------------------

    def _ensure_probe(self) -> None:
        if self.probe is None or self.probe.done():
            self.probe = self.loop.create_task(self._probe())

    async def _probe(self) -> None:
        """While requests cut in this serving epoch wait: ask the upstream's /health (every 0.5 s). A 200
        means the cut was not the engine's death (a keep-alive race, a transient): replay them now."""
        gate = self.gate
        while gate.wants_probe():
            epoch, url, sent = gate.epoch, gate.url, time.monotonic()
            try:
                async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                    ok = r.status == 200
            except UPSTREAM_ERRORS:
                ok = False
            if ok:
                gate.confirm_alive(epoch, sent)
                return
            await asyncio.sleep(0.5)

    # -- the door's own answers --------------------------------------------------------------------

    def _unavailable(self, message: str) -> web.Response:
        response = self._json(503, message, "ServiceUnavailable")
        response.headers["Retry-After"] = self.retry_after
        return response

    @staticmethod
    def _json(status: int, message: str, kind: str) -> web.Response:
        error = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return web.Response(status=status, body=json.dumps(error).encode(), content_type="application/json")


def _without_hop_by_hop(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """`headers` less `drop` and whatever their `Connection` header names; repeated fields kept in order."""
    named = {t.strip().lower() for v in headers.getall("Connection", ()) for t in v.split(",")}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop and k.lower() not in named)


def request_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """The client's headers for vLLM: all but hop-by-hop ones and those the door re-frames."""
    return _without_hop_by_hop(headers, REQUEST_DROPPED)


def response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """vLLM's headers for the client: all but hop-by-hop ones (aiohttp frames the body itself)."""
    return _without_hop_by_hop(headers, HOP_BY_HOP)
