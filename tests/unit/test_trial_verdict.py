"""A trial's evidence and verdict: window stats from synthetic per-poll samples, like-with-like load
checks, throughput when saturated and latency otherwise, latency limits, the seeded bootstrap."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any, Literal

import pytest

from tunerd.cli.story import trial_decided
from tunerd.config import TuningConfig
from tunerd.core.engine_sample import EngineSample, Histogram
from tunerd.core.signal_window import SignalWindow
from tunerd.core.stats import mean_ratio_interval
from tunerd.policy.evidence import (
    WINDOW_SIGNALS,
    Point,
    Spread,
    WindowStats,
    load_differs,
    signal_values,
    spread,
    window_signals,
    window_stats,
)
from tunerd.policy.verdict import Verdict, judge
from tunerd.tune.trials import Windows

BOUNDS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, math.inf)
# All observations in one bucket (lower, le]: p95 = lower + 0.95 × (le − lower).
ITL_FAST, ITL_SLOWER, ITL_SLOW, ITL_SLOWEST = 0.03, 0.04, 0.05, 0.06  # p95 0.0295, 0.0395, 0.0495, 0.0595
TTFT_OK, TTFT_SLOW = 0.25, 1.0  # p95 0.2425, 0.975


def histogram(observations: float, le: float) -> Histogram:
    """`observations` all in the bucket whose upper bound is `le` (cumulative buckets)."""
    buckets = tuple((bound, observations if bound >= le else 0.0) for bound in BOUNDS)
    return Histogram(buckets=buckets, count=observations, sum=observations * le)


def points(
    *,
    polls: int = 31,
    start: float = 0.0,
    dt: float = 1.0,
    gen_per_s: float = 100.0,
    req_per_s: float = 2.0,
    prompt_per_req: float = 200.0,
    running: float | None = 8.0,
    waiting: float | None = 2.0,
    kv: float | None = 0.5,
    itl_le: float = ITL_FAST,
    ttft_le: float = TTFT_OK,
    noise: float = 0.0,
    seed: int = 1,
    reset_at: int | None = None,
    arrivals_per_s: float | None = None,
) -> list[Point]:
    """One engine run's polls: cumulative counters growing at the given rates (per-interval generation
    noise of ±`noise`, seeded), gauges constant, latencies in one bucket each. `reset_at`: the generation
    counter restarts from 0 at that poll. `arrivals_per_s`: the door's arrivals counter grows at that rate
    (None: no door)."""
    rng = random.Random(seed)
    out, generated, offset = [], 0.0, 0.0
    for i in range(polls):
        t = start + i * dt
        if i:
            generated += gen_per_s * dt * (1 + rng.uniform(-noise, noise))
        if reset_at is not None and i == reset_at:
            offset = generated
        requests = req_per_s * i * dt
        sample = EngineSample(
            kv_cache_usage=kv,
            requests_running=running,
            requests_waiting=waiting,
            preemptions_total=0.0,
            prompt_tokens_total=requests * prompt_per_req,
            generation_tokens_total=generated - offset,
            ttft=histogram(requests, ttft_le),
            inter_token_latency=histogram(generated, itl_le),
            e2e_latency=histogram(requests, 5.0),
        )
        door = {} if arrivals_per_s is None else {"door.arrivals_total": arrivals_per_s * i * dt}
        out.append(Point(t, sample, door))
    return out


def stats(max_num_seqs: int | None = None, **kw: Any) -> WindowStats:
    series = points(**kw)
    result = window_stats(series, series[0].t, series[-1].t, max_num_seqs=max_num_seqs, saturated_waiting=0.5)
    assert result is not None
    return result


def saturated(**kw: Any) -> WindowStats:
    return stats(**{"running": 8.0, "waiting": 2.0, **kw})


def unsaturated(**kw: Any) -> WindowStats:
    return stats(**{"running": 4.0, "waiting": 0.0, **kw})


def verdict(
    before: WindowStats,
    after: WindowStats,
    *,
    purpose: Literal["performance", "safety"] = "performance",
    eased: bool = True,
    budget_spent: bool = False,
    **settings: Any,
) -> Verdict:
    return judge(
        before,
        after,
        # The windows' own noise; the spread between vLLM starts is test_a_spread_between_starts_….
        tuning=TuningConfig(**{"start_noise": 0.0, **settings}),
        purpose=purpose,
        eased=eased,
        budget_spent=budget_spent,
    )


# -- window stats ----------------------------------------------------------------------------------


def test_window_stats_give_the_rates_sizes_and_latencies_of_the_window() -> None:
    s = saturated()
    assert (s.polls, s.seconds) == (31, 30.0)
    assert s.throughput.median == pytest.approx(100.0)
    assert s.prompt_rate == pytest.approx(400.0)
    assert s.completed_rate == pytest.approx(2.0)
    assert s.prompt_tokens_per_request == pytest.approx(200.0)
    assert s.generation_tokens_per_request == pytest.approx(50.0)
    assert s.preemption_rate == 0.0
    assert (s.running_avg, s.waiting_avg, s.kv_usage_avg) == (8.0, 2.0, 0.5)
    assert s.itl_p95 == pytest.approx(0.0295)
    assert s.ttft_p95 == pytest.approx(0.2425)


def sized(series: list[Point], prompt: float, output: float, finished_per_s: float) -> list[Point]:
    """`series` with vLLM's per-request size histograms: `finished_per_s` requests finish a second, each
    of `prompt` and `output` tokens."""
    out = []
    for p in series:
        done = finished_per_s * p.t
        sizes = {
            "request_prompt_tokens": Histogram(((math.inf, done),), done, done * prompt),
            "request_generation_tokens": Histogram(((math.inf, done),), done, done * output),
        }
        out.append(replace(p, sample=replace(p.sample, **sizes)))
    return out


def test_request_sizes_come_from_the_per_request_histograms_when_vllm_has_them() -> None:
    # The token counters admit 1.33x the requests the window finishes (a window that admits more than it
    # finishes, as under preemption): their ratio reads 21.3 prompt tokens a request where every one had 16.
    series = sized(points(req_per_s=2.0, prompt_per_req=16.0), prompt=16.0, output=256.0, finished_per_s=1.5)
    s = window_stats(series, 0.0, 30.0, max_num_seqs=None, saturated_waiting=0.5)
    assert s is not None and s.completed_rate == pytest.approx(2.0)
    assert s.prompt_tokens_per_request == pytest.approx(16.0)
    assert s.generation_tokens_per_request == pytest.approx(256.0)
    # None finished in the window: the counters' ratio, as without the histograms.
    idle = sized(points(prompt_per_req=16.0), prompt=16.0, output=256.0, finished_per_s=0.0)
    s = window_stats(idle, 0.0, 30.0, max_num_seqs=None, saturated_waiting=0.5)
    assert s is not None and s.prompt_tokens_per_request == pytest.approx(16.0)
    assert s.generation_tokens_per_request == pytest.approx(50.0)


def test_requests_waiting_on_average_make_a_window_saturated() -> None:
    assert saturated().saturated
    assert not unsaturated().saturated


def test_a_full_batch_makes_a_window_saturated_without_waiting() -> None:
    assert stats(running=7.5, waiting=0.0, max_num_seqs=8).saturated
    assert not stats(running=7.0, waiting=0.0, max_num_seqs=8).saturated


def test_fewer_than_three_polls_give_no_stats() -> None:
    series = points(polls=2)
    assert window_stats(series, 0.0, 10.0, max_num_seqs=None, saturated_waiting=0.5) is None


def test_three_polls_give_stats() -> None:
    series = points(polls=3)
    assert window_stats(series, 0.0, 10.0, max_num_seqs=None, saturated_waiting=0.5) is not None


def test_polls_outside_the_window_are_not_counted() -> None:
    series = points(polls=31)
    inside = window_stats(series, 10.0, 20.0, max_num_seqs=None, saturated_waiting=0.5)
    assert inside is not None
    assert (inside.polls, inside.start, inside.end) == (11, 10.0, 20.0)


def test_a_window_without_a_token_counter_gives_no_stats() -> None:
    series = [Point(float(t), EngineSample(requests_running=1.0)) for t in range(5)]
    assert window_stats(series, 0.0, 10.0, max_num_seqs=None, saturated_waiting=0.5) is None


def test_a_counter_reset_inside_a_window_is_not_counted_as_negative_throughput() -> None:
    s = stats(reset_at=15)
    assert min(s.throughput_samples) >= 0
    assert len(s.throughput_samples) == 29  # the interval across the reset is left out
    assert s.throughput.median == pytest.approx(100.0)


def queue_building_up(polls: int = 31) -> list[Point]:
    """Polls where the last value and the window's mean disagree (the queue builds up at the end), and
    the per-poll throughput's median differs from the counter's rate (one burst), with host readings."""
    series = points(polls=polls, noise=0.0)
    out = []
    for i, p in enumerate(series):
        assert p.sample is not None
        burst = 2000.0 * max(0, i - (polls - 3))  # 2000 tokens more in each of the last two intervals
        sample = replace(
            p.sample,
            requests_waiting=12.0 if i == polls - 1 else 0.0,
            generation_tokens_total=p.sample.generation_tokens_total + burst,
        )
        readings = {"host.mem_available_bytes": 4e9 - i * 1e8, "host.mem_total_bytes": 8e9}
        out.append(Point(p.t, sample, readings))
    return out


def test_a_window_computes_every_signal_as_the_rules_window_does() -> None:
    # Issue 20: one definition per name. The trial's windows replay the rules' own SignalWindow.
    series = queue_building_up()
    live = SignalWindow(30.0)
    for p in series:
        live.add(p.t, p.sample, p.readings)
    replayed = window_signals(series, series[0].t, series[-1].t)
    assert replayed == {name: live.signals()[name] for name in WINDOW_SIGNALS}
    s = window_stats(series, series[0].t, series[-1].t, max_num_seqs=None, saturated_waiting=0.5)
    assert s is not None and s.signals() == replayed
    assert replayed["memory.used_ratio"] == pytest.approx(0.875)  # the host readings, latest poll


def test_a_window_reads_each_name_as_the_rules_do_where_last_and_mean_differ() -> None:
    # Issue 20: the verdict's window said `requests.waiting` was the mean and `throughput.generation` the
    # per-poll median; the rules read the last value and the counter's rate.
    series = queue_building_up()
    s = window_stats(series, series[0].t, series[-1].t, max_num_seqs=None, saturated_waiting=0.5)
    assert s is not None
    values = s.signals()
    assert values["requests.waiting"] == 12.0  # the last poll's
    assert values["requests.waiting_avg"] == pytest.approx(12.0 / 31) == s.waiting_avg
    assert values["requests.waiting_max"] == 12.0
    assert s.throughput.median == pytest.approx(100.0)  # the per-poll spread, for the bootstrap
    assert values["throughput.generation"] == pytest.approx((3000.0 + 4000.0) / 30.0)  # the counter's rate


def test_spread_is_the_median_and_quartiles() -> None:
    assert spread([5.0, 1.0, 3.0, 2.0, 4.0]) == Spread(3.0, 2.0, 4.0, 5)


def test_spread_of_one_value_is_that_value() -> None:
    one = spread([7.0])
    assert (one.median, one.p25, one.p75, one.n) == (7.0, 7.0, 7.0, 1)


def test_signal_values_complete_the_window_with_live_signals() -> None:
    live = {"probe.throughput": 900.0, "memory.used_ratio": 0.4, "throughput.generation": 1.0}
    values = signal_values(saturated().signals(), live)
    assert values["probe.throughput"] == 900.0  # no window computes the probe's figures
    assert values["throughput.generation"] == pytest.approx(100.0)  # the window's figure wins
    assert values["itl.p95"] == pytest.approx(0.0295)
    # The window computes memory too (from the polls' readings; none here): unknown, not the live value.
    assert values["memory.used_ratio"] is None


def test_signal_values_without_a_window_are_the_live_signals() -> None:
    assert signal_values(None, {"memory.used_ratio": 0.4}) == {"memory.used_ratio": 0.4}


# -- the offered load ------------------------------------------------------------------------------


def test_a_change_in_prompt_tokens_per_request_is_a_load_change() -> None:
    differs = load_differs(saturated(), saturated(prompt_per_req=400.0), 0.25)
    assert differs is not None
    assert differs.startswith("prompt tokens per request")


def test_a_change_in_generated_tokens_per_request_is_a_load_change() -> None:
    differs = load_differs(saturated(), saturated(gen_per_s=200.0), 0.25)
    assert differs is not None
    assert differs.startswith("generated tokens per request")


def test_saturated_a_change_in_requests_outstanding_is_a_load_change() -> None:
    differs = load_differs(saturated(), saturated(waiting=12.0), 0.25)
    assert differs is not None
    assert differs.startswith("requests outstanding")


def test_an_open_loops_backlog_at_the_same_arrival_rate_is_not_a_load_change() -> None:
    # Poisson arrivals at 2/s through the door: after a restart's hold the backlog (outstanding requests)
    # is five times larger, the offered load the same (the H200's open loop: "outstanding 53.6 → 247").
    before = saturated(arrivals_per_s=2.0)
    assert before.values["door.arrival_rate"] == pytest.approx(2.0)
    assert load_differs(before, saturated(waiting=40.0, arrivals_per_s=2.1), 0.25) is None
    # Another arrival rate is another load, and so is a backlog the door cannot speak for.
    differs = load_differs(before, saturated(waiting=40.0, arrivals_per_s=4.0), 0.25)
    assert differs is not None and differs.startswith("requests outstanding")
    assert "arrivals per second 2 → 4 (+100%)" in differs
    assert load_differs(saturated(), saturated(waiting=40.0), 0.25) is not None


def test_saturated_a_change_in_request_rate_alone_is_not_a_load_change() -> None:
    assert load_differs(saturated(), saturated(gen_per_s=150.0, req_per_s=3.0), 0.25) is None


def test_unsaturated_a_change_in_request_rate_is_a_load_change() -> None:
    differs = load_differs(unsaturated(), unsaturated(gen_per_s=200.0, req_per_s=4.0), 0.25)
    assert differs is not None
    assert differs.startswith("requests per second")


def test_unsaturated_a_change_in_requests_running_alone_is_not_a_load_change() -> None:
    assert load_differs(unsaturated(), unsaturated(running=2.0), 0.25) is None


def test_a_load_change_within_the_tolerance_is_not_a_load_change() -> None:
    assert load_differs(saturated(), saturated(prompt_per_req=240.0), 0.25) is None


# -- saturated: throughput decides -----------------------------------------------------------------


def test_saturated_clearly_worse_throughput_is_reverted() -> None:
    result = verdict(saturated(), saturated(gen_per_s=80.0, req_per_s=1.6))
    assert result.decision == "revert"
    assert result.objective == "throughput.generation"
    assert "worse" in result.reason


def test_saturated_better_throughput_with_the_condition_eased_is_kept() -> None:
    result = verdict(saturated(), saturated(gen_per_s=120.0, req_per_s=2.4))
    assert result.decision == "keep"
    assert (result.objective, result.unit) == ("throughput.generation", "tok/s")
    assert (result.before, result.after) == (pytest.approx(100.0), pytest.approx(120.0))


def test_a_spread_between_starts_widens_the_interval_whatever_the_windows() -> None:
    # The two windows are of two vLLM starts: a start's mean spreads by `start_noise`, which no window
    # of it sees. +20 % on quiet windows is "better" alone, not with 10 % a start (it could be the starts).
    before, after = saturated(), saturated(gen_per_s=120.0, req_per_s=2.4)
    assert verdict(before, after).evidence == "better"
    spread = verdict(before, after, start_noise=0.10)
    assert (spread.decision, spread.evidence) == ("revert", "no difference")  # no window could tell
    assert spread.interval is not None and spread.interval[0] < 1.05 < spread.interval[1]
    assert spread.figures["start_noise"] == 0.10
    hidden_by = "the spread between starts (10.0% a start) hides it"
    assert spread.figures["no_window_can_tell"] == hidden_by
    # The reason says so, not "beyond the tolerance": the interval straddles 1 + tolerance.
    assert spread.reason.endswith("no difference any window could tell: " + hidden_by)
    # At 3 % a start a longer window could still tell: extended.
    assert verdict(before, after, start_noise=0.03).decision in ("keep", "extend")
    assert spread.figures["min_detectable_effect"] > 0.45  # (1.96 + 1.28) × √2 × 10 % and more


def test_saturated_throughput_within_the_tolerance_is_no_difference_and_reverted() -> None:
    # Issue 22: a performance change that buys nothing the evidence can see is not kept.
    result = verdict(saturated(), saturated(gen_per_s=103.0, req_per_s=2.06))
    assert (result.decision, result.evidence) == ("revert", "no difference")


def test_saturated_better_throughput_without_the_condition_easing_is_reverted() -> None:
    result = verdict(saturated(), saturated(gen_per_s=120.0, req_per_s=2.4), eased=False)
    assert result.decision == "revert"
    assert "did not ease" in result.reason


# -- unsaturated: latency decides ------------------------------------------------------------------


def test_unsaturated_a_worse_itl_is_reverted() -> None:
    result = verdict(unsaturated(), unsaturated(itl_le=ITL_SLOWER))
    assert result.decision == "revert"
    assert (result.objective, result.unit) == ("itl.p95", "s")  # seconds: the verdict says so
    assert (result.before, result.after) == (pytest.approx(0.0295), pytest.approx(0.0395))


def test_unsaturated_a_better_itl_with_the_condition_eased_is_kept() -> None:
    result = verdict(unsaturated(itl_le=ITL_SLOWER), unsaturated())
    assert result.decision == "keep"
    assert result.objective == "itl.p95"


def test_saturated_in_one_window_only_latency_decides() -> None:
    before = saturated(running=8.0, waiting=2.0)
    after = unsaturated(running=10.0, waiting=0.0, itl_le=ITL_SLOWER)
    result = verdict(before, after)
    assert result.objective == "itl.p95"
    assert result.decision == "revert"


def test_a_latency_objective_decides_even_when_saturated() -> None:
    result = verdict(saturated(), saturated(ttft_le=0.5), objective="ttft.p95")
    assert result.objective == "ttft.p95"
    assert result.decision == "revert"


# -- the offered load changed ----------------------------------------------------------------------


def test_a_load_change_extends_the_window_first() -> None:
    result = verdict(saturated(), saturated(prompt_per_req=400.0))
    assert result.decision == "extend"
    assert "offered load changed" in result.reason


def test_a_load_change_after_extending_reverts_a_performance_change_as_inconclusive() -> None:
    result = verdict(saturated(), saturated(prompt_per_req=400.0), budget_spent=True)
    assert (result.decision, result.inconclusive) == ("revert", True)


def test_a_load_change_after_extending_keeps_a_safety_change_whose_condition_eased() -> None:
    result = verdict(saturated(), saturated(prompt_per_req=400.0), budget_spent=True, purpose="safety")
    assert (result.decision, result.inconclusive) == ("keep", True)


def test_a_load_change_after_extending_reverts_a_safety_change_whose_condition_did_not_ease() -> None:
    result = verdict(
        saturated(), saturated(prompt_per_req=400.0), budget_spent=True, purpose="safety", eased=False
    )
    assert result.decision == "revert"


def test_a_load_change_keeps_no_safety_change_that_broke_a_latency_limit() -> None:
    after = saturated(prompt_per_req=400.0, ttft_le=TTFT_SLOW)
    result = verdict(saturated(), after, budget_spent=True, purpose="safety", ttft_p95_max_s=0.5)
    assert result.decision == "revert"


def test_a_load_change_is_not_extended_when_extending_is_off() -> None:
    off = Windows(window_s=30.0, max_extend_s=0.0)
    result = verdict(saturated(), saturated(prompt_per_req=400.0), budget_spent=off.spent)
    assert (result.decision, result.inconclusive) == ("revert", True)


def test_the_window_doubles_at_each_extension_until_the_budget_is_spent() -> None:
    windows = Windows(window_s=60.0, max_extend_s=400.0)
    lengths = [windows.length]
    while not windows.spent:
        windows = windows.extend()
        lengths.append(windows.length)
    assert lengths == [60.0, 120.0, 240.0, 460.0]  # the last step is what the budget had left
    assert windows.extensions == 3


def test_a_load_change_in_requests_outstanding_extends_when_saturated() -> None:
    assert verdict(saturated(), saturated(waiting=12.0)).decision == "extend"


def test_a_load_change_in_request_rate_extends_when_unsaturated() -> None:
    assert verdict(unsaturated(), unsaturated(gen_per_s=200.0, req_per_s=4.0)).decision == "extend"


# -- latency limits --------------------------------------------------------------------------------


def test_an_absolute_ttft_limit_broken_while_throughput_improved_is_reverted() -> None:
    after = saturated(gen_per_s=120.0, req_per_s=2.4, ttft_le=TTFT_SLOW)
    result = verdict(saturated(), after, ttft_p95_max_s=0.5)
    assert result.decision == "revert"
    assert "TTFT p95" in result.reason


def test_an_absolute_itl_limit_broken_while_throughput_improved_is_reverted() -> None:
    after = saturated(gen_per_s=120.0, req_per_s=2.4, itl_le=ITL_SLOWEST)
    result = verdict(saturated(), after, itl_p95_max_s=0.05)
    assert result.decision == "revert"
    assert "ITL p95" in result.reason


def test_an_itl_increase_beyond_the_relative_limit_while_throughput_improved_is_reverted() -> None:
    after = saturated(gen_per_s=120.0, req_per_s=2.4, itl_le=ITL_SLOW)  # +68 %
    result = verdict(saturated(), after, itl_p95_max_increase=0.5)
    assert result.decision == "revert"
    assert "itl_p95_max_increase" in result.reason


def test_an_itl_increase_within_the_relative_limit_does_not_stop_a_throughput_gain() -> None:
    after = saturated(gen_per_s=120.0, req_per_s=2.4, itl_le=ITL_SLOW)  # +68 % < 100 %
    assert verdict(saturated(), after).decision == "keep"


def test_a_safety_change_that_broke_a_latency_limit_is_reverted() -> None:
    after = saturated(itl_le=ITL_SLOWEST)
    assert verdict(saturated(), after, purpose="safety", itl_p95_max_s=0.05).decision == "revert"


def test_a_safety_change_whose_condition_eased_is_kept_at_some_cost_in_throughput() -> None:
    result = verdict(saturated(), saturated(gen_per_s=80.0, req_per_s=1.6), purpose="safety")
    assert result.decision == "keep"


def test_a_safety_change_whose_condition_did_not_ease_is_reverted() -> None:
    assert verdict(saturated(), saturated(), purpose="safety", eased=False).decision == "revert"


# -- the evidence ----------------------------------------------------------------------------------


def noisy(seed: int, level: float = 100.0) -> WindowStats:
    return saturated(gen_per_s=level, req_per_s=level / 50, noise=0.3, seed=seed)


def test_the_verdict_carries_the_interval_of_the_mean_ratio_and_its_samples() -> None:
    before, after = noisy(1), noisy(2, 110.0)
    result = verdict(before, after)
    interval = mean_ratio_interval(before.throughput_samples, after.throughput_samples, confidence=0.95)
    assert interval is not None and result.interval == pytest.approx((interval.lo, interval.hi))
    assert (result.figures["n_before"], result.figures["n_after"]) == (30, 30)
    assert result.figures["effective_n_before"] is not None and result.figures["min_detectable_effect"] > 0


def test_a_gain_the_noise_cannot_tell_extends_the_window_then_is_no_difference() -> None:
    before, after = noisy(3), noisy(4, 106.0)  # ±30 % per poll over 30 polls: a 6 % gain is not told
    assert verdict(before, after).decision == "extend"
    spent = verdict(before, after, budget_spent=True)
    assert (spent.decision, spent.evidence) == ("revert", "no difference (budget spent)")


def test_a_clear_gain_is_better_and_kept() -> None:
    result = verdict(noisy(5), noisy(6, 150.0))
    assert (result.decision, result.evidence) == ("keep", "better")


def test_the_story_of_a_decided_trial_says_its_evidence_and_interval() -> None:
    record = {
        "trial": 3, "rule": "kv", "decision": "reverted", "param": "max_num_seqs", "old": 32, "new": 16,
        "reason": "no difference", "evidence": "no difference (budget spent)",
        "ratio_interval": [0.98, 1.07], "confidence": 0.95,
    }  # fmt: skip
    text = trial_decided(record)
    assert "(evidence: no difference (budget spent))" in text and "95% interval 0.98–1.07" in text
    old = {**record, "ratio_interval": None, "ratio_interval_90": [0.9, 1.1], "confidence": None}
    assert "90% interval 0.90–1.10" in trial_decided({k: v for k, v in old.items() if v is not None})


def test_a_straddle_is_not_extended_when_the_condition_did_not_ease() -> None:
    # No evidence could make it a keep: reverted at once, not after the extension budget.
    before, after = noisy(3), noisy(4, 106.0)
    result = verdict(before, after, eased=False)
    assert (result.decision, result.evidence) == ("revert", "no difference")
    assert "did not ease" in result.reason


def test_the_same_throughput_without_the_condition_easing_says_both() -> None:
    result = verdict(saturated(), saturated(), eased=False)
    assert (
        result.decision == "revert" and "no difference" in result.reason and "did not ease" in result.reason
    )
