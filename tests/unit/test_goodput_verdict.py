"""The objective decides (issue 21, item 3): a trial judged by goodput when it is in force — feasibility
first (attainment against `[objective] attainment`), then goodput within the tolerance — from the front
door's per-request counters in each window; throughput where goodput is not in force, and as before
where throughput is configured. Windows are synthetic polls (tests/unit/test_trial_verdict.py) with the
door's counters (core/slo.readings) beside them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.unit.fakes import Rig, fixed_wall, make_rig
from tests.unit.test_change_slot import serve_again
from tests.unit.test_trial_verdict import points
from tests.unit.test_tuner import KV_RULE
from tunerd.cli.memory import summary
from tunerd.config import TuningConfig
from tunerd.config.objective import ObjectiveConfig
from tunerd.config.rules import parse_rules
from tunerd.core.slo import RequestSample, SloWindow, Targets, readings
from tunerd.core.stats import mean_ratio_interval
from tunerd.policy.evidence import Point, WindowStats, slo_counts, window_stats
from tunerd.policy.objective import Goodput
from tunerd.policy.tunables import Proposal
from tunerd.policy.verdict import Verdict, judge
from tunerd.records.experience import Experience, ExperienceKey, experience_path, workload_key
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.preflight import run_here
from tunerd.tune.experiment import Phase
from tunerd.tune.memory import TuningMemory
from tunerd.tune.recall import Recall
from tunerd.tune.trials import Trial, TrialContext

GOODPUT = ObjectiveConfig(ttft_s=1.0, tpot_s=0.05)  # kind goodput (the default), attainment 0.95


def door(series: list[Point], *, rate: float, attainment: float, tokens: float = 100.0) -> list[Point]:
    """`series` with the door's counters: `rate` requests/s answered, `attainment` of them good, each good
    one `tokens` output tokens."""
    t0 = series[0].t
    out = []
    for p in series:
        n = rate * (p.t - t0)
        counters = {"slo.requests_total": n, "slo.good_total": n * attainment}
        counters["slo.good_tokens_total"] = n * attainment * tokens
        out.append(replace(p, readings={**p.readings, **counters}))
    return out


def window(*, rate: float = 2.0, attainment: float = 1.0, **kw: Any) -> WindowStats:
    """A saturated window (8 running, 2 waiting: the load checks pass between any two) with the door's
    requests at `rate`/s, `attainment` of them good."""
    series = door(points(**kw), rate=rate, attainment=attainment)
    stats = window_stats(series, series[0].t, series[-1].t, max_num_seqs=None, saturated_waiting=0.5)
    assert stats is not None and stats.saturated
    return stats


def decide(
    before: WindowStats,
    after: WindowStats,
    *,
    config: ObjectiveConfig = GOODPUT,
    door_enabled: bool = True,
    purpose: Literal["performance", "safety"] = "performance",
    eased: bool = True,
    budget_spent: bool = False,
    **tuning: Any,
) -> Verdict:
    settings = TuningConfig(**{"objective": "slo.goodput", "start_noise": 0.0, **tuning})
    return judge(
        before, after, tuning=settings, purpose=purpose, eased=eased, budget_spent=budget_spent,
        objective=config, door_enabled=door_enabled,
    )  # fmt: skip


# -- the window's own requests -----------------------------------------------------------------------


def test_a_window_counts_the_doors_requests_of_its_own_polls_only() -> None:
    series = door(points(polls=61), rate=2.0, attainment=0.75)
    counts = slo_counts(series, 30.0, 60.0)
    assert counts is not None
    assert counts.requests == pytest.approx(60.0) and counts.attainment == pytest.approx(0.75)
    assert counts.goodput("requests") == pytest.approx(1.5)
    assert counts.goodput("tokens") == pytest.approx(150.0)
    assert counts.samples("requests") == pytest.approx((1.5,) * 30)  # one per poll interval
    assert slo_counts(points(), 0.0, 30.0) is None  # no door: no counters


def test_the_slo_window_counts_each_request_once_by_the_targets_of_the_poll_that_saw_it() -> None:
    def sample(done: float, ttft: float) -> RequestSample:
        return RequestSample(done, 0.0, ttft, ttft, 10, True, 0.01, ttft + 0.1, True, True)

    slo = SloWindow(60.0, started=0.0)
    targets = Targets(ttft_s=1.0)
    slo.add([sample(1.0, 0.5), sample(1.5, 2.0)])
    first = slo.stats(2.0, targets, "requests")
    assert (first.requests_total, first.good_total, first.good_tokens_total) == (2, 1, 10)
    again = slo.stats(3.0, targets, "requests")  # nothing new: the counters stay
    assert (again.requests_total, again.good_total) == (2, 1)
    slo.add([sample(3.5, 0.2)])
    later = readings(slo.stats(4.0, targets, "requests"), door_waiting=0)
    assert (later["slo.requests_total"], later["slo.good_total"], later["slo.good_tokens_total"]) == (
        3.0,
        2.0,
        20.0,
    )


# -- the verdict ---------------------------------------------------------------------------------------


def test_feasible_and_goodput_not_worse_is_kept_with_the_figures_that_decided() -> None:
    v = decide(window(attainment=0.97, noise=0.1), window(rate=2.5, attainment=0.99, noise=0.1, seed=2))
    assert (v.decision, v.evidence) == ("keep", "better") and not v.inconclusive
    assert (v.objective, v.unit) == ("slo.goodput", "req/s")
    assert v.before == pytest.approx(1.94) and v.after == pytest.approx(2.475)
    assert v.service["feasible_before"] is True and v.service["feasible_after"] is True
    assert v.service["attainment_before"] == pytest.approx(0.97)
    assert v.service["goodput_after"] == pytest.approx(2.475) and v.service["goodput_unit"] == "req/s"
    assert v.service["requests_after"] == 75
    assert v.interval is not None and v.interval[0] <= 2.475 / 1.94 <= v.interval[1]
    assert v.objective_reason == ""


def test_feasible_but_goodput_worse_beyond_the_tolerance_is_reverted() -> None:
    v = decide(window(rate=3.0, attainment=0.97), window(rate=2.0, attainment=0.97))
    assert v.decision == "revert" and "worse" in v.reason


def test_feasible_and_not_worse_without_the_condition_easing_is_reverted() -> None:
    v = decide(window(attainment=0.97), window(rate=2.5, attainment=0.97), eased=False)
    assert v.decision == "revert" and "did not ease" in v.reason


def test_feasible_and_goodput_within_the_tolerance_is_no_difference_and_reverted() -> None:
    v = decide(window(attainment=0.97), window(attainment=0.99))  # +2 %: within the 5 % tolerance
    assert (v.decision, v.evidence) == ("revert", "no difference")


def test_feasible_to_infeasible_is_reverted_even_with_more_goodput() -> None:
    v = decide(window(rate=2.0, attainment=0.97), window(rate=3.0, attainment=0.90))
    assert v.after is not None and v.before is not None and v.after > v.before
    assert v.decision == "revert" and "no longer feasible" in v.reason
    assert (v.service["feasible_before"], v.service["feasible_after"]) == (True, False)


def test_infeasible_to_feasible_is_kept_even_with_less_goodput() -> None:
    long = {"polls": 301}  # 300 s: 900 and 600 requests, the attainment's difference told from its noise
    v = decide(
        window(rate=3.0, attainment=0.90, **long), window(rate=2.0, attainment=0.96, **long), eased=False
    )
    assert v.after is not None and v.before is not None and v.after < v.before
    assert (v.decision, v.evidence) == ("keep", "better") and "feasible now" in v.reason
    assert v.figures["attainment_difference_interval"][0] > 0  # type: ignore[index]


def test_infeasible_to_feasible_on_few_requests_extends_then_is_no_difference() -> None:
    before, after = window(rate=3.0, attainment=0.90), window(rate=2.0, attainment=0.96)  # 90, 60 requests
    assert decide(before, after).decision == "extend"  # the difference's interval straddles 0
    spent = decide(before, after, budget_spent=True)
    assert (spent.decision, spent.evidence) == ("revert", "no difference (budget spent)")


def test_both_infeasible_is_kept_only_when_attainment_improved_beyond_the_tolerance() -> None:
    long = {"polls": 121}  # 240 requests a window
    improved = decide(window(attainment=0.50, **long), window(attainment=0.70, **long))
    assert improved.decision == "keep" and "improved" in improved.reason
    flat = decide(window(attainment=0.50, **long), window(attainment=0.51, **long))
    assert flat.decision == "extend"  # +1 point on 240 requests: the interval straddles the tolerance
    flat = decide(window(attainment=0.50, **long), window(attainment=0.51, **long), budget_spent=True)
    assert (flat.decision, flat.evidence) == ("revert", "no difference (budget spent)")
    assert (flat.service["feasible_before"], flat.service["feasible_after"]) == (False, False)


def test_too_few_requests_after_extend_the_window_once_then_revert_as_inconclusive() -> None:
    before, few = window(), window(rate=0.5)  # 15 requests in 30 s: fewer than min_requests (20)
    first = decide(before, few)
    assert first.decision == "extend" and "15 requests after the change" in first.reason
    second = decide(before, few, budget_spent=True)
    assert second.decision == "revert" and second.inconclusive
    enough = decide(before, few, config=GOODPUT.model_copy(update={"min_requests": 10}))
    # a config key, not a constant: 15 requests suffice, and the goodput (2 → 0.5 req/s) decides
    assert enough.decision == "revert" and not enough.inconclusive and "worse" in enough.reason


def test_too_few_requests_before_is_inconclusive_at_once() -> None:
    v = decide(window(rate=0.5), window())
    assert v.decision == "revert" and v.inconclusive and "before the change" in v.reason


def test_goodput_counting_tokens_is_in_tokens_per_second() -> None:
    tokens = GOODPUT.model_copy(update={"count": "tokens"})
    v = decide(window(attainment=0.97), window(rate=2.5, attainment=0.99), config=tokens)
    assert v.unit == "tok/s" and v.after == pytest.approx(247.5) and v.decision == "keep"
    assert v.goal is not None and v.goal.fields()["objective_unit"] == "tok/s"


def test_a_safety_change_is_judged_by_its_condition_under_goodput_too() -> None:
    v = decide(window(attainment=0.97), window(attainment=0.80), purpose="safety", eased=True)
    assert v.decision == "keep" and v.service["feasible_after"] is False


def test_goodput_without_the_door_compares_throughput_and_says_why() -> None:
    better = window(attainment=0.80, gen_per_s=150.0, req_per_s=3.0)
    v = decide(window(attainment=0.97), better, door_enabled=False)
    assert v.objective == "throughput.generation" and v.decision == "keep"
    assert "front door" in v.objective_reason
    v = decide(window(attainment=0.97), better, config=ObjectiveConfig())
    assert v.objective == "throughput.generation" and "no targets" in v.objective_reason


def test_a_throughput_objective_ignores_attainment_but_reports_it() -> None:
    # Feasible → infeasible, throughput up 50 % (as many tokens per request): kept, as before goodput existed.
    after = window(attainment=0.80, gen_per_s=150.0, req_per_s=3.0)
    v = decide(window(attainment=0.97), after, objective="throughput.generation")
    assert v.objective == "throughput.generation" and v.decision == "keep" and v.objective_reason == ""
    assert v.service["feasible_after"] is False


def test_goodput_interval_is_that_of_the_mean_per_poll_goodput() -> None:
    before, after = window(attainment=0.97), window(attainment=0.99)
    v = decide(before, after)
    goal = Goodput()
    interval = mean_ratio_interval(goal.samples(before) or (), goal.samples(after) or (), confidence=0.95)
    assert interval is not None and v.interval == (interval.lo, interval.hi)


# -- through tune/trials: what trial.decided journals ---------------------------------------------------


def judged_trial(
    tmp_path: Path, after: WindowStats, objective: dict[str, Any], experience: Experience | None = None
) -> Rig:
    """A rule's trial of max_num_seqs 32 → 16 (a restart, the door on) whose after window is `after`,
    judged to its end — a revert's restart served — (written into `experience` when given)."""
    rig = make_rig(
        tmp_path,
        {"door": {"enabled": True, "port": 0}, "engine": {"params": {"max_num_seqs": 32}},
         "objective": objective, "tuning": {"warmup_s": 5.0, "window_s": 30.0, "max_extend_s": 20.0,
                    "start_noise": 0.0}},
    )  # fmt: skip
    rig.lifecycle.capacity.check = lambda params: PlanOutcome(None, {"band": "fine"})  # type: ignore[method-assign]
    rig.serve()
    memory = TuningMemory(
        rig.dstate.tuning, lambda: rig.config.tuning, recorder=rig.recorder,
        save_state=rig.lifecycle.save_state, wallclock=fixed_wall,
    )  # fmt: skip
    recall = None
    if experience is not None:
        recall = Recall(
            experience, rig.lifecycle, lambda: rig.config, recorder=rig.recorder, wallclock=fixed_wall
        )
        rig.dstate.identity = {"vllm_version": "0.32.0", "model": {"fingerprint": "2bf7"}, "gpu_name": None}
    pressure = {"kv_cache.full_share": 0.97, "preemptions.rate": 2.0}
    eased = {"kv_cache.full_share": 0.80, "preemptions.rate": 0.0}
    ctx = TrialContext(
        config=lambda: rig.config, lifecycle=rig.lifecycle, recorder=rig.recorder, memory=memory,
        metrics=rig.metrics, submit=run_here, window=lambda start, end: after,
        rule_values=lambda end, not_before: dict(eased), on_kept=lambda why: None, recall=recall,
    )  # fmt: skip
    rule = parse_rules({"rule": [KV_RULE]}).rules[0]
    proposal = Proposal("max_num_seqs", 32, 16, rig.lifecycle.params.replace(max_num_seqs=16))
    trial = Trial(ctx, 1, rule, proposal, window(attainment=0.97), dict(pressure))
    rig.on_change = trial.experiment.on_change  # the loop delivers the change's outcome to the trial
    trial.start(rig.now)
    trial.experiment.step(rig.now)  # the planner's answer (here at once): the restart is requested
    serve_again(rig)  # the change serves: the warm-up
    assert trial.experiment.phase is Phase.WARMUP
    served = rig.now
    trial.experiment.step(served + 5.0)  # the warm-up ends: the after window opens
    trial.experiment.step(served + 36.0)  # the after window (30 s) is whole: the verdict
    if not trial.over:  # reverted: over once the parameters before serve again
        serve_again(rig)
    assert trial.over
    return rig


def test_trial_decided_carries_the_objective_both_windows_service_levels_and_the_interval(
    tmp_path: Path,
) -> None:
    rig = judged_trial(tmp_path, window(rate=2.0, attainment=0.90), {"ttft_s": 1.0})
    decided = rig.last("trial.decided")
    assert decided["decision"] == "reverted" and "no longer feasible" in decided["reason"]
    assert (decided["objective"], decided["objective_unit"]) == ("slo.goodput", "req/s")
    assert decided["objective_before"] == pytest.approx(1.94) and decided["objective_after"] == pytest.approx(
        1.8
    )
    assert (decided["attainment_before"], decided["attainment_after"]) == (0.97, 0.9)
    assert (decided["goodput_before"], decided["goodput_after"]) == (1.94, 1.8)
    assert (decided["feasible_before"], decided["feasible_after"]) == (True, False)
    assert decided["goodput_unit"] == "req/s" and decided["attainment_target"] == 0.95
    low, high = decided["ratio_interval"]
    assert low - 1e-4 <= 1.8 / 1.94 <= high + 1e-4  # rounded to 4 digits
    assert decided["evidence"] == "no difference" and decided["confidence"] == 0.95
    assert decided["figures"]["n_after"] == 30 and decided["figures"]["min_detectable_effect"] is not None
    assert decided["windows"]["extensions"] == 0 and decided["windows"]["window_s"] == 30.0
    assert decided["objective_reason"] is None


def test_trial_decided_says_why_goodput_configured_is_not_what_was_compared(tmp_path: Path) -> None:
    rig = judged_trial(tmp_path, window(rate=2.0, attainment=0.90), {})  # goodput by default, no targets
    decided = rig.last("trial.decided")
    # the same throughput before and after: no difference, not kept (issue 22)
    assert decided["objective"] == "throughput.generation" and decided["decision"] == "reverted"
    assert decided["evidence"] == "no difference"
    assert decided["objective_reason"].startswith("goodput has no targets")
    assert decided["attainment_after"] is None  # nothing to attain without targets


# -- the tuning memory: goodput with its unit ------------------------------------------------------------


def test_a_kept_goodput_trial_is_remembered_with_the_unit_of_what_it_counted(tmp_path: Path) -> None:
    experience = Experience(experience_path(tmp_path / "state"))
    objective = {"ttft_s": 1.0, "count": "tokens"}
    rig = judged_trial(tmp_path, window(rate=2.5, attainment=0.99), objective, experience)
    assert rig.last("trial.decided")["decision"] == "kept"
    (entry,) = experience.entries()
    assert (entry.kind, entry.objective_name, entry.objective_unit) == ("trial", "slo.goodput", "tok/s")
    assert entry.objective == pytest.approx(247.5)
    assert entry.figures["goodput_unit"] == "tok/s" and entry.figures["attainment_after"] == 0.99


def test_goodput_in_requests_and_in_tokens_never_compare_in_the_memory(tmp_path: Path) -> None:
    memory = Experience(experience_path(tmp_path / "state"))
    key = ExperienceKey("3f9a", "cpu", "0.32.0", workload_key(128, 128, 4))
    for seqs, value, unit in ((8, 2.0, "req/s"), (16, 150.0, "tok/s"), (32, 3.0, "req/s")):
        memory.record(
            key, {"max_num_seqs": seqs}, value, kind="trial", decision="keep", figures={}, at=float(seqs),
            objective_name="slo.goodput", objective_unit=unit, objective_source="live",
        )  # fmt: skip
    assert memory.units(key, "slo.goodput") == ["req/s", "tok/s"]
    best = memory.best_entry(key, objective="slo.goodput", maximize=True, unit="req/s")
    assert best is not None and best.params == {"max_num_seqs": 32}  # not the 150 tok/s
    rows = summary(memory, "slo.goodput")
    assert [(b["objective"], b["objective_unit"]) for b in rows[0]["best"]] == [
        (3.0, "req/s"),
        (150.0, "tok/s"),
    ]
