"""Weigh two windows' samples (pure): the evidence of the ratio after/before of an objective's mean, the
figures behind it, and the noise meter — what policy/verdict.py decides a trial on and `tunerd status`
shows (issue 22). The statistics are core/stats.py's: the noise of a window's mean over its effective
samples, and `start_noise`, the spread of one vLLM start's mean that no window of it sees (a trial's two
windows are of two starts; a comparison over several starts a side pools it with what they showed,
`core.stats.starts_ratio`)."""

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


# What a straddling ratio needs next: a longer window (the windows' own noise is the larger part) or
# another vLLM start a side (the spread between starts is, and no window removes it).
More = Literal["window", "start"]


@dataclass(frozen=True)
class Weighed:
    """What the samples of two sides say of the ratio after/before against `1 ± tolerance`: the
    evidence (None: the interval straddles 1 + tolerance — not yet told, and `more` says what would
    tell) and its figures."""

    evidence: Evidence | None
    interval: stats.Interval | None
    figures: dict[str, object]
    more: More | None = None


def weigh_ratio(
    before: Sequence[Sequence[float]],
    after: Sequence[Sequence[float]],
    *,
    tolerance: float,
    confidence: float,
    spent: bool,
    start_noise: float = 0.0,
    starts_left: bool = False,
    max_starts: int = 1,
) -> Weighed:
    """The evidence of the ratio of an objective's mean after/before (the module doc's rule), for an
    objective where higher is better. Each side is one window per vLLM start (`before[i]`: the per-poll
    samples of its i-th start; one start a side is the plain before/after); `start_noise`: the spread of
    a start's mean that no window of it sees (core/stats.starts_ratio pools it with the starts' own).
    A straddle asks for `more`: another start a side while `starts_left` and the spread between starts is
    the larger part of the noise (or, where there is such a spread, no window extension is left:
    `spent`), else a longer window while
    one is left, else it is "no difference (budget spent)". It is "no difference" at once when even the
    ratio's high end could not clear 1 + tolerance with only the spread between `max_starts` starts a
    side left: no window or start the trial may still spend could tell. No interval (fewer than three
    samples a side, no positive mean): "no difference"."""
    ratio = stats.starts_ratio(before, after, confidence=confidence, start_noise=start_noise)
    figures = sample_figures(before[-1], after[-1], confidence=confidence, start_noise=start_noise)
    interval = ratio.interval if ratio is not None else None
    figures["ratio_interval"] = interval.as_list() if interval is not None else None
    if ratio is None or interval is None:
        return Weighed("no difference", None, figures)
    figures.update(_starts_figures(ratio, confidence))
    if interval.side_of(1 + tolerance) == "above":
        return Weighed("better", interval, figures)
    if interval.side_of(1 - tolerance) == "below":
        return Weighed("worse", interval, figures)
    if interval.side_of(1 + tolerance) == "below":
        return Weighed("no difference", interval, figures)
    if _hopeless(ratio, tolerance, confidence, starts_left=starts_left, max_starts=max_starts):
        figures["no_window_can_tell"] = (
            f"the spread between starts ({ratio.start_noise:.1%} a start) hides it"
            + (f" at {max_starts} starts a side" if starts_left else "")
        )
        return Weighed("no difference", interval, figures)
    if starts_left and ratio.between > 0 and (ratio.limited_by_starts or spent):
        return Weighed(None, interval, figures, "start")
    return Weighed(SPENT if spent else None, interval, figures, None if spent else "window")


def _hopeless(
    ratio: stats.StartsRatio, tolerance: float, confidence: float, *, starts_left: bool, max_starts: int
) -> bool:
    """Even the most the trial may still spend could not make a keep: longer windows shrink the windows'
    own noise, never the spread between starts, and more starts shrink that only to `max_starts` a side.
    With no start left: the ratio at the high end the windows allow, with only the starts' spread left
    (the lower end of the best interval any window could give), stays at or below 1 + tolerance. With
    starts left: the ratio at the high end of the whole interval, with only the spread between
    `max_starts` starts a side left."""
    if ratio.between <= 0:
        return False
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    centre = math.sqrt(ratio.interval.lo * ratio.interval.hi)
    if not starts_left:
        best_low = centre * math.exp(z * (ratio.within - ratio.between))
    else:
        total = math.hypot(ratio.within, ratio.between)
        floor = ratio.start_noise * math.sqrt(2 / max_starts)
        best_low = centre * math.exp(z * (total - floor))
    return best_low <= 1 + tolerance


def _starts_figures(ratio: stats.StartsRatio, confidence: float) -> dict[str, object]:
    """The starts behind a ratio, for the journal: how many a side, their means, the spread of a start
    used (the setting pooled with the trial's own), the two parts of the noise and the smallest change
    all of it can detect."""
    z = NormalDist().inv_cdf
    total = math.hypot(ratio.within, ratio.between)
    return {
        "starts_before": ratio.starts[0],
        "starts_after": ratio.starts[1],
        "start_means_before": [round(m, 3) for m in ratio.means[0]],
        "start_means_after": [round(m, 3) for m in ratio.means[1]],
        "start_noise_pooled": round(ratio.start_noise, 4),
        "noise_within": round(ratio.within, 4),
        "noise_between_starts": round(ratio.between, 4),
        "min_detectable_effect": round((z(0.5 + confidence / 2) + z(stats.POWER)) * total, 4),
    }


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
