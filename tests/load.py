"""Loads on vLLM's OpenAI API, used by the engine tier and the bench scripts:
- `ClosedLoopLoad`: N clients, each sending its next request as soon as the last one is answered (or,
  with `think_s`, after a pause drawn around it: an interactive user reading the answer);
- `OpenLoopLoad`: requests arriving at a fixed mean rate, Poisson (exponential gaps from a seeded
  generator), whether or not earlier ones were answered — real traffic does not wait for its last answer.

Prompts are cache-cold: token ids drawn from a seeded generator, different for every request, so vLLM's
prefix cache cannot flatter a figure (a fixed prompt made throughput look 2.32x higher on a Spark,
vLLM #54227). `ignore_eos` makes every request generate exactly `max_tokens` tokens. `prompt_tokens`
and `max_tokens` are a fixed size or a (low, high) range drawn uniformly per request from the same seeded
generator: the same seed offers the same sequence of requests (a fixed workload for the bench scripts).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Answer:
    """One whole streamed answer on the client's own clock (time.monotonic()): when it was sent and
    ended, its TTFT (send to first token event), TPOT ((last − first token event) / (tokens − 1), None
    for one token) and its tokens."""

    sent: float
    done: float
    ttft_s: float
    tpot_s: float | None
    tokens: int


@dataclass
class LoadStats:
    """What the clients saw. `errors` holds one short reason per failed request."""

    ok: int = 0
    errors: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    stream_cut: int = 0  # streams that ended with an error event (and then [DONE] or the end)
    # One per whole streamed answer, on the clients' own clock: (done, TTFT, TPOT). `done` is
    # time.monotonic() at the end; TTFT from the send to the first token event; TPOT = (last − first
    # token event) / (tokens − 1), None for a one-token answer.
    streamed: list[tuple[float, float, float | None]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)  # the same answers, whole
    # When each client thread (by name) last had a whole answer (time.monotonic()): a closed loop's client
    # answered since `t` has no request from before `t` in flight.
    last_ok_at: dict[str, float] = field(default_factory=dict)


class _Load:
    """What every load shares: the seeded requests, one request sent and counted (`_send`), the stats.
    `stream=True`: streamed requests (SSE); a stream counts as ok when it ends with `data: [DONE]` after
    `max_tokens` tokens, as `stream_cut` when it carried an error event and then ended (what the front
    door and vLLM send when the engine dies mid-answer), as an error otherwise (no [DONE]: a hang or a
    reset)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        prompt_tokens: int | tuple[int, int] = 16,
        max_tokens: int | tuple[int, int] = 400,
        vocab: int = 1000,
        seed: int = 0,
        timeout_s: float = 600.0,
        stream: bool = False,
    ) -> None:
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.stream = stream
        self.seed = seed
        self.stats = LoadStats()
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _request(self) -> tuple[list[int], int]:
        """The next request's prompt (token ids) and its number of tokens to generate."""
        with self._lock:
            size, generate = (_draw(self._random, s) for s in (self.prompt_tokens, self.max_tokens))
            # Token ids from 10 upwards: the low ids of the tiny model's tokenizer are special tokens.
            return [self._random.randrange(10, self.vocab) for _ in range(size)], generate

    def _send(self, client: httpx.Client, request: tuple[list[int], int]) -> None:
        """One request, to its answer, counted in `stats`."""
        prompt, generate = request
        body = {"model": self.model, "prompt": prompt, "max_tokens": generate, "ignore_eos": True,
                "temperature": 0.0}  # fmt: skip
        started = time.monotonic()
        if self.stream:
            self._streamed(client, body, started)
            return
        try:
            answer = client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            self._failed(f"{type(exc).__name__}")
            self._stop.wait(0.5)  # the engine is down: do not spin
            return
        if answer.status_code != 200:
            self._failed(f"HTTP {answer.status_code}")
            self._stop.wait(0.5)
            return
        tokens = int(answer.json().get("usage", {}).get("completion_tokens", 0))
        if tokens != generate:  # ignore_eos: a whole answer has exactly max_tokens
            self._failed(f"incomplete: {tokens} of {generate} tokens")
            return
        with self._lock:
            self.stats.ok += 1
            self.stats.completion_tokens += tokens
            self.stats.latencies_s.append(time.monotonic() - started)
            self.stats.last_ok_at[threading.current_thread().name] = time.monotonic()

    def _streamed(self, client: httpx.Client, body: dict[str, object], started: float) -> None:
        tokens, error, done = 0, False, False
        first = last = 0.0
        try:
            with client.stream("POST", self.url, json={**body, "stream": True}) as answer:
                if answer.status_code != 200:
                    self._failed(f"HTTP {answer.status_code}")
                    self._stop.wait(0.5)
                    return
                for line in answer.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        error |= "error" in event
                        # A token event: text, or none yet finished (a random-weight model's token may
                        # decode to "" — a partial UTF-8 byte — and still be a token).
                        got = sum(
                            1 for c in event.get("choices", ()) if c.get("text") or not c.get("finish_reason")
                        )
                        if got:
                            last = time.monotonic()
                            first = first or last
                        tokens += got
        except httpx.HTTPError as exc:
            self._failed(f"stream: {type(exc).__name__} after {tokens} tokens")
            return
        with self._lock:
            if error:
                self.stats.stream_cut += 1
            elif done and tokens > 0:
                self.stats.ok += 1
                self.stats.completion_tokens += tokens
                ended = time.monotonic()
                self.stats.latencies_s.append(ended - started)
                tpot = (last - first) / (tokens - 1) if tokens > 1 else None
                self.stats.streamed.append((ended, first - started, tpot))
                self.stats.answers.append(Answer(started, ended, first - started, tpot, tokens))
                self.stats.last_ok_at[threading.current_thread().name] = ended
            else:
                self.stats.errors.append(
                    f"stream ended after {tokens} token events, {'with' if done else 'without'} [DONE]"
                )

    def _failed(self, reason: str) -> None:
        with self._lock:
            self.stats.errors.append(reason)

    def _threads_start(self, targets: list[tuple[str, Callable[[], None]]]) -> None:
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 30.0) -> LoadStats:
        """Ask the clients to stop after their request in flight; returns what they saw."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        return self.stats

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClosedLoopLoad(_Load):
    """`clients` threads, each looping: one /v1/completions request, wait for the answer, (with
    `think_s`: pause for a time drawn from an exponential of that mean, seeded,) again."""

    def __init__(
        self, base_url: str, model: str, *, clients: int, think_s: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(base_url, model, **kwargs)
        self.clients = clients
        self.think_s = think_s
        self._think = random.Random(f"think-{kwargs.get('seed', 0)}")

    def _client(self) -> None:
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            while not self._stop.is_set():
                self._send(client, self._request())
                if self.think_s > 0:
                    with self._lock:
                        pause = self._think.expovariate(1 / self.think_s)
                    self._stop.wait(pause)  # a user reading the answer (or the stop)

    def start(self) -> ClosedLoopLoad:
        self._threads_start([(f"load-{n}", self._client) for n in range(self.clients)])
        return self

    def __enter__(self) -> ClosedLoopLoad:
        return self.start()


def arrival_gaps(rate_per_s: float, seed: int) -> Iterator[float]:
    """The seconds between an open loop's arrivals: exponential of mean 1 / `rate_per_s` (a Poisson
    process), from its own seeded generator (the same seed, the same arrivals)."""
    generator = random.Random(f"arrivals-{seed}")
    while True:
        yield generator.expovariate(rate_per_s)


class OpenLoopLoad(_Load):
    """Requests arriving at `rate_per_s` on average (Poisson), each sent on arrival whatever is still in
    flight, up to `max_outstanding` at once (an arrival beyond it is counted in `dropped`: the load
    generator's limit, not the server's). The arrivals are paced on the monotonic clock from the start,
    so a late send does not shift the ones after it."""

    def __init__(
        self, base_url: str, model: str, *, rate_per_s: float, max_outstanding: int = 256, **kwargs: Any
    ) -> None:
        super().__init__(base_url, model, **kwargs)
        self.rate_per_s = rate_per_s
        self.max_outstanding = max_outstanding
        self.sent = 0
        self.dropped = 0
        self._slots = threading.BoundedSemaphore(max_outstanding)

    def _arrivals(self) -> None:
        limits = httpx.Limits(max_connections=self.max_outstanding, max_keepalive_connections=64)
        with httpx.Client(timeout=self.timeout_s, trust_env=False, limits=limits) as client:
            due = time.monotonic()
            for gap in arrival_gaps(self.rate_per_s, self.seed):
                due += gap
                if self._stop.wait(max(0.0, due - time.monotonic())):
                    break
                if not self._slots.acquire(blocking=False):
                    with self._lock:
                        self.dropped += 1
                    continue
                request = self._request()
                with self._lock:
                    self.sent += 1
                thread = threading.Thread(target=self._one, args=(client, request), daemon=True)
                thread.start()
            # Let the requests in flight end (each bounded by timeout_s) before the client closes.
            for _ in range(self.max_outstanding):
                self._slots.acquire(timeout=self.timeout_s)

    def _one(self, client: httpx.Client, request: tuple[list[int], int]) -> None:
        try:
            self._send(client, request)
        finally:
            self._slots.release()

    def start(self) -> OpenLoopLoad:
        self._threads_start([("load-arrivals", self._arrivals)])
        return self

    def __enter__(self) -> OpenLoopLoad:
        return self.start()


def _draw(generator: random.Random, size: int | tuple[int, int]) -> int:
    return size if isinstance(size, int) else generator.randint(*size)
