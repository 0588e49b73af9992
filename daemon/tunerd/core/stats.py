"""The statistics that let a decision beat the noise (pure; the standard library only).

A serving engine's per-second samples are autocorrelated: one long request spans many seconds, a
preemption storm lasts several, a closed loop's clients move in step. Counting each second as an
independent sample understates the noise — the explorer's 3 % tolerance was below the noise of one
~15 s window and it moved on noise (issue 22; docs/benchmarks.md: one configuration served 132–172 tok/s
across four windows). The noise of a window's mean is computed here over its *effective* samples,
n (1 − ρ) / (1 + ρ) with ρ the lag-1 autocorrelation (the variance of an AR(1) series' mean), which is
what a block bootstrap estimates, without its downward bias on windows of a minute: on a simulated AR(1)
window of 60 s at ρ = 0.8 the circular block bootstrap read 0.022 where the true noise was 0.037 and this
reads 0.032 (medians of 40 simulated windows, measured when this module was written;
tests/unit/test_stats.py checks this estimate against the truth).

Attainment is a proportion of requests, each one a trial: its interval is Wilson's score interval, and a
difference of two is Newcombe's (method 10), which keep their coverage near 0 and 1 where the normal
approximation does not.

Every interval here is two-sided at `confidence`; a decision that acts when the interval clears a
threshold on one side therefore errs on that side with at most (1 − confidence) / 2.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from statistics import NormalDist
from typing import Literal

CONFIDENCE = 0.90  # the decisions' default: a one-sided error of 5 %
POWER = 0.90  # the chance of seeing an effect of the minimum detectable size


@dataclass(frozen=True, slots=True)
class Interval:
    """A two-sided interval `[lo, hi]` at `confidence`."""

    lo: float
    hi: float
    confidence: float = CONFIDENCE

    def side_of(self, threshold: float) -> Literal["above", "below"] | None:
        """Where the whole interval lies against `threshold`: "above" (lo > threshold), "below"
        (hi < threshold), None when the interval straddles it (the evidence cannot tell yet)."""
        if self.lo > threshold:
            return "above"
        if self.hi < threshold:
            return "below"
        return None

    def as_list(self, digits: int = 4) -> list[float]:
        return [round(self.lo, digits), round(self.hi, digits)]


def lag1_autocorrelation(samples: Sequence[float]) -> float:
    """The lag-1 autocorrelation of `samples`, corrected for its small-sample bias (Kendall, 1954:
    the estimate falls short by about (1 + 3ρ) / n) and held within [0, 0.95]: a negative estimate is
    taken as independence (the conservative reading), and beyond 0.95 the window holds no evidence."""
    n = len(samples)
    if n < 3:
        return 0.0
    mean = sum(samples) / n
    centred = [x - mean for x in samples]
    variance = sum(c * c for c in centred)
    if variance <= 0:
        return 0.0
    rho = sum(a * b for a, b in pairwise(centred)) / variance
    return min(max(rho + (1 + 3 * rho) / n, 0.0), 0.95)


def effective_samples(samples: Sequence[float]) -> float:
    """How many independent samples `samples` are worth for their mean: n (1 − ρ) / (1 + ρ), the
    variance of an AR(1) series' mean (a burst of many seconds counts once, not once a second)."""
    rho = lag1_autocorrelation(samples)
    return len(samples) * (1 - rho) / (1 + rho)


def relative_noise(samples: Sequence[float]) -> float | None:
    """The noise of one window's mean: its standard error over the effective samples, divided by the
    mean (0.05: a window's mean is known to about ±5 %). None with fewer than three samples or a mean
    that is not positive."""
    if len(samples) < 3:
        return None
    mean = sum(samples) / len(samples)
    if mean <= 0:
        return None
    # The sample standard deviation in floats (statistics.stdev's exact arithmetic cost 80 % of the time
    # on windows of a thousand polls, which the trial verdict's simulation runs by the hundred).
    stdev = math.sqrt(sum((x - mean) ** 2 for x in samples) / (len(samples) - 1))
    return stdev / math.sqrt(effective_samples(samples)) / mean


def mean_ratio_interval(
    before: Sequence[float],
    after: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    start_noise: float = 0.0,
) -> Interval | None:
    """The interval of mean(after) / mean(before): normal on the log of the ratio, whose standard error
    is the two windows' relative noises and, when the windows are of two vLLM starts, `start_noise` for
    each (the relative spread of a start's mean that no window of it can see), added in quadrature. None
    when either window has no noise figure (fewer than three samples, a mean that is not positive)."""
    noise_before, noise_after = relative_noise(before), relative_noise(after)
    if noise_before is None or noise_after is None:
        return None
    ratio = statistics.fmean(after) / statistics.fmean(before)
    noise = math.hypot(noise_before, noise_after, start_noise, start_noise)
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * noise
    return Interval(ratio * math.exp(-half), ratio * math.exp(half), confidence)


# How many vLLM starts `[tuning] start_noise` stands for when a trial's own starts are pooled with it
# (`starts_ratio`): its default was measured over 6 starts (bench/noise.py), 5 degrees of freedom.
START_NOISE_PRIOR_DF = 5


@dataclass(frozen=True, slots=True)
class StartsRatio:
    """The ratio after/before of an objective's mean over several vLLM starts a side (`starts_ratio`).

    `interval`: of the geometric mean of the starts' ratios; `within` and `between`: the two parts of the
    log ratio's standard error — the windows' own noise (shrinks with a longer window and with more
    starts) and the spread between starts (shrinks only with more starts); `start_noise`: the spread of
    one start's mean used, `[tuning] start_noise` pooled with what the trial's own starts showed."""

    interval: Interval
    within: float
    between: float
    start_noise: float
    starts: tuple[int, int]
    means: tuple[tuple[float, ...], tuple[float, ...]]

    @property
    def limited_by_starts(self) -> bool:
        """The spread between starts is the larger part of the noise: another start a side buys more
        than a longer window."""
        return self.between >= self.within


def starts_ratio(
    before: Sequence[Sequence[float]],
    after: Sequence[Sequence[float]],
    *,
    confidence: float = CONFIDENCE,
    start_noise: float = 0.0,
    prior_df: float = START_NOISE_PRIOR_DF,
) -> StartsRatio | None:
    """The interval of the ratio after/before when each side is measured in one window of each of several
    vLLM starts (`before[i]`: the per-poll samples of the i-th start's window), normal on the log: each
    side's estimate is the mean of its starts' log means, whose variance is the windows' own noise
    (`relative_noise`, squared, over k²) plus the spread of a start's mean (s², over k). s² is
    `start_noise`² pooled with what the starts showed: the spread of each side's log means beyond what
    their windows' noise explains, weighted by its degrees of freedom against `prior_df` for the
    configured figure (a box noisier than its setting widens the interval; one start a side: the setting).
    One start a side gives `mean_ratio_interval`'s interval. None when a window has no noise figure."""
    sides = []
    for starts in (before, after):
        figures = [(statistics.fmean(s), relative_noise(s)) for s in starts if len(s) >= 3]
        if not figures or len(figures) != len(starts) or any(e is None or m <= 0 for m, e in figures):
            return None
        sides.append([(math.log(m), e or 0.0) for m, e in figures])
    excess, df = prior_df * start_noise**2, prior_df
    for side in sides:
        k = len(side)
        if k >= 2:
            centre = statistics.fmean(x for x, _ in side)
            spread = sum((x - centre) ** 2 for x, _ in side)
            excess += spread - sum(e * e for _, e in side) * (k - 1) / k
            df += k - 1
    pooled = math.sqrt(max(excess, 0.0) / df) if df > 0 else start_noise
    within_var = sum(sum(e * e for _, e in side) / len(side) ** 2 for side in sides)
    between_var = sum(pooled**2 / len(side) for side in sides)
    log_ratio = statistics.fmean(x for x, _ in sides[1]) - statistics.fmean(x for x, _ in sides[0])
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * math.sqrt(within_var + between_var)
    interval = Interval(math.exp(log_ratio - half), math.exp(log_ratio + half), confidence)
    means = tuple(tuple(math.exp(x) for x, _ in side) for side in sides)
    return StartsRatio(
        interval, math.sqrt(within_var), math.sqrt(between_var), pooled,
        (len(sides[0]), len(sides[1])), (means[0], means[1]),
    )  # fmt: skip


def min_detectable_effect(
    noise_before: float,
    noise_after: float,
    *,
    confidence: float = CONFIDENCE,
    power: float = POWER,
    start_noise: float = 0.0,
) -> float:
    """The smallest relative change that two windows with these relative noises (`relative_noise`), of
    two vLLM starts whose means spread by `start_noise` each (0: one start), detect with probability
    `power`, when a decision acts only on an interval at `confidence` that clears no-change: (z of the
    one-sided error + z of the power) × the noise of the ratio."""
    z = NormalDist().inv_cdf
    return (z(0.5 + confidence / 2) + z(power)) * math.hypot(
        noise_before, noise_after, start_noise, start_noise
    )


def window_for(
    effect: float,
    noise: float,
    window_s: float,
    *,
    confidence: float = CONFIDENCE,
    power: float = POWER,
) -> float:
    """How long each of two windows must be to detect a relative `effect`, when one window of
    `window_s` seconds has the relative noise `noise` (the noise of a mean shrinks as 1/√length)."""
    if effect <= 0:
        return math.inf
    shortest = min_detectable_effect(noise, noise, confidence=confidence, power=power)
    return window_s * (shortest / effect) ** 2


def starts_per_arm(
    effect: float, start_noise: float, *, confidence: float = CONFIDENCE, power: float = POWER
) -> int:
    """How many vLLM starts each side of a restart-grade comparison needs to detect a relative `effect`
    when a start's mean spreads by `start_noise` (long windows: the within-start noise left out): the
    part no window length removes, averaged over starts."""
    if start_noise <= 0:
        return 1
    if effect <= 0:
        return 10**9
    z = NormalDist().inv_cdf
    return max(
        1, math.ceil(((z(0.5 + confidence / 2) + z(power)) * math.sqrt(2) * start_noise / effect) ** 2)
    )


def wilson(successes: float, n: float, *, confidence: float = CONFIDENCE) -> Interval | None:
    """Wilson's score interval of a proportion `successes / n`; None without a trial."""
    if n <= 0:
        return None
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return Interval(max(0.0, centre - half), min(1.0, centre + half), confidence)


def proportion_difference(
    successes_before: float,
    n_before: float,
    successes_after: float,
    n_after: float,
    *,
    confidence: float = CONFIDENCE,
) -> Interval | None:
    """Newcombe's interval (method 10, from the two Wilson intervals) of p_after − p_before; None when
    a side has no trial."""
    before = wilson(successes_before, n_before, confidence=confidence)
    after = wilson(successes_after, n_after, confidence=confidence)
    if before is None or after is None:
        return None
    p1, p2 = successes_before / n_before, successes_after / n_after
    d = p2 - p1
    lo = d - math.sqrt((p2 - after.lo) ** 2 + (before.hi - p1) ** 2)
    hi = d + math.sqrt((after.hi - p2) ** 2 + (p1 - before.lo) ** 2)
    return Interval(lo, hi, confidence)
