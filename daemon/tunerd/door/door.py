"""The front door: its own asyncio event loop in a daemon thread, and the thread-safe surface the main
loop uses.

Why a thread with its own loop: the main loop blocks (a journal fsync, a `/proc` read, a stop's reap),
and a request must never wait for that; nor may the door's traffic slow the loop. The two share nothing
mutable: every method below only schedules work on the door's loop (`call_soon_threadsafe`) or returns an
immutable snapshot, and the door talks back only through `post(event)` (events.py), which puts the event
on the main loop's queue.

Over 400 lines: it is that one surface — each thread-safe method and the loop-side half it schedules,
the server's life, and the cap's controller the door's timer steps — and what it wires lives elsewhere
(gate.py, proxy.py, limit.py, admission.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from tunerd.config.door import DoorConfig
from tunerd.core.slo import RequestSample, Targets
from tunerd.door.admission import PromptLimits, no_tokenizer_fields
from tunerd.door.events import DoorFailed, DoorLimit, DoorRequests, DrainState, LimitsState, UpstreamState
from tunerd.door.gate import Gate
from tunerd.door.limit import Goodput, LimitLog, LimitState, Static
from tunerd.door.metrics import DoorMetrics
from tunerd.door.proxy import Proxy

log = structlog.get_logger("tunerd")
STATES = ("serving", "draining", "down", "fatal")
# vLLM's uvicorn closes an idle keep-alive connection after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); the door
# stops reusing one well before, so it never sends on a connection the server is closing.
UPSTREAM_KEEPALIVE_S = 2.0
# Per-request samples go to the main loop in batches (one event a second, not one per request), or at once
# when a batch is this large (a burst): the loop's queue and the batch stay small.
BATCH_S = 1.0
BATCH_MAX = 4096
# The steered cap's moves reach the journal (`door.limit`) at most this often, summed (door/limit.LimitLog).
LIMIT_LOG_S = 30.0


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A fresh loop for the door's thread (never installed as a policy: the rest of the process keeps
    asyncio's). "auto": uvloop when importable."""
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class Door:
    """Clients → `config.host:config.port` → the upstream URL the main loop sets (vLLM on loopback).

    Starts in state "down" with no upstream: requests wait (up to `hold_timeout_s`) until the loop calls
    `set_upstream(url, "serving")`. Thread-safe: `set_upstream`, `set_max_in_flight`, `set_late_after`,
    `steer`, `set_limit_bounds`, `set_targets`, `set_max_model_len`, `set_model_dir`, `drain_state`,
    `limits_state`, `limit_state`, `address`, `stop`; `start` once, from the thread that owns the door.

    The in-flight cap is a controller of the door's loop (door/limit.py): a fixed value (`[door]
    max_in_flight`, or one the operator pinned: `set_max_in_flight`), else, once the main loop gave it
    targets (`set_targets`) and bounds (`set_limit_bounds`), steered toward them — stepped on the door's
    own timer from the per-request samples it records; the main loop never sets the steered values.
    """

    def __init__(
        self,
        config: DoorConfig,
        *,
        post: Callable[[object], None],
        registry: CollectorRegistry,
        model_dir: str | Path | None = None,
    ) -> None:
        self.config = config
        self._post = post
        self.metrics = DoorMetrics(registry)
        self._loop = new_event_loop(config.event_loop)
        self._gate = Gate(
            self._loop,
            self.metrics,
            post,
            max_queue=config.max_queue,
            hold_timeout_s=config.hold_timeout_s,
            drain_timeout_s=config.drain_timeout_s,
            max_in_flight=config.max_in_flight,
        )
        self._limits = PromptLimits(config.max_prompt_tokens)
        self._limits_state = LimitsState(False, None, config.max_prompt_tokens)
        self._thread = threading.Thread(target=self._run, name="tunerd-door", daemon=True)
        self._sock: socket.socket | None = None
        self._opened = threading.Event()
        self._open_error: str | None = None
        self._stopped = False
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._batch: list[RequestSample] = []  # the door's loop only; handed over whole (`_flush`)
        # The cap's controller (door's loop only): pinned (a fixed value) or steered toward `_targets`.
        self._pinned = config.max_in_flight is not None
        self._pin = config.max_in_flight
        self._targets: tuple[Targets, float] | None = None
        self._bounds: tuple[int, int | None] = (config.min_in_flight, None)
        self._limiter: Static | Goodput = Static(config.max_in_flight, config.min_in_flight)
        self._limit_state = replace(self._limiter.state(), pinned=self._pinned)
        self._limit_log = LimitLog(LIMIT_LOG_S)
        if model_dir is not None:
            self.set_model_dir(model_dir)

    # -- life --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Listen on `config.host:config.port` and start serving in the door's thread. Raises OSError here,
        in the caller, when the port is taken or the server could not be set up."""
        host = self.config.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, self.config.port), family=family, backlog=1024)
        self._thread.start()
        if not self._opened.wait(30.0) or self._open_error is not None:
            self._sock.close()
            raise OSError(f"the front door did not start: {self._open_error or 'timed out'}")

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect (the real port when `config.port` is 0)."""
        assert self._sock is not None, "start() first"
        host, port = self._sock.getsockname()[:2]
        return host, port

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving: whatever waits in the door gets 503 + Retry-After ("tunerd is stopping"), open
        connections are closed, the thread ends (within `timeout`)."""
        if self._stopped:
            return
        self._stopped = True
        if not self._thread.is_alive():  # never started (or its start failed)
            if self._sock is not None:
                self._sock.close()
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        self._thread.join(timeout)

    # -- the main loop's controls (thread-safe: they only schedule work on the door's loop) -----------

    def set_upstream(self, url: str | None, state: UpstreamState, reason: str = "") -> None:
        """serving: forward to `url`; draining: new requests wait, in-flight ones finish (a `DoorDrained`
        event follows, after `drain_timeout_s` at most); down: requests wait (up to hold_timeout_s);
        fatal: everything waiting and every new request gets 503 with `reason`. `url` None keeps the last
        one (not for "serving" before any was set)."""
        if state not in STATES:
            raise ValueError(f"unknown upstream state {state!r}")
        if state == "serving" and url is None and self._gate.url is None:
            raise ValueError("serving needs an upstream URL (none was set before)")
        self._call(self._set_upstream, url, state, reason)

    def set_late_after(self, seconds: float | None) -> None:
        """Release waiting requests on time first: one that has waited `seconds` goes only when no other
        waits (door/gate.py); None: in arrival order."""
        if seconds is not None and seconds <= 0:
            raise ValueError("late_after must be positive (or None: arrival order)")
        self._call(self._gate.set_late_after, seconds)

    def set_max_in_flight(self, cap: int | None) -> None:
        """Pin the in-flight cap at `cap` (None: no cap) on the running door — it stays there, not
        steered, until `steer`: nothing in flight is dropped (a lower cap lets the surplus finish and
        queues new requests; a higher one releases waiting ones at once)."""
        if cap is not None and cap < 1:
            raise ValueError("max_in_flight must be at least 1 (or None: no cap)")
        self._call(self._pin_limit, True, cap)

    def steer(self) -> None:
        """Unpin: the cap is steered toward the targets again (when there are targets; else no cap)."""
        self._call(self._pin_limit, False, None)

    def set_limit_bounds(self, low: int, high: int | None) -> None:
        """The steered cap's bounds: `[door] min_in_flight` and the max_num_seqs in force (None: unknown;
        door/limit.CEILING). A `low` above `high` is brought down to it."""
        if low < 1 or (high is not None and high < 1):
            raise ValueError("the cap's bounds must be at least 1")
        self._call(self._set_bounds, low, high)

    def set_targets(self, targets: Targets | None, attainment: float = 0.95) -> None:
        """The goodput objective's per-request targets and attainment (None: no goodput objective in
        force: the cap is not steered)."""
        self._call(self._set_targets, None if targets is None or not targets.any else (targets, attainment))

    def set_max_model_len(self, max_model_len: int | None) -> None:
        """The max_model_len vLLM runs with (call at every engine start): prompts and `max_tokens` vLLM
        would refuse are refused by the door, before they wait or reach vLLM."""
        self._call(self._set_max_model_len, max_model_len)

    def set_model_dir(self, model_dir: str | Path) -> None:
        """Count prompts with this model's tokenizer.json (loaded in a worker thread of the door's loop;
        until then, and when it does not load, prompt lengths are left to vLLM)."""
        self._call(self._load_tokenizer, Path(model_dir))

    def drain_state(self) -> DrainState:
        """The door now: state, in flight to vLLM, waiting in the door (an immutable snapshot)."""
        return self._gate.snapshot

    def limits_state(self) -> LimitsState:
        """The prompt limits in force (an immutable snapshot)."""
        return self._limits_state

    def limit_state(self) -> LimitState:
        """The cap's controller: mode, value, bounds, its last step and why (an immutable snapshot)."""
        return self._limit_state

    # -- the door's thread -----------------------------------------------------------------------

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the door has stopped
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(self._on_loop_error)
        try:
            self._loop.run_until_complete(self._open())
        except Exception as exc:
            self._open_error = f"{type(exc).__name__}: {exc}"
            self._opened.set()
            self._loop.close()
            return
        self._opened.set()
        try:
            self._loop.run_forever()
        except Exception as exc:  # not a request's error (those stay in their handler): the loop itself
            self._failed(exc)
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # bodies pass unchanged, with their Content-Encoding
            cookie_jar=aiohttp.DummyCookieJar(),  # one client's cookies must never reach another
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),  # generation may take long
        )
        proxy = Proxy(self._gate, self._limits, self.metrics, self._session, self.config, self._record)
        self._loop.call_later(BATCH_S, self._tick)
        # One catch-all route: aiohttp's application answers `Expect: 100-continue` and enforces the
        # body limit; the handler sees every method and path as the client sent them.
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_route("*", "/{path:.*}", proxy.handle)
        # handler_cancellation: a client that hangs up cancels its handler, which closes the upstream
        # request, so vLLM stops generating for nobody (as it does for a direct client).
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        assert self._sock is not None
        await web.SockSite(self._runner, self._sock).start()

    async def _close(self) -> None:
        self._gate.close("tunerd is stopping")
        try:
            if self._runner is not None:
                await self._runner.cleanup()  # stops listening; handlers get shutdown_timeout to finish
            if self._session is not None:
                await self._session.close()
            # What is left (a /health probe, a tokenizer load's callback) ends here, not as a warning.
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        finally:
            self._loop.stop()

    def _set_upstream(self, url: str | None, state: UpstreamState, reason: str) -> None:
        epoch = self._gate.epoch
        self._gate.set_upstream(url, state, reason)
        if self._gate.epoch != epoch:  # serving again: a restart's hold is not the cap's wait
            self._limiter.reset(time.monotonic())

    def _record(self, sample: RequestSample) -> None:
        """One answered generation request (door's loop): kept for the next batch."""
        batch = self._batch
        batch.append(sample)
        self._limiter.record(sample)
        if len(batch) >= BATCH_MAX:
            self._flush()

    def _tick(self) -> None:
        self._flush()
        self._steer(time.monotonic())
        if not self._stopped:
            self._loop.call_later(BATCH_S, self._tick)

    def _flush(self) -> None:
        """Hand the batch to the main loop (its `post`, as every event): the loop owns it from here."""
        if self._batch:
            batch, self._batch = self._batch, []
            self._post(DoorRequests(tuple(batch)))

    # -- the cap's controller (door's loop) -------------------------------------------------------------

    def _steer(self, now: float) -> None:
        """The controller's step (it keeps its own interval), applied to the gate; `door.limit` posted
        at most once per LIMIT_LOG_S. Not while vLLM does not serve: nothing then measures the cap."""
        gate = self._gate
        snapshot = gate.snapshot
        serving = gate.state == "serving"
        step = self._limiter.step
        change = step(now, snapshot.queued, snapshot.in_flight, snapshot.arrivals) if serving else None
        if change is not None:
            self._apply_limit(change.new, "steered")
            record = self._limit_log.add(change)
        else:
            record = self._limit_log.due(now)
        self._tell(record)
        self._publish_limit()

    def _tell(self, record: dict[str, object] | None) -> None:
        if record is not None:
            self._post(DoorLimit(**record))  # type: ignore[arg-type]

    def _pin_limit(self, pinned: bool, cap: int | None) -> None:
        self._pinned, self._pin = pinned, cap
        self._choose_limiter()

    def _set_bounds(self, low: int, high: int | None) -> None:
        low = min(low, high) if high is not None else low
        self._bounds = (low, high)
        limiter = self._limiter
        if isinstance(limiter, Goodput):
            change = limiter.set_bounds(low, high, time.monotonic())
            if change is not None:
                self._apply_limit(change.new, "set")
                self._tell(self._limit_log.add(change))
            self._publish_limit()
        else:
            self._choose_limiter()

    def _set_targets(self, steering: tuple[Targets, float] | None) -> None:
        self._targets = steering
        limiter = self._limiter
        if isinstance(limiter, Goodput) and steering is not None:
            limiter.set_targets(*steering)
            self._publish_limit()
        else:
            self._choose_limiter()

    def _choose_limiter(self) -> None:
        """Pinned (or no targets): a fixed cap; else steered, starting from the cap in force."""
        low, high = self._bounds
        if self._pinned or self._targets is None:
            self._limiter = Static(self._pin if self._pinned else None, low, high)
        elif not isinstance(self._limiter, Goodput):
            cfg = self.config
            self._limiter = Goodput(
                *self._targets, low=low, high=high, start=self._gate.max_in_flight,
                interval_s=cfg.steer_interval_s, min_samples=cfg.steer_min_samples, now=time.monotonic(),
            )  # fmt: skip
        self._apply_limit(self._limiter.limit, "set")
        self._publish_limit()

    def _apply_limit(self, cap: int | None, by: str) -> None:
        if cap != self._gate.max_in_flight:
            self._gate.set_max_in_flight(cap)
            self.metrics.limit_changes.labels(by=by).inc()

    def _publish_limit(self) -> None:
        self._limit_state = replace(self._limiter.state(), pinned=self._pinned)

    def _set_max_model_len(self, max_model_len: int | None) -> None:
        self._limits.max_model_len = max_model_len
        self._publish_limits()

    def _publish_limits(self) -> None:
        limits = self._limits
        self._limits_state = LimitsState(
            limits.tokenizer is not None, limits.max_model_len, limits.max_prompt_tokens
        )

    def _load_tokenizer(self, model_dir: Path) -> None:
        future = self._loop.run_in_executor(None, PromptLimits.load_tokenizer, model_dir)

        def loaded(done: asyncio.Future[Any]) -> None:
            try:
                self._limits.tokenizer = done.result()
            except Exception as exc:  # no tokenizer: vLLM's own check still applies
                self._limits.tokenizer = None
                log.warning("door.no_tokenizer", **no_tokenizer_fields(model_dir, exc))
            self._publish_limits()

        future.add_done_callback(loaded)

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        log.error("door.loop_error", message=context.get("message"), error=repr(exc) if exc else None)

    def _failed(self, exc: BaseException) -> None:
        log.error("door.failed", error=f"{type(exc).__name__}: {exc}")
        self._post(DoorFailed(f"{type(exc).__name__}: {exc}"))
