"""The rig the door's tests share (no tests here): a scriptable fake upstream (an aiohttp app on a
loopback port, on the test's own event loop), the door itself in its thread, and `until` — waiting for a
condition, never for a fixed time.

The fake upstream answers `POST /v1/completions` by the next step of its `plan` (default "ok"); every
other path echoes the request (method, path and query, headers, body) as JSON, with the status and extra
headers the request asks for (`X-Want-Status`, `X-Want-Header-*`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from tunerd.door import Door, DoorConfig

ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
GUARD_S = 60.0  # only a hang guard: a test that waits this long has failed
EVENT_LOOPS = ("asyncio", "uvloop")  # the door's loop; the tests run on both


async def until(condition: Callable[[], Any], what: str = "condition") -> Any:
    """Wait until `condition()` is truthy (polled every 2 ms) and return it; fail after GUARD_S."""
    deadline = time.monotonic() + GUARD_S
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)
    return value


@dataclass
class Arrival:
    body: dict[str, Any]
    at: float


@dataclass
class Upstream:
    """A fake vLLM. `plan`: what the next completions requests get, in order ("ok", "sse" (each chunk
    after the test opens its gate), "stream", "wait", "close", "dead500", "body_cut", "sse_dead", "sse_cut",
    "sse_eof", "ok_usage" (with vLLM's `usage`: `chunks` completion tokens), "sse_usage" (a stream whose last
    event is the usage one, as with `stream_options.include_usage`), "bad400"); then "ok". `gates[name]`
    are events the test sets; `sent` records when each SSE chunk left."""

    plan: list[str] = field(default_factory=list)
    arrivals: list[Arrival] = field(default_factory=list)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    sent: list[tuple[str, float]] = field(default_factory=list)
    chunks: int = 3
    health: int = 200
    cancelled: int = 0  # completions whose client (the door) went away while they were answered
    url: str = ""
    _runner: web.AppRunner | None = None

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health)

    async def _echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.arrivals.append(Arrival({"path": request.path}, time.monotonic()))
        if request.headers.get("X-Want-Close"):
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        doc = {
            "method": request.method,
            "path_qs": request.raw_path,
            "headers": [[k, v] for k, v in request.headers.items()],
            "body": body.decode(errors="replace"),
        }
        headers = [
            (k[len("X-Want-Header-") :], v)
            for k, v in request.headers.items()
            if k.startswith("X-Want-Header-")
        ]
        status = int(request.headers.get("X-Want-Status", "200"))
        response = web.Response(status=status, body=json.dumps(doc).encode(), content_type="application/json")
        for k, v in headers:
            response.headers.add(k, v)
        return response

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._complete(request)
        except (asyncio.CancelledError, ConnectionResetError):
            # Cancelled when aiohttp saw the door hang up while the handler waited; a write that found
            # the connection closed when it saw it only after (a busy box: 2 of 5 runs under CI's load).
            self.cancelled += 1
            raise

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.arrivals.append(Arrival(body, time.monotonic()))
        step = self.plan.pop(0) if self.plan else "ok"
        if step == "wait":
            await self.gate(f"answer-{body.get('n')}").wait()
            step = "ok"
        if step == "ok":
            return web.json_response(
                {"n": body.get("n"), "choices": [{"text": "y", "finish_reason": "length"}]}
            )
        usage = {"prompt_tokens": 4, "total_tokens": 4 + self.chunks, "completion_tokens": self.chunks}
        if step == "ok_usage":
            choices = [{"text": "y" * self.chunks, "finish_reason": "length"}]
            return web.json_response({"n": body.get("n"), "choices": choices, "usage": usage})
        if step == "bad400":
            err = {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": err}, status=400)
        if step == "close":
            assert request.transport is not None
            request.transport.close()  # the upstream dies before answering: the client sees a disconnect
            return web.Response()
        if step == "dead500":
            return web.json_response(ENGINE_DEAD, status=500)
        if step == "body_cut":  # a plain answer that breaks off after its headers and a few bytes
            out = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "1000"})
            await out.prepare(request)
            await out.write(b'{"n": 1, ')
            assert request.transport is not None
            request.transport.abort()
            return out
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if step == "sse_dead":  # vLLM after its engine died: an error event, then [DONE]
            await out.write(b"data: " + json.dumps(ENGINE_DEAD).encode() + b"\n\ndata: [DONE]\n\n")
            return out
        for i in range(self.chunks):
            if i > 0 and step == "sse":
                await self.gate(f"chunk-{i}").wait()
            if i == 2 and step == "sse_cut":
                assert request.transport is not None
                request.transport.abort()  # a reset mid-stream
                return out
            self.sent.append((f"chunk-{i}", time.monotonic()))
            await out.write(f'data: {{"n": {body.get("n")}, "i": {i}}}\n\n'.encode())
        if step == "sse_eof":  # the stream ends without [DONE] (a plain close of an unframed body)
            await out.write_eof()
            return out
        if step == "sse_usage":
            await out.write(b'data: {"choices": [], "usage": ' + json.dumps(usage).encode() + b"}\n\n")
        await out.write(b"data: [DONE]\n\n")
        return out


class door_loop:  # a namespace the tests' fixture sets
    kind: str = "auto"


@dataclass
class Rig:
    door: Door
    upstream: Upstream
    events: list[object]
    registry: CollectorRegistry
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        host, port = self.door.address
        return f"http://{host}:{port}"

    def count(self, outcome: str) -> float:
        value = self.registry.get_sample_value("tunerd_door_requests_total", {"outcome": outcome})
        return value or 0.0

    def serve(self) -> None:
        self.door.set_upstream(self.upstream.url, "serving")

    async def complete(self, n: int, **extra: Any) -> tuple[int, dict[str, str], bytes]:
        """POST /v1/completions through the door; (status, headers, body)."""
        async with self.session.post(
            f"{self.url}/v1/completions", json={"n": n, "prompt": "x", **extra}
        ) as r:
            return r.status, dict(r.headers), await r.read()


@contextlib.asynccontextmanager
async def rig(serving: bool = True, model_dir: Any = None, **config: Any) -> AsyncIterator[Rig]:
    """A started door in front of a started fake upstream; stopped (both) at the end. `config`: DoorConfig
    fields (`event_loop` from the test's parameter, see `door_loop`)."""
    upstream = Upstream()
    await upstream.start()
    events: list[object] = []
    registry = CollectorRegistry()
    settings = {"port": 0, "event_loop": door_loop.kind, **config}
    door = Door(DoorConfig(**settings), post=events.append, registry=registry, model_dir=model_dir)
    door.start()
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    the_rig = Rig(door, upstream, events, registry, session)
    if serving:
        the_rig.serve()
    try:
        yield the_rig
    finally:
        await session.close()
        door.stop()
        await upstream.stop()


def run(scenario: Callable[[], Any]) -> None:
    """Run an async test scenario on a fresh event loop (the door has its own, in its thread)."""
    asyncio.run(scenario())
