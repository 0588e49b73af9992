"""What one scrape of vLLM's /metrics says: the families tunerd reads, aggregated over series.

Built by `tunerd.observe.vllm_metrics`; read by the signal window (core/signal_window.py) and by the
trial evidence (policy/evidence.py), which compute rates and quantiles from two samples' difference.
`histogram_quantile` is Prometheus' own interpolation.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True, slots=True)
class Histogram:
    """A histogram aggregated over its series: `buckets` are (le, cumulative count) sorted by le with
    `+Inf` last; `count` and `sum` are the summed `_count` and `_sum` samples."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float


@dataclass(frozen=True, slots=True)
class EngineSample:
    """The families tunerd reads from one `/metrics` body, aggregated over series (`model_name`,
    `engine`, ...): counters and running/waiting summed, KV usage the max, buckets summed by `le`.
    A field is None when its family is absent from the body; None never means 0.
    `cache_config` is the label dict of the first `vllm:cache_config_info` series (label set varies
    by vLLM version)."""

    kv_cache_usage: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    ttft: Histogram | None = None
    inter_token_latency: Histogram | None = None
    e2e_latency: Histogram | None = None
    queue_time: Histogram | None = None
    # vllm:request_time_per_output_token_seconds: per request, (decode time)/(n − 1), 0 when n ≤ 1; read
    # for the attainment estimate at a TPOT target (core/slo_estimate.py), not for a percentile signal.
    request_tpot: Histogram | None = None
    # vllm:request_prompt_tokens / vllm:request_generation_tokens: observed once per finished request, so
    # the increase of sum over count between two polls is the mean size of the requests finished between
    # them — unlike the token counters, which count a request's prompt at its first token and its output
    # as it comes (policy/evidence.py).
    request_prompt_tokens: Histogram | None = None
    request_generation_tokens: Histogram | None = None
    cache_config: Mapping[str, str] | None = None


def histogram_quantile(q: float, bounds: tuple[float, ...], cumulative: tuple[float, ...]) -> float | None:
    """Prometheus' `histogram_quantile` (promql/quantile.go `bucketQuantile`) for one histogram.

    `bounds` are the sorted upper bounds ending with +Inf, `cumulative` the cumulative counts. Returns
    None where Prometheus returns NaN (no observations, no +Inf bucket, fewer than two buckets).
    """
    if not 0.0 <= q <= 1.0 or len(bounds) < 2 or bounds[-1] != math.inf:
        return None
    return bucket_quantile(q, bounds, monotonic_counts(cumulative))


def monotonic_counts(cumulative: Iterable[float]) -> list[float]:
    # ensureMonotonic: a reset mid-window can leave small dips (a running max from 0, in C).
    return list(accumulate(cumulative, max, initial=0.0))[1:]


def bucket_quantile(q: float, bounds: tuple[float, ...], counts: list[float]) -> float | None:
    """`histogram_quantile` over counts already made monotonic (valid q, bounds ending with +Inf)."""
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = _bucket_index(rank, counts)
    if b == len(counts) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, count = 0.0, counts[b]
    if b > 0:
        start, count, rank = bounds[b - 1], count - counts[b - 1], rank - counts[b - 1]
    return start + (bounds[b] - start) * (rank / count)


def quantile_bucket(q: float, bounds: tuple[float, ...], counts: list[float]) -> tuple[float, float] | None:
    """The bucket `(lo, hi]` that `bucket_quantile` interpolates in, over the same monotonic counts: the
    bucket holding the ⌈q·N⌉-th of the N observations, so the true q-quantile (nearest rank) lies in it —
    an observation counts in the bucket whose `le` is the first at or above it, hence lo exclusive, hi
    inclusive. The first bucket's lower edge is 0 (Prometheus assumes no negative observation below a
    positive first bound; latencies are never negative); the `+Inf` bucket's upper edge is inf (there
    `histogram_quantile` answers its lower edge). None without observations, or where the first bound is
    not positive (no lower edge is known; vLLM's latency buckets all start above 0).

    Interpolation assumes the observations spread evenly in the bucket, which vLLM's coarse buckets do not
    bear out: the issue 21 run read TTFT p95 2.02 s between the 1.0 and 2.5 s edges while no client waited
    over 1.26 s, and ITL p95 9.5 ms in every window from the 0–10 ms bucket. The bucket is what is known.
    """
    total = counts[-1]
    if total <= 0:
        return None
    b = _bucket_index(q * total, counts)
    if b == 0:
        return (0.0, bounds[0]) if bounds[0] > 0 else None
    return bounds[b - 1], bounds[b]


def _bucket_index(rank: float, counts: list[float]) -> int:
    """The first bucket whose cumulative count reaches `rank`: it holds the rank-th observation."""
    return bisect_left(counts, rank, 0, len(counts) - 1)
