"""The evidence of one window of one engine run, from its per-poll samples (pure).

A trial compares like with like: *before* is the window that fired the rule (grown with the after window
as far as its run served), *after* a window under the new flags, each of one engine run only (never a
rolling window that straddles the restart).

Every named figure of a window (docs/signals.md) is computed by `SignalWindow` (core/signal_window.py),
the code that computes the rules' live signals, replayed over the window's polls (`window_signals`):
`requests.waiting` is the last poll's value here as it is for a rule, `throughput.generation` the
counter's increase per second. What the verdict needs beside them is computed here: the per-poll
throughput (the increase of `vllm:generation_tokens_total` between consecutive polls) gives a spread —
median and quartiles — and the samples whose mean and noise the verdict weighs (core/stats.py:
the noise over the effective samples of an autocorrelated series); per-request sizes compare the offered load.
The front door's per-request counters (core/slo.readings: `slo.requests_total`, `slo.good_total`,
`slo.good_tokens_total`) give the window's own requests, attainment and goodput (`SloCounts`) — exact for
the window, where the `slo.*` signals are the last poll's view of `observe.window_s` — and per-poll
goodput for the same interval.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from tunerd.core.engine_sample import EngineSample
from tunerd.core.signal_window import SIGNALS, SignalWindow
from tunerd.core.slo import Count

# The names a window computes: every signal but the probe's figures (those are the last probe's, not
# a window's).
WINDOW_SIGNALS: tuple[str, ...] = tuple(s.name for s in SIGNALS if s.kind != "probe")
_WINDOW_SIGNAL_SET = frozenset(WINDOW_SIGNALS)


@dataclass(frozen=True, slots=True)
class Point:
    """One poll of the serving engine, as the rules' window was fed it (supervisor.py): monotonic time,
    what /metrics said (None: the scrape failed) and the host/GPU readings by name."""

    t: float
    sample: EngineSample | None
    readings: Mapping[str, float | None] = field(default_factory=dict)


def window_signals(points: Sequence[Point], start: float, end: float) -> dict[str, float | None]:
    """Every window signal of docs/signals.md (`WINDOW_SIGNALS`) over the points with
    `start <= t <= end` (in time order), computed by the rules' own `SignalWindow` fed exactly those
    polls: one definition per name. No point in the window: every signal None."""
    window = SignalWindow(end - start if end > start else 1.0)  # holds them all: nothing is evicted
    for p in points:
        if start <= p.t <= end:
            window.add(p.t, p.sample, p.readings)
    signals = window.signals()
    return {name: signals[name] for name in WINDOW_SIGNALS}


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of per-second values, with how many there were."""

    median: float
    p25: float
    p75: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "median": round(self.median, 2),
            "p25": round(self.p25, 2),
            "p75": round(self.p75, 2),
            "n": self.n,
        }


@dataclass(frozen=True)
class SloCounts:
    """The front door's requests in one window, from the increases of its counters between the window's
    polls: `requests` counted, `good` among them (every target met), their output `good_tokens`, over
    `seconds`; `good_per_s`/`good_tokens_per_s` the same per poll interval (for its noise)."""

    requests: float
    good: float
    good_tokens: float
    seconds: float
    good_per_s: tuple[float, ...]
    good_tokens_per_s: tuple[float, ...]

    @property
    def attainment(self) -> float | None:
        """The share of the window's requests that were good; None without a request."""
        return self.good / self.requests if self.requests > 0 else None

    def goodput(self, count: Count) -> float | None:
        """Good requests per second (or their output tokens: `count = "tokens"`); None without a request
        (an idle window says nothing of the service) or a span."""
        if self.requests <= 0 or self.seconds <= 0:
            return None
        return (self.good if count == "requests" else self.good_tokens) / self.seconds

    def samples(self, count: Count) -> tuple[float, ...]:
        return self.good_per_s if count == "requests" else self.good_tokens_per_s


SLO_COUNTERS = ("slo.requests_total", "slo.good_total", "slo.good_tokens_total")


def slo_counts(points: Sequence[Point], start: float, end: float) -> SloCounts | None:
    """The door's counters' increases over the points with `start <= t <= end` that carry all three;
    None with fewer than two such polls (the door is off, or it counted nothing yet). A decrease is not
    this daemon's counter (it never resets while the daemon runs): that interval is skipped."""
    polls = [
        (p.t, tuple(p.readings.get(name) for name in SLO_COUNTERS))
        for p in points
        if start <= p.t <= end and all(p.readings.get(name) is not None for name in SLO_COUNTERS)
    ]
    if len(polls) < 2:
        return None
    totals = [0.0, 0.0, 0.0]
    good, tokens = [], []
    for (ta, a), (tb, b) in pairwise(polls):
        steps = [vb - va for va, vb in zip(a, b, strict=True)]  # type: ignore[operator]
        if tb <= ta or min(steps) < 0:
            continue
        totals = [t + d for t, d in zip(totals, steps, strict=True)]
        good.append(steps[1] / (tb - ta))
        tokens.append(steps[2] / (tb - ta))
    seconds = polls[-1][0] - polls[0][0]
    return SloCounts(totals[0], totals[1], totals[2], seconds, tuple(good), tuple(tokens))


@dataclass(frozen=True)
class WindowStats:
    """What an engine did in one window. Rates per second; latencies in seconds; None: not known.

    `values` holds every window signal by name (`window_signals`); the fields named after a signal
    (`prompt_rate` = `throughput.prompt`, `ttft_p95` = `ttft.p95`, ...) are read from it, so that the
    verdict's figures and the rules' are one statistic per name; `waiting_avg` is the requests waiting
    for vLLM anywhere (`requests.waiting_avg` + `door.waiting_avg`: the offered load).
    `throughput` and `throughput_samples` are the per-poll rates, for a spread and the interval of
    their mean; `slo` the front door's requests in the window (None without the door's counters)."""

    start: float
    end: float
    polls: int
    throughput: Spread  # generation tokens/s, per poll interval
    throughput_samples: tuple[float, ...]
    prompt_rate: float | None
    completed_rate: float | None
    prompt_tokens_per_request: float | None
    generation_tokens_per_request: float | None
    preemption_rate: float | None
    running_avg: float | None
    waiting_avg: float | None
    waiting_max: float | None
    kv_usage_avg: float | None
    kv_usage_max: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p95: float | None
    e2e_p95: float | None
    saturated: bool
    values: Mapping[str, float | None] = field(default_factory=dict)
    slo: SloCounts | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def signals(self) -> dict[str, float | None]:
        """The window's signals under the names of docs/signals.md (what rules' terms and the objective
        read), each the statistic the rules' live window computes under that name."""
        return dict(self.values)

    def as_dict(self) -> dict[str, object]:
        """The figures a journal record carries (rounded; the sample count says how much evidence)."""

        def r(value: float | None, digits: int = 3) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "seconds": round(self.seconds, 1),
            "polls": self.polls,
            "throughput": self.throughput.as_dict(),
            "prompt_tokens_per_s": r(self.prompt_rate, 1),
            "requests_per_s": r(self.completed_rate),
            "prompt_tokens_per_request": r(self.prompt_tokens_per_request, 1),
            "generation_tokens_per_request": r(self.generation_tokens_per_request, 1),
            "preemptions_per_s": r(self.preemption_rate),
            "running_avg": r(self.running_avg, 2),
            "waiting_avg": r(self.waiting_avg, 2),
            "kv_usage_avg": r(self.kv_usage_avg),
            "ttft_p95_s": r(self.ttft_p95, 4),
            "itl_p95_s": r(self.itl_p95, 5),
            "e2e_p95_s": r(self.e2e_p95, 3),
            "saturated": self.saturated,
        }


def window_stats(
    points: Sequence[Point],
    start: float,
    end: float,
    *,
    max_num_seqs: int | None,
    saturated_waiting: float,
    saturated_kv_usage: float = 0.9,
) -> WindowStats | None:
    """The stats of the points with `start <= t <= end` (one run's, in time order), or None with fewer
    than three polls with a sample or no token counter. The window spans its first to its last poll
    with a sample; its signals (`values`) are `window_signals` over that span, failed scrapes included.

    Saturated = the engine ran at its capacity, so that throughput measures it: requests waited on
    average at least `saturated_waiting`, or the batch ran full (running at 90 % of `max_num_seqs`), or
    the KV cache did (average usage at least `saturated_kv_usage`: memory, not the batch limit, bounds
    how many run — vLLM preempts rather than queues then).
    """
    inside = [p for p in points if start <= p.t <= end and p.sample is not None]
    if len(inside) < 3:
        return None
    first, last = inside[0], inside[-1]
    if last.t - first.t <= 0:
        return None
    per_poll = per_poll_rates(inside, "generation_tokens_total")
    if not per_poll:
        return None
    v = window_signals(points, first.t, last.t)
    running_avg, waiting_avg = v["requests.running_avg"], _waiting_for_vllm(v)
    kv_avg = v["kv_cache.usage_avg"]
    full = max_num_seqs is not None and running_avg is not None and running_avg >= 0.9 * max_num_seqs
    full = full or (kv_avg is not None and kv_avg >= saturated_kv_usage)
    completed = v["requests.completed_rate"]
    return WindowStats(
        start=first.t,
        end=last.t,
        polls=len(inside),
        throughput=spread(per_poll),
        throughput_samples=tuple(per_poll),
        prompt_rate=v["throughput.prompt"],
        completed_rate=completed,
        prompt_tokens_per_request=_request_size(
            first.sample, last.sample, "request_prompt_tokens", v["throughput.prompt"], completed
        ),
        generation_tokens_per_request=_request_size(
            first.sample, last.sample, "request_generation_tokens", v["throughput.generation"], completed
        ),
        preemption_rate=v["preemptions.rate"],
        running_avg=running_avg,
        waiting_avg=waiting_avg,
        waiting_max=v["requests.waiting_max"],
        kv_usage_avg=kv_avg,
        kv_usage_max=v["kv_cache.usage_max"],
        ttft_p50=v["ttft.p50"],
        ttft_p95=v["ttft.p95"],
        itl_p95=v["itl.p95"],
        e2e_p95=v["e2e.p95"],
        saturated=bool((waiting_avg is not None and waiting_avg >= saturated_waiting) or full),
        values=v,
        slo=slo_counts(points, first.t, last.t),
    )


def _waiting_for_vllm(v: Mapping[str, float | None]) -> float | None:
    """Requests waiting for vLLM anywhere, on average: vLLM's own queue (`requests.waiting_avg`) plus the
    front door's (`door.waiting_avg`). The load offered to the engine, for saturation and the outstanding
    requests: under the door's cap the surplus waits in the door. The two are separate signals (a rule on
    `requests.waiting*` reads vLLM's queue alone, issue 21); only this sum joins them."""
    vllm, door = v["requests.waiting_avg"], v.get("door.waiting_avg")
    if vllm is None:
        return None
    return vllm + (door or 0.0)


def spread(values: Sequence[float]) -> Spread:
    ordered = sorted(values)
    if len(ordered) < 2:
        value = ordered[0] if ordered else 0.0
        return Spread(value, value, value, len(ordered))
    q1, q2, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return Spread(q2, q1, q3, len(ordered))


def per_poll_rates(points: Sequence[Point], name: str) -> list[float]:
    """Per-second increases of the counter `name` between consecutive polls that have a sample."""
    rates = []
    for a, b in pairwise(points):
        va, vb = getattr(a.sample, name), getattr(b.sample, name)
        if va is None or vb is None or b.t <= a.t or vb < va:  # a decrease is a reset: not this run
            continue
        rates.append((vb - va) / (b.t - a.t))
    return rates


def _request_size(
    first: EngineSample | None,
    last: EngineSample | None,
    field: str,
    token_rate: float | None,
    completed_rate: float | None,
) -> float | None:
    """The mean size (tokens) of the requests finished between the window's first and last polls: the
    increase of vLLM's per-request histogram `field` (sum over count: each finished request observed once,
    with its own size). Without it (an older vLLM, none finished): the token counter's rate over the
    completed rate — a looser figure, since the counters count a request's prompt at its first token and
    its output as it comes, so a window that admits more requests than it finishes reads them larger
    (seen on real vLLM under preemption, 16-token prompts: "prompt tokens per request 21.3 → 16", which
    made a trial inconclusive with the load unchanged)."""
    before, after = getattr(first, field, None), getattr(last, field, None)
    if before is not None and after is not None:
        finished = after.count - before.count
        if finished > 0 and after.sum >= before.sum:
            return (after.sum - before.sum) / finished
    return None if token_rate is None or not completed_rate else token_rate / completed_rate


def relative_change(before: float | None, after: float | None) -> float | None:
    """(after − before) / before, None when either is unknown or before is 0."""
    if before is None or after is None or before == 0:
        return None
    return (after - before) / before


def load_differs(before: WindowStats, after: WindowStats, tolerance: float) -> str | None:
    """How the offered load differs between the windows beyond `tolerance`, or None when it does not.

    Per-request sizes (prompt and generated tokens) always; then, saturated, the requests outstanding
    (running + waiting: a closed loop offers a concurrency, and its request rate is the effect being
    measured) unless the door's arrival rate held (an open loop offers a rate: its outstanding requests
    are a backlog that grows while it is overloaded and swells across a restart's hold, whatever the
    configuration — seen on the H200's open loop: "outstanding 53.6 → 247" with the same Poisson rate);
    unsaturated, the request rate.
    """
    sizes: list[tuple[str, float | None, float | None]] = [
        ("prompt tokens per request", before.prompt_tokens_per_request, after.prompt_tokens_per_request),
        (
            "generated tokens per request",
            before.generation_tokens_per_request,
            after.generation_tokens_per_request,
        ),
    ]
    for what, b, a in sizes:
        if (why := _differs(what, b, a, tolerance)) is not None:
            return why
    if not (before.saturated or after.saturated):
        return _differs("requests per second", before.completed_rate, after.completed_rate, tolerance)
    outstanding = _differs("requests outstanding", _outstanding(before), _outstanding(after), tolerance)
    if outstanding is None:
        return None
    b, a = before.values.get("door.arrival_rate"), after.values.get("door.arrival_rate")
    arrivals = _differs("arrivals per second", b, a, tolerance)
    if arrivals is None and b is not None and a is not None:
        return None  # the same arrival rate: an open loop's backlog, not another load
    return outstanding if arrivals is None else f"{outstanding}, {arrivals}"


def _differs(what: str, before: float | None, after: float | None, tolerance: float) -> str | None:
    change = relative_change(before, after)
    if change is not None and abs(change) > tolerance:
        return f"{what} {before:.3g} → {after:.3g} ({change:+.0%})"
    return None


def _outstanding(stats: WindowStats) -> float | None:
    if stats.running_avg is None or stats.waiting_avg is None:
        return None
    return stats.running_avg + stats.waiting_avg


def signal_values(
    window: Mapping[str, float | None] | None, live: Mapping[str, float | None]
) -> dict[str, float | None]:
    """A window's signals (`window_signals`), completed by the live figures that no window computes
    (the probe's): what a rule's terms are evaluated against in a trial, and what a baseline records.
    A name the window computes is the window's, None included (unknown in that window: a live value is
    another window's statistic). No window: the live signals."""
    if window is None:
        return dict(live)
    values = {name: value for name, value in live.items() if name not in _WINDOW_SIGNAL_SET}
    values.update(window)
    return values
