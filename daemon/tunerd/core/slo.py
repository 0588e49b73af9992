"""Per-request service levels (pure): what one request through the front door measured, whether it met
the operator's targets, and the window statistics over recent requests — attainment (overall and per
target), goodput, client-side TTFT/TPOT percentiles (docs/signals.md, `slo.*` and `door.*`).

The door fills one `RequestSample` per generation request it answered (door/proxy.py) and hands them to
the main loop in batches (door/events.DoorRequests); the loop keeps them in a `SloWindow` (a bounded
ring) and feeds `SloWindow.readings(now, ...)` into each poll, so that the signal window, the rules and a
trial's windows read them like any other input. Times are `time.monotonic()` in both threads. Beside
the window's statistics the readings carry three counters (requests counted, good ones, their output
tokens): a trial's window takes their increases, exact for that window and per poll (policy/evidence.py).

How a request counts (docs/signals.md, "Per-request service levels"):

- TTFT is the client's: arrival at the door → the first byte of the answer's body (vLLM's first SSE event
  carries the first token: its chat role event is sent with the first output too). It includes the wait
  in the door, on purpose: a cap that only moves the queue from vLLM into the door does not look better.
- TPOT = (last event − first event) / (tokens − 1); unknown (not judged) with fewer than 2 tokens.
- A non-streamed answer arrives whole: its TTFT *is* its end-to-end time (the client sees no token
  earlier), and its TPOT is unknown, so it is judged on TTFT (= e2e) and e2e only.
- A failed request (5xx, a stream cut, a refusal by the door) misses every target. A client that hung up
  and a request vLLM refused as invalid (4xx) are not counted: neither says how fast the server was.
- Targets are applied when the window is computed (`SloWindow.stats`), so a reload re-judges the window.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import islice
from typing import Literal

Count = Literal["requests", "tokens"]
# Bounded: at 200 requests/s a 60 s window holds 12,000; past this the window covers the ring's span only
# (and says so through `SloStats.span_s`). A sample is ~100 bytes: about 1.6 MB at most.
RING_SIZE = 16384


@dataclass(frozen=True, slots=True)
class Targets:
    """The operator's per-request targets (`[objective]`); None: that target is not judged."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None or self.e2e_s is not None


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One generation request the door answered. `done`: when its answer ended (monotonic); `wait_s`:
    its time waiting in the door (admission queue, a hold across a restart); `upstream_ttft_s`: vLLM's
    part of the TTFT (forward → first byte); `ttft_s`: arrival → first byte (None when nothing came);
    `tokens`: output tokens (None: unknown); `tokens_exact`: from vLLM's `usage` (else counted events, an
    undercount when an event carries several tokens); `tpot_s`: None below 2 tokens or when not streamed;
    `e2e_s`: arrival → the answer's end; `ok`: answered in full (no 5xx, no cut, not refused).

    vLLM's own split of the upstream time, from the answer's `metrics` object (`--enable-per-request-
    metrics`, engine/launch.py; None without it, or for a stream without usage): `queue_s` waiting in
    vLLM's scheduler, `prefill_s` scheduling → first token (vLLM's `time_to_first_token_ms`, which
    excludes the queue), `decode_s` mean ITL × (tokens − 1) (exact tokens only)."""

    done: float
    wait_s: float
    upstream_ttft_s: float | None
    ttft_s: float | None
    tokens: int | None
    tokens_exact: bool
    tpot_s: float | None
    e2e_s: float
    streamed: bool
    ok: bool
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None


def tpot(first: float, last: float, tokens: int | None) -> float | None:
    """Time per output token after the first: (last − first)/(tokens − 1); None below 2 tokens."""
    if tokens is None or tokens < 2:
        return None
    return max(0.0, last - first) / (tokens - 1)


def meets(sample: RequestSample, targets: Targets) -> tuple[bool | None, bool | None, bool | None]:
    """Per target (ttft, tpot, e2e): True met, False missed, None not judged (no target, or the figure is
    unknown: a one-token or non-streamed answer has no TPOT). A failed request misses every target set."""
    if not sample.ok:
        return (
            None if targets.ttft_s is None else False,
            None if targets.tpot_s is None else False,
            None if targets.e2e_s is None else False,
        )
    return (
        _within(sample.ttft_s, targets.ttft_s),
        _within(sample.tpot_s, targets.tpot_s),
        _within(sample.e2e_s, targets.e2e_s),
    )


def _within(value: float | None, target: float | None) -> bool | None:
    if target is None or value is None:
        return None
    return value <= target


def good(sample: RequestSample, targets: Targets) -> bool:
    """Every judged target met (and the request answered): the request counts toward goodput."""
    return sample.ok and all(m is not False for m in meets(sample, targets))


def feasible(attainment: float | None, target: float) -> bool | None:
    """A configuration meets the operator's service level when its attainment is at least `target`;
    None when there is no attainment to judge (no request in the window, or no targets)."""
    return None if attainment is None else attainment >= target


@dataclass(frozen=True, slots=True)
class SloStats:
    """One window's statistics. `requests`: counted requests in the window; `span_s`: the seconds they
    cover (the window, less what the ring dropped or what was not yet observed). Attainments are shares
    0..1 (None without a request, or without a target for it); `goodput` is good requests/s or their
    output tokens/s (`count`); percentiles are over the answered requests."""

    requests: int
    span_s: float
    attainment: float | None
    attainment_ttft: float | None
    attainment_tpot: float | None
    attainment_e2e: float | None
    goodput: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    tpot_p50: float | None
    tpot_p95: float | None
    wait_p95: float | None
    # Counters since the `SloWindow` began (each sample judged once, by the targets of the poll that first
    # saw it): what a trial's window counts exactly, whatever `observe.window_s` is (policy/evidence.py).
    requests_total: int = 0
    good_total: int = 0
    good_tokens_total: int = 0
    queue_p95: float | None = None  # vLLM's queue time, of the requests that carried its metrics
    prefill_p95: float | None = None  # vLLM's scheduling → first token, likewise


def quantile(sorted_values: list[float], q: float) -> float | None:
    """The `q` quantile of sorted values, linear between closest ranks (numpy's default); None if empty."""
    n = len(sorted_values)
    if n == 0:
        return None
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class PerTarget:
    """Per-target tallies of judged requests (ttft, tpot, e2e, the order of `meets`): what the window's
    statistics and the door's cap controller (door/limit.py) both count."""

    __slots__ = ("hits", "judged")

    def __init__(self) -> None:
        self.hits = [0, 0, 0]
        self.judged = [0, 0, 0]

    def add(self, verdict: tuple[bool | None, bool | None, bool | None]) -> None:
        """One request's `meets` verdict: each judged target counted, each met one a hit."""
        for i, met in enumerate(verdict):
            if met is not None:
                self.judged[i] += 1
                self.hits[i] += met

    def shares(self) -> tuple[float | None, float | None, float | None]:
        """Per target, the share of judged requests that met it; None where none was judged."""
        a, b, c = (h / j if j else None for h, j in zip(self.hits, self.judged, strict=True))
        return a, b, c


def window_stats(samples: Iterable[RequestSample], targets: Targets, count: Count, span_s: float) -> SloStats:
    """The statistics of `samples` (those of one window) over `span_s` seconds (pure)."""
    n = met = 0
    per_target = PerTarget()
    good_tokens = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    waits: list[float] = []
    queues: list[float] = []
    prefills: list[float] = []
    for s in samples:
        n += 1
        verdict = meets(s, targets)
        per_target.add(verdict)
        if s.ok and False not in verdict:
            met += 1
            good_tokens += s.tokens or 0
        if s.ok:
            if s.ttft_s is not None:
                ttfts.append(s.ttft_s)
            if s.tpot_s is not None:
                tpots.append(s.tpot_s)
        waits.append(s.wait_s)
        if s.queue_s is not None:
            queues.append(s.queue_s)
        if s.prefill_s is not None:
            prefills.append(s.prefill_s)
    ttfts.sort()
    tpots.sort()
    waits.sort()
    queues.sort()
    prefills.sort()
    shares = per_target.shares()
    have_targets = targets.any
    attainment = met / n if n and have_targets else None
    goodput = None
    if have_targets and span_s > 0:
        goodput = (met if count == "requests" else good_tokens) / span_s
    return SloStats(
        requests=n,
        span_s=span_s,
        attainment=attainment,
        attainment_ttft=shares[0],
        attainment_tpot=shares[1],
        attainment_e2e=shares[2],
        goodput=goodput,
        ttft_p50=quantile(ttfts, 0.5),
        ttft_p95=quantile(ttfts, 0.95),
        tpot_p50=quantile(tpots, 0.5),
        tpot_p95=quantile(tpots, 0.95),
        wait_p95=quantile(waits, 0.95),
        queue_p95=quantile(queues, 0.95),
        prefill_p95=quantile(prefills, 0.95),
    )


class SloWindow:
    """The recent requests (a ring of at most `size`), owned by the main loop, and their statistics over
    the last `window_s` seconds. Cost: `add` appends; `stats` walks the window's samples once and sorts
    the percentiles' figures (a few ms at 10,000 samples, once a poll)."""

    def __init__(self, window_s: float, size: int = RING_SIZE, *, started: float) -> None:
        if not window_s > 0 or size < 1:
            raise ValueError("window_s must be > 0 and size >= 1")
        self.window_s = float(window_s)
        self._ring: deque[RequestSample] = deque(maxlen=size)
        self._started = started  # nothing was observed before: the first windows are shorter
        self._dropped_until = -math.inf  # the newest `done` the ring dropped to stay bounded
        self.total = 0  # samples ever added (counted requests)
        self._judged = 0  # of `total`, those counted into the counters below (by `stats`)
        self._counted = self._good = self._good_tokens = 0

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, samples: Iterable[RequestSample]) -> None:
        ring = self._ring
        for sample in samples:
            if len(ring) == ring.maxlen:
                self._dropped_until = max(self._dropped_until, ring[0].done)
            ring.append(sample)
            self.total += 1

    def stats(self, now: float, targets: Targets, count: Count) -> SloStats:
        """Statistics of the requests that ended in (now − window_s, now], with the counters
        (`SloStats.requests_total`, ...) of every sample added so far: those added since the last call
        are judged now, by these `targets`, and counted once (a reload re-judges the window's statistics,
        not what the counters already hold)."""
        self._count_new(targets)
        since = max(now - self.window_s, self._started, self._dropped_until)
        stats = window_stats((s for s in self._ring if s.done > since), targets, count, now - since)
        return replace(
            stats, requests_total=self._counted, good_total=self._good, good_tokens_total=self._good_tokens
        )

    def _count_new(self, targets: Targets) -> None:
        """Fold the samples added since the last call into the counters (the newest `len(ring)` at most:
        what the ring dropped unseen is not counted, in the requests either)."""
        new = min(self.total - self._judged, len(self._ring))
        self._judged = self.total
        for sample in islice(reversed(self._ring), new):
            self._counted += 1
            if good(sample, targets):
                self._good += 1
                self._good_tokens += sample.tokens or 0


def readings(
    stats: SloStats | None, door_waiting: int | None, door_arrivals: int | None = None
) -> dict[str, float | None]:
    """The poll's inputs of the `slo.*` and `door.*` signals (core/signal_catalog.py): None is unknown.
    Attainment and goodput are None without a request in the window (an idle server is not failing)."""
    s = stats
    measured = s is not None and s.requests > 0
    return {
        "door.waiting": None if door_waiting is None else float(door_waiting),
        "door.arrivals_total": None if door_arrivals is None else float(door_arrivals),
        "slo.requests": None if s is None else float(s.requests),
        "slo.attainment": s.attainment if measured and s is not None else None,
        "slo.attainment.ttft": s.attainment_ttft if measured and s is not None else None,
        "slo.attainment.tpot": s.attainment_tpot if measured and s is not None else None,
        "slo.attainment.e2e": s.attainment_e2e if measured and s is not None else None,
        "slo.goodput": s.goodput if measured and s is not None else None,
        "door.ttft.p50": None if s is None else s.ttft_p50,
        "door.ttft.p95": None if s is None else s.ttft_p95,
        "door.tpot.p50": None if s is None else s.tpot_p50,
        "door.tpot.p95": None if s is None else s.tpot_p95,
        "door.wait.p95": None if s is None else s.wait_p95,
        # Counters (inputs, not signals): a trial's window takes their increases (policy/evidence.py).
        "slo.requests_total": None if s is None else float(s.requests_total),
        "slo.good_total": None if s is None else float(s.good_total),
        "slo.good_tokens_total": None if s is None else float(s.good_tokens_total),
        "door.queue.p95": None if s is None else s.queue_p95,
        "door.prefill.p95": None if s is None else s.prefill_p95,
    }
