"""The evidence of one window of one engine run, from its per-poll samples (pure).

A trial compares like with like: *before* is the window that fired the rule, *after* a window of the
same length under the new flags, each of one engine run only (never a rolling window that straddles the
restart). Per-second throughput (the increase of `vllm:generation_tokens_total` between consecutive
polls) gives a robust statistic with its spread — median and quartiles — and the samples a bootstrap
resamples; latency quantiles come from the histograms' increase over the whole window, as Prometheus'
`histogram_quantile` of a `rate()` would give them.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from tunerd.core.engine_sample import EngineSample, Histogram, histogram_quantile


@dataclass(frozen=True, slots=True)
class Point:
    """One poll of the engine: monotonic time and what /metrics said."""

    t: float
    sample: EngineSample


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
class WindowStats:
    """What an engine did in one window. Rates per second; latencies in seconds; None: not known."""

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

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def signals(self) -> dict[str, float | None]:
        """The window's figures under the names of docs/signals.md (what rules' terms read)."""
        return {
            "throughput.generation": self.throughput.median,
            "throughput.prompt": self.prompt_rate,
            "requests.completed_rate": self.completed_rate,
            "preemptions.rate": self.preemption_rate,
            "requests.running_avg": self.running_avg,
            "requests.running": self.running_avg,
            "requests.waiting": self.waiting_avg,
            "requests.waiting_max": self.waiting_max,
            "kv_cache.usage": self.kv_usage_avg,
            "kv_cache.usage_avg": self.kv_usage_avg,
            "kv_cache.usage_max": self.kv_usage_max,
            "ttft.p50": self.ttft_p50,
            "ttft.p95": self.ttft_p95,
            "itl.p95": self.itl_p95,
            "e2e.p95": self.e2e_p95,
        }

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
    than three polls or no token counter.

    Saturated = the engine ran at its capacity, so that throughput measures it: requests waited on
    average at least `saturated_waiting`, or the batch ran full (running at 90 % of `max_num_seqs`), or
    the KV cache did (average usage at least `saturated_kv_usage`: memory, not the batch limit, bounds
    how many run — vLLM preempts rather than queues then).
    """
    inside = [p for p in points if start <= p.t <= end]
    if len(inside) < 3:
        return None
    first, last = inside[0], inside[-1]
    seconds = last.t - first.t
    if seconds <= 0:
        return None
    per_poll = _per_poll_rates(inside, "generation_tokens_total")
    if not per_poll:
        return None
    running = _gauge(inside, "requests_running")
    waiting = _gauge(inside, "requests_waiting")
    kv = _gauge(inside, "kv_cache_usage")
    completed = _histogram_increase(first.sample.e2e_latency, last.sample.e2e_latency)
    completed_n = completed[1][-1] if completed else None
    prompt = _increase(first.sample.prompt_tokens_total, last.sample.prompt_tokens_total)
    generated = _increase(first.sample.generation_tokens_total, last.sample.generation_tokens_total)
    running_avg = statistics.fmean(running) if running else None
    waiting_avg = statistics.fmean(waiting) if waiting else None
    full = max_num_seqs is not None and running_avg is not None and running_avg >= 0.9 * max_num_seqs
    kv_avg = statistics.fmean(kv) if kv else None
    full = full or (kv_avg is not None and kv_avg >= saturated_kv_usage)
    return WindowStats(
        start=first.t,
        end=last.t,
        polls=len(inside),
        throughput=spread(per_poll),
        throughput_samples=tuple(per_poll),
        prompt_rate=None if prompt is None else prompt / seconds,
        completed_rate=None if completed_n is None else completed_n / seconds,
        prompt_tokens_per_request=_per_request(prompt, completed_n),
        generation_tokens_per_request=_per_request(generated, completed_n),
        preemption_rate=_rate(first.sample.preemptions_total, last.sample.preemptions_total, seconds),
        running_avg=running_avg,
        waiting_avg=waiting_avg,
        waiting_max=max(waiting) if waiting else None,
        kv_usage_avg=kv_avg,
        kv_usage_max=max(kv) if kv else None,
        ttft_p50=_quantile(first.sample.ttft, last.sample.ttft, 0.5),
        ttft_p95=_quantile(first.sample.ttft, last.sample.ttft, 0.95),
        itl_p95=_quantile(first.sample.inter_token_latency, last.sample.inter_token_latency, 0.95),
        e2e_p95=_quantile(first.sample.e2e_latency, last.sample.e2e_latency, 0.95),
        saturated=bool((waiting_avg is not None and waiting_avg >= saturated_waiting) or full),
    )


def spread(values: Sequence[float]) -> Spread:
    ordered = sorted(values)
    if len(ordered) < 2:
        value = ordered[0] if ordered else 0.0
        return Spread(value, value, value, len(ordered))
    q1, q2, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return Spread(q2, q1, q3, len(ordered))


def ratio_interval(
    before: Sequence[float], after: Sequence[float], *, resamples: int = 400, seed: int = 0
) -> tuple[float, float] | None:
    """A 90 % bootstrap interval of median(after) / median(before) (seeded: the same samples give the
    same interval). None without samples or with a zero median before."""
    if not before or not after:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        b = statistics.median(rng.choices(before, k=len(before)))
        a = statistics.median(rng.choices(after, k=len(after)))
        if b > 0:
            ratios.append(a / b)
    if len(ratios) < resamples // 2:
        return None
    ratios.sort()
    return ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1]


def _per_poll_rates(points: Sequence[Point], field: str) -> list[float]:
    rates = []
    for a, b in pairwise(points):
        va, vb = getattr(a.sample, field), getattr(b.sample, field)
        if va is None or vb is None or b.t <= a.t or vb < va:  # a decrease is a reset: not this run
            continue
        rates.append((vb - va) / (b.t - a.t))
    return rates


def _gauge(points: Sequence[Point], field: str) -> list[float]:
    return [v for p in points if (v := getattr(p.sample, field)) is not None]


def _increase(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b < a else b - a


def _rate(a: float | None, b: float | None, seconds: float) -> float | None:
    increase = _increase(a, b)
    return None if increase is None else increase / seconds


def _per_request(total: float | None, requests: float | None) -> float | None:
    return None if total is None or not requests else total / requests


def _histogram_increase(
    a: Histogram | None, b: Histogram | None
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    if a is None or b is None:
        return None
    les_a, les_b = tuple(le for le, _ in a.buckets), tuple(le for le, _ in b.buckets)
    if les_a != les_b or not les_b:
        return None
    delta = tuple(cb - ca for (_, ca), (_, cb) in zip(a.buckets, b.buckets, strict=True))
    if any(d < 0 for d in delta):
        return None
    return les_b, delta


def _quantile(a: Histogram | None, b: Histogram | None, q: float) -> float | None:
    increase = _histogram_increase(a, b)
    if increase is None or increase[1][-1] <= 0:
        return None
    return histogram_quantile(q, increase[0], increase[1])


def relative_change(before: float | None, after: float | None) -> float | None:
    """(after − before) / before, None when either is unknown or before is 0."""
    if before is None or after is None or before == 0:
        return None
    return (after - before) / before


def load_differs(before: WindowStats, after: WindowStats, tolerance: float) -> str | None:
    """How the offered load differs between the windows beyond `tolerance`, or None when it does not.

    Per-request sizes (prompt and generated tokens) always; then, saturated, the requests outstanding
    (running + waiting: a closed loop offers a concurrency, and its request rate is the effect being
    measured); unsaturated, the request rate.
    """
    checks: list[tuple[str, float | None, float | None]] = [
        ("prompt tokens per request", before.prompt_tokens_per_request, after.prompt_tokens_per_request),
        (
            "generated tokens per request",
            before.generation_tokens_per_request,
            after.generation_tokens_per_request,
        ),
    ]
    if before.saturated or after.saturated:
        checks.append(("requests outstanding", _outstanding(before), _outstanding(after)))
    else:
        checks.append(("requests per second", before.completed_rate, after.completed_rate))
    for what, b, a in checks:
        change = relative_change(b, a)
        if change is not None and abs(change) > tolerance:
            return f"{what} {b:.3g} → {a:.3g} ({change:+.0%})"  # type: ignore[str-format]
    return None


def _outstanding(stats: WindowStats) -> float | None:
    if stats.running_avg is None or stats.waiting_avg is None:
        return None
    return stats.running_avg + stats.waiting_avg


def signal_values(stats: WindowStats | None, live: Mapping[str, float | None]) -> dict[str, float | None]:
    """A window's figures, completed by the live signals for what a window does not compute (memory,
    swap, host figures): what a rule's terms are evaluated against after a trial."""
    values = dict(live)
    if stats is not None:
        values.update(stats.signals())
    return values
