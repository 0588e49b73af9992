"""core/stats.py: the intervals the decisions act on, against published values and simulated series."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from tunerd.core.stats import (
    Interval,
    effective_samples,
    mean_ratio_interval,
    min_detectable_effect,
    proportion_difference,
    relative_noise,
    starts_ratio,
    wilson,
    window_for,
)


def ar1(n: int, phi: float, rng: random.Random, mean: float = 100.0, sd: float = 10.0) -> list[float]:
    """An autocorrelated series like per-second throughput (AR(1) with stationary `sd`)."""
    innovation = sd * math.sqrt(1 - phi * phi)
    x, out = rng.gauss(0, sd), []
    for _ in range(n):
        x = phi * x + rng.gauss(0, innovation)
        out.append(mean + x)
    return out


def test_wilson_matches_the_published_interval() -> None:
    # Newcombe (1998), Table I: 81 of 263 → 0.2553–0.3662 at 95 %.
    interval = wilson(81, 263, confidence=0.95)
    assert interval is not None
    assert (round(interval.lo, 4), round(interval.hi, 4)) == (0.2553, 0.3662)
    assert wilson(0, 0) is None
    everything = wilson(10, 10)
    assert everything is not None and everything.hi == 1.0 and everything.lo < 1.0  # never [1, 1]


def test_newcombes_difference_matches_the_published_interval() -> None:
    # Newcombe (1998), Table II example (a): 56/70 − 48/80 = 0.2000, method 10: 0.0524–0.3339 at 95 %.
    interval = proportion_difference(48, 80, 56, 70, confidence=0.95)
    assert interval is not None
    assert (round(interval.lo, 4), round(interval.hi, 4)) == (0.0524, 0.3339)
    assert proportion_difference(1, 0, 1, 1) is None


def test_the_noise_of_a_mean_counts_autocorrelated_seconds_once() -> None:
    """On autocorrelated samples the noise of the mean is near the true one (the spread of many windows'
    means); the i.i.d. standard error, which counts every second as new evidence, is far below it."""
    rng = random.Random(5)
    n, phi = 60, 0.8
    true = statistics.stdev(statistics.fmean(ar1(n, phi, rng)) for _ in range(400)) / 100.0
    windows = [ar1(n, phi, rng) for _ in range(40)]
    noise = statistics.median(relative_noise(w) or 0.0 for w in windows)
    iid = statistics.median(statistics.stdev(w) / math.sqrt(n) / statistics.fmean(w) for w in windows)
    assert iid < 0.45 * true  # what the old i.i.d. bootstrap saw
    assert 0.75 * true < noise < 1.25 * true, (true, noise, iid)
    assert effective_samples([float(i % 2) for i in range(40)]) == 40  # alternating: ρ < 0 counts as 0


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.8])
def test_the_ratio_interval_covers_the_true_ratio_as_often_as_it_says(phi: float) -> None:
    rng = random.Random(int(phi * 10))
    covered = 0
    for _ in range(300):
        interval = mean_ratio_interval(ar1(60, phi, rng), ar1(60, phi, rng, mean=110.0))
        assert interval is not None
        covered += interval.lo < 1.1 < interval.hi
    assert covered / 300 >= 0.84, covered  # nominal 90 %


def test_the_ratio_interval_needs_samples_and_a_positive_mean() -> None:
    after = [1.0, 2.0, 3.0]
    assert mean_ratio_interval([1.0, 2.0], after) is None
    assert mean_ratio_interval([0.0, 0.0, 0.0], after) is None


def test_side_of_says_where_the_interval_lies() -> None:
    assert Interval(1.06, 1.2).side_of(1.05) == "above"
    assert Interval(0.9, 1.04).side_of(1.05) == "below"
    assert Interval(1.0, 1.1).side_of(1.05) is None


def test_the_minimum_detectable_effect_and_the_window_it_needs() -> None:
    # z(0.95) + z(0.90) = 1.645 + 1.282 = 2.926, times √2 × 5 % of noise per window.
    assert min_detectable_effect(0.05, 0.05) == pytest.approx(0.2069, abs=1e-4)
    # Halving the effect to detect needs four times the window.
    needed = window_for(0.2069 / 2, 0.05, 30.0)
    assert needed == pytest.approx(120.0, rel=1e-3)
    assert window_for(0.0, 0.05, 30.0) == math.inf


# -- several vLLM starts a side (starts_ratio) ------------------------------------------------------------


def test_one_start_a_side_gives_the_plain_ratio_interval_with_the_start_noise() -> None:
    rng = random.Random(3)
    before, after = ar1(60, 0.3, rng), ar1(60, 0.3, rng, mean=110.0)
    plain = mean_ratio_interval(before, after, confidence=0.95, start_noise=0.05)
    several = starts_ratio([before], [after], confidence=0.95, start_noise=0.05)
    assert plain is not None and several is not None
    assert (several.interval.lo, several.interval.hi) == pytest.approx((plain.lo, plain.hi))
    assert several.start_noise == pytest.approx(0.05) and several.starts == (1, 1)


def test_more_starts_a_side_narrow_the_part_the_spread_between_starts_leaves() -> None:
    rng = random.Random(4)
    one = starts_ratio([ar1(60, 0.0, rng)], [ar1(60, 0.0, rng, mean=110.0)], start_noise=0.05)
    four = starts_ratio(
        [ar1(60, 0.0, rng) for _ in range(4)], [ar1(60, 0.0, rng, mean=110.0) for _ in range(4)],
        start_noise=0.05,
    )  # fmt: skip
    assert one is not None and four is not None
    assert one.limited_by_starts and four.between < one.between / 1.8
    assert four.interval.hi / four.interval.lo < one.interval.hi / one.interval.lo


def test_starts_that_disagree_more_than_the_setting_widen_their_own_interval() -> None:
    rng = random.Random(5)
    means = (80.0, 120.0, 90.0, 115.0)  # a spread of about 19 % a start, told 5 %
    spread = starts_ratio(
        [ar1(60, 0.0, rng, mean=m) for m in means], [ar1(60, 0.0, rng, mean=m * 1.1) for m in means],
        start_noise=0.05,
    )  # fmt: skip
    assert spread is not None and spread.start_noise > 0.1
    assert starts_ratio([[1.0, 2.0]], [[1.0, 2.0, 3.0]]) is None  # a window without a noise figure
