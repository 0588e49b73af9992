"""Weigh two windows' samples (pure): the evidence of the ratio after/before of an objective's mean, the
figures behind it, and the noise meter — what policy/verdict.py decides a trial on and `tunerd status`
shows (issue 22). The statistics are core/stats.py's: the noise of a window's mean over its effective
samples, and `start_noise`, the spread of one vLLM start's mean that no window of it sees (a trial's two
windows are of two starts)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

from tunerd.core import stats

# What the evidence says of a performance change (`Verdict.evidence`).
Evidence = Literal["better", "worse", "no difference", "no difference (budget spent)"]
SPENT: Evidence = "no difference (budget spent)"


@dataclass(frozen=True)
class Weighed:
    """What the samples of two windows say of the ratio after/before against `1 ± tolerance`: the
    evidence (None: the interval straddles 1 + tolerance — not yet told) and its figures."""

    evidence: Evidence | None
    interval: stats.Interval | None
    figures: dict[str, object]


def weigh_ratio(
    before: Sequence[float],
    after: Sequence[float],
    *,
    tolerance: float,
    confidence: float,
    spent: bool,
    start_noise: float = 0.0,
) -> Weighed:
    """The evidence of the ratio mean(after) / mean(before) (the module doc's rule), for an objective
    where higher is better; `spent`: the extension budget is spent (a straddle is then "no difference
    (budget spent)"); `start_noise`: the spread of a vLLM start's mean that no window of it sees (the two
    windows are of two starts). No interval (fewer than three samples a side, no positive mean): "no
    difference"."""
    interval = stats.mean_ratio_interval(before, after, confidence=confidence, start_noise=start_noise)
    figures = sample_figures(before, after, confidence=confidence, start_noise=start_noise)
    figures["ratio_interval"] = interval.as_list() if interval is not None else None
    if interval is None:
        return Weighed("no difference", None, figures)
    if interval.side_of(1 + tolerance) == "above":
        return Weighed("better", interval, figures)
    if interval.side_of(1 - tolerance) == "below":
        return Weighed("worse", interval, figures)
    if interval.side_of(1 + tolerance) == "below":
        return Weighed("no difference", interval, figures)
    # Longer windows shrink the windows' own noise, never the spread between starts: when the ratio at
    # the high end of what the windows allow, with only that spread left, could not clear 1 + tolerance,
    # no window can.
    within = stats.mean_ratio_interval(before, after, confidence=confidence)
    floor = math.exp(NormalDist().inv_cdf(0.5 + confidence / 2) * math.sqrt(2) * start_noise)
    if start_noise > 0 and within is not None and within.hi / floor <= 1 + tolerance:
        figures["no_window_can_tell"] = f"the spread between starts ({start_noise:.0%} a start) hides it"
        return Weighed("no difference", interval, figures)
    return Weighed(SPENT if spent else None, interval, figures)


def sample_figures(
    before: Sequence[float], after: Sequence[float], *, confidence: float, start_noise: float = 0.0
) -> dict[str, object]:
    """The samples behind a ratio, for the journal: n and effective n on each side, each window's
    relative noise, the spread between starts counted, and the minimum detectable effect they imply
    (core/stats.py)."""
    noise_b, noise_a = stats.relative_noise(before), stats.relative_noise(after)
    mde = None
    if noise_b is not None and noise_a is not None:
        mde = stats.min_detectable_effect(noise_b, noise_a, confidence=confidence, start_noise=start_noise)
        mde = round(mde, 4)
    return {
        "confidence": confidence,
        "start_noise": start_noise,
        "n_before": len(before),
        "n_after": len(after),
        "effective_n_before": round(stats.effective_samples(before), 1) if len(before) >= 3 else None,
        "effective_n_after": round(stats.effective_samples(after), 1) if len(after) >= 3 else None,
        "noise_before": None if noise_b is None else round(noise_b, 4),
        "noise_after": None if noise_a is None else round(noise_a, 4),
        "min_detectable_effect": mde,
    }


def noise_meter(
    samples: Sequence[float],
    *,
    window_s: float,
    tolerance: float,
    confidence: float,
    start_noise: float = 0.0,
) -> dict[str, object] | None:
    """The noise meter (`tunerd status`): the relative noise of one window's mean of `samples` (the
    last `window_s` of the configuration in force); the smallest change two such windows detect within
    one start and across a restart (with `start_noise` on each side); the window length that would
    detect `tolerance` within a start and, across a restart, whether any window can (None: the spread
    between starts alone hides it) and how many starts a side would. None with too few samples."""
    noise = stats.relative_noise(samples)
    if noise is None:
        return None
    need = stats.window_for(tolerance, noise, window_s, confidence=confidence)
    across = stats.min_detectable_effect(noise, noise, confidence=confidence, start_noise=start_noise)
    floor = stats.min_detectable_effect(0.0, 0.0, confidence=confidence, start_noise=start_noise)
    # Across a restart: the window whose own noise leaves room under the tolerance for the starts' part.
    room = tolerance**2 - floor**2
    within = stats.min_detectable_effect(noise, noise, confidence=confidence)
    need_across = window_s * within**2 / room if room > 0 else None
    return {
        "window_s": window_s,
        "samples": len(samples),
        "effective_samples": round(stats.effective_samples(samples), 1),
        "relative_noise": round(noise, 4),
        "min_detectable_effect": round(within, 4),
        "start_noise": start_noise,
        "min_detectable_effect_across_starts": round(across, 4),
        "tolerance": tolerance,
        "window_for_tolerance_s": None if need == float("inf") else round(need, 1),
        "window_for_tolerance_across_starts_s": None if need_across is None else round(need_across, 1),
        "starts_per_arm_for_tolerance": stats.starts_per_arm(tolerance, start_noise, confidence=confidence),
    }
