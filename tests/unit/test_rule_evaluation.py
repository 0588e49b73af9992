"""Rule evaluation: the `for` clock, missing data, hysteresis, cooldown, mute, baselines, all/any, and
whether a trial's condition eased. Pure: fake monotonic `now` values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunerd.config.rules import Rule, parse_term
from tunerd.policy.rules import Evaluation, RuleState, TermValue, condition, eased, evaluate, term_value

STEP: dict[str, Any] = {"kind": "step", "param": "max_num_seqs", "direction": "down", "factor": 0.5}
KV = "kv_cache.usage_avg"
PRE = "preemptions.rate"
GEN = "throughput.generation"


def make_rule(**fields: Any) -> Rule:
    doc: dict[str, Any] = {"name": "r", "for_s": 60, "cooldown_s": 600, "action": STEP}
    doc.update(fields)
    if "all" not in doc and "any" not in doc:
        doc["all"] = [f"{KV} > 0.9"]
    return Rule.model_validate(doc)


def run(
    rule: Rule,
    polls: Sequence[tuple[float, Mapping[str, float | None]]],
    state: RuleState | None = None,
    baseline: Mapping[str, float] | None = None,
) -> list[Evaluation]:
    """Evaluate `rule` at each (now, signals) in turn, threading the state."""
    state = state or RuleState()
    out = []
    for now, signals in polls:
        result = evaluate(rule, state, signals, baseline or {}, now)
        state = result.state
        out.append(result)
    return out


def fired_at(rule: Rule, polls: Sequence[tuple[float, Mapping[str, float | None]]], **kw: Any) -> list[float]:
    return [now for (now, _), ev in zip(polls, run(rule, polls, **kw), strict=True) if ev.fired]


def every(step_s: float, until: float, signals: Mapping[str, float | None], start: float = 0.0) -> list:
    n = round((until - start) / step_s)
    return [(start + i * step_s, signals) for i in range(n + 1)]


# -- the `for` clock -------------------------------------------------------------------------------


def test_a_condition_fires_once_it_has_held_for_for_s() -> None:
    assert fired_at(make_rule(), every(10, 60, {KV: 0.95})) == [60.0]


def test_a_condition_does_not_fire_before_for_s() -> None:
    assert fired_at(make_rule(), every(10, 50, {KV: 0.95})) == []


def test_a_zero_for_s_fires_on_the_first_poll_that_holds() -> None:
    assert fired_at(make_rule(for_s=0), [(5.0, {KV: 0.95})]) == [5.0]


def test_the_first_poll_that_holds_starts_the_clock() -> None:
    result = run(make_rule(), [(0.0, {KV: 0.5}), (10.0, {KV: 0.95})])[-1]
    assert result.state.holding_since == 10.0
    assert result.holds is True


def test_a_gap_in_the_data_restarts_the_for_clock() -> None:
    polls = [*every(10, 50, {KV: 0.95}), (55.0, {KV: None}), *every(10, 110, {KV: 0.95}, start=60)]
    assert fired_at(make_rule(), polls) == []  # held 60 s after the gap only at 120


def test_after_a_gap_the_clock_counts_from_the_first_poll_that_holds_again() -> None:
    polls = [*every(10, 50, {KV: 0.95}), (55.0, {KV: None}), *every(10, 120, {KV: 0.95}, start=60)]
    assert fired_at(make_rule(), polls) == [120.0]


def test_a_signal_absent_from_the_mapping_restarts_the_for_clock() -> None:
    polls = [*every(10, 50, {KV: 0.95}), (55.0, {}), *every(10, 110, {KV: 0.95}, start=60)]
    assert fired_at(make_rule(), polls) == []


def test_a_false_poll_restarts_the_for_clock() -> None:
    polls = [*every(10, 50, {KV: 0.95}), (55.0, {KV: 0.5}), *every(10, 110, {KV: 0.95}, start=60)]
    assert fired_at(make_rule(), polls) == []


def test_a_false_poll_clears_holding_since() -> None:
    result = run(make_rule(), [(0.0, {KV: 0.95}), (10.0, {KV: 0.5})])[-1]
    assert result.state.holding_since is None
    assert result.holds is False


# -- missing data ----------------------------------------------------------------------------------


def test_missing_data_never_fires_a_rule() -> None:
    results = run(make_rule(for_s=0), every(10, 600, {KV: None}))
    assert not any(ev.fired for ev in results)
    assert {ev.holds for ev in results} == {None}


def test_a_missing_term_makes_an_all_condition_unknown_even_when_the_others_hold() -> None:
    result = run(make_rule(for_s=0, all=[f"{KV} > 0.9", f"{PRE} > 0"]), [(0.0, {KV: 0.99})])[-1]
    assert result.holds is None
    assert not result.fired


def test_a_missing_term_makes_an_any_condition_unknown_even_when_another_holds() -> None:
    result = run(make_rule(for_s=0, any=[f"{KV} > 0.9", f"{PRE} > 0"]), [(0.0, {KV: 0.99})])[-1]
    assert result.holds is None
    assert not result.fired


def test_a_relative_term_without_a_baseline_never_fires() -> None:
    rule = make_rule(for_s=0, all=[f"{GEN} < 0.7 * baseline"])
    result = run(rule, [(0.0, {GEN: 1.0})], baseline={})[-1]
    assert result.holds is None
    assert not result.fired
    assert result.terms[0].threshold is None


def test_a_relative_term_without_a_baseline_is_unknown() -> None:
    value = term_value(parse_term(f"{GEN} < 0.7 * baseline"), {GEN: 1.0}, {}, False, 0.05)
    assert value == TermValue(f"{GEN} < 0.7 * baseline", 1.0, None, None)


# -- relative thresholds ---------------------------------------------------------------------------


def test_a_relative_threshold_is_the_factor_times_the_baseline() -> None:
    value = term_value(parse_term(f"{GEN} < 0.7 * baseline"), {GEN: 60.0}, {GEN: 100.0}, False, 0.05)
    assert value.threshold == 70.0
    assert value.holds is True


def test_a_value_above_the_relative_threshold_does_not_hold() -> None:
    value = term_value(parse_term(f"{GEN} < 0.7 * baseline"), {GEN: 80.0}, {GEN: 100.0}, False, 0.05)
    assert value.holds is False


def test_a_relative_rule_fires_against_its_signals_baseline() -> None:
    rule = make_rule(for_s=0, all=[f"{GEN} < 0.7 * baseline"])
    assert fired_at(rule, [(0.0, {GEN: 60.0})], baseline={GEN: 100.0}) == [0.0]
    assert fired_at(rule, [(0.0, {GEN: 60.0})], baseline={GEN: 50.0}) == []


def test_a_relative_term_reads_the_baseline_of_its_own_signal() -> None:
    value = term_value(parse_term(f"{GEN} < baseline"), {GEN: 60.0}, {"throughput.prompt": 100.0}, False, 0)
    assert value.holds is None


# -- hysteresis ------------------------------------------------------------------------------------


def test_a_term_not_yet_holding_needs_to_pass_the_threshold_itself() -> None:
    assert term_value(parse_term(f"{KV} > 0.9"), {KV: 0.89}, {}, False, 0.05).holds is False


def test_a_held_term_keeps_holding_within_the_hysteresis_band() -> None:
    # 0.9 - 0.05 * 0.9 = 0.855
    assert term_value(parse_term(f"{KV} > 0.9"), {KV: 0.86}, {}, True, 0.05).holds is True


def test_a_held_term_releases_once_past_the_hysteresis_band() -> None:
    assert term_value(parse_term(f"{KV} > 0.9"), {KV: 0.85}, {}, True, 0.05).holds is False


def test_a_held_less_than_term_keeps_holding_within_the_band_above_it() -> None:
    term = parse_term(f"{GEN} < 100")
    assert term_value(term, {GEN: 104.0}, {}, True, 0.05).holds is True
    assert term_value(term, {GEN: 106.0}, {}, True, 0.05).holds is False


def test_hysteresis_uses_the_magnitude_of_a_negative_threshold() -> None:
    term = parse_term(f"{GEN} > -100")  # band: > -105 while holding
    assert term_value(term, {GEN: -104.0}, {}, True, 0.05).holds is True
    assert term_value(term, {GEN: -106.0}, {}, True, 0.05).holds is False


def test_a_value_hovering_at_the_threshold_does_not_flap() -> None:
    values = [0.95, 0.89, 0.91, 0.88, 0.92, 0.89, 0.9, 0.87]
    results = run(make_rule(for_s=1000), [(i * 10.0, {KV: v}) for i, v in enumerate(values)])
    assert [ev.holds for ev in results] == [True] * len(values)
    assert {ev.state.holding_since for ev in results} == {0.0}


def test_a_hovering_value_that_held_long_enough_fires_despite_dips_inside_the_band() -> None:
    polls = [(0.0, {KV: 0.95}), (20.0, {KV: 0.88}), (40.0, {KV: 0.91}), (60.0, {KV: 0.87})]
    assert fired_at(make_rule(), polls) == [60.0]


def test_a_dip_inside_the_band_before_the_term_ever_held_does_not_hold() -> None:
    results = run(make_rule(), [(0.0, {KV: 0.88})])
    assert results[0].holds is False


def test_after_missing_data_the_band_no_longer_applies() -> None:
    results = run(make_rule(), [(0.0, {KV: 0.95}), (10.0, {KV: None}), (20.0, {KV: 0.88})])
    assert results[-1].holds is False


def test_an_all_term_that_held_keeps_its_band_while_another_term_is_false() -> None:
    rule = make_rule(all=[f"{KV} > 0.9", f"{PRE} > 0"])
    results = run(
        rule, [(0.0, {KV: 0.95, PRE: 1.0}), (10.0, {KV: 0.95, PRE: 0.0}), (20.0, {KV: 0.88, PRE: 1.0})]
    )
    assert results[-1].holds is True


def test_equality_terms_have_no_band() -> None:
    assert term_value(parse_term(f"{PRE} == 0"), {PRE: 0.001}, {}, True, 0.5).holds is False


# -- cooldown and mute -----------------------------------------------------------------------------


def test_firing_starts_the_cooldown() -> None:
    result = run(make_rule(for_s=0, cooldown_s=600), [(100.0, {KV: 0.95})])[-1]
    assert result.fired
    assert result.state.cooldown_until == 700.0
    assert result.state.last_fired == 100.0


def test_a_rule_fires_at_most_once_per_cooldown() -> None:
    polls = every(10, 1300, {KV: 0.95})
    assert fired_at(make_rule(for_s=60, cooldown_s=600), polls) == [60.0, 660.0, 1260.0]


def test_firing_restarts_the_for_clock() -> None:
    polls = every(10, 200, {KV: 0.95})
    assert fired_at(make_rule(for_s=100, cooldown_s=0), polls) == [100.0, 200.0]


def test_a_muted_rule_does_not_fire() -> None:
    state = RuleState(muted_until=500.0)
    assert fired_at(make_rule(for_s=0), every(10, 490, {KV: 0.95}), state=state) == []


def test_a_muted_rule_fires_once_the_mute_ends() -> None:
    state = RuleState(muted_until=500.0)
    assert fired_at(make_rule(for_s=60), every(10, 500, {KV: 0.95}), state=state) == [500.0]


def test_a_rule_in_cooldown_keeps_its_clock_running() -> None:
    state = RuleState(cooldown_until=100.0)
    results = run(make_rule(for_s=60), every(10, 90, {KV: 0.95}), state=state)
    assert not any(ev.fired for ev in results)
    assert results[-1].state.holding_since == 0.0


def test_fresh_state_keeps_cooldown_and_mute_and_forgets_the_condition() -> None:
    state = RuleState(
        holding_since=5.0,
        holding=(True,),
        last_fired=3.0,
        cooldown_until=900.0,
        muted_until=4000.0,
        last=(TermValue(f"{KV} > 0.9", 0.95, 0.9, True),),
    )
    fresh = state.fresh()
    assert (fresh.holding_since, fresh.holding, fresh.last) == (None, (), ())
    assert (fresh.cooldown_until, fresh.muted_until, fresh.last_fired) == (900.0, 4000.0, 3.0)


def test_a_fresh_state_does_not_fire_inside_the_old_cooldown() -> None:
    fired = run(make_rule(for_s=0, cooldown_s=600), [(0.0, {KV: 0.95})])[-1].state
    assert fired_at(make_rule(for_s=0, cooldown_s=600), [(300.0, {KV: 0.95})], state=fired.fresh()) == []


# -- resolution ------------------------------------------------------------------------------------


def resolved_at(rule: Rule, polls: Sequence[tuple[float, Mapping[str, float | None]]]) -> list[float]:
    return [now for (now, _), ev in zip(polls, run(rule, polls), strict=True) if ev.resolved]


def test_a_fired_rule_resolves_once_its_condition_has_been_false_for_for_s() -> None:
    polls = every(10, 60, {KV: 0.95}) + every(10, 200, {KV: 0.5}, start=70)
    assert fired_at(make_rule(for_s=60), polls) == [60.0]
    assert resolved_at(make_rule(for_s=60), polls) == [130.0]  # false from 70 s, for 60 s
    assert run(make_rule(for_s=60), polls)[-1].state.firing is False


def test_a_rule_that_never_fired_never_resolves() -> None:
    polls = every(10, 50, {KV: 0.95}) + every(10, 300, {KV: 0.5}, start=60)
    assert resolved_at(make_rule(for_s=60), polls) == []


def test_a_poll_that_holds_again_restarts_the_clearing_clock() -> None:
    polls = (
        every(10, 30, {KV: 0.95})  # fires at 30
        + every(10, 50, {KV: 0.5}, start=40)
        + [(60.0, {KV: 0.95})]  # holds once: not long enough to fire, long enough to be not yet clear
        + every(10, 200, {KV: 0.5}, start=70)
    )
    assert resolved_at(make_rule(for_s=30, cooldown_s=0), polls) == [100.0]


def test_missing_data_restarts_the_clearing_clock() -> None:
    polls = (
        every(10, 60, {KV: 0.95})
        + every(10, 100, {KV: 0.5}, start=70)
        + [(110.0, {KV: None})]
        + every(10, 200, {KV: 0.5}, start=120)
    )
    assert resolved_at(make_rule(for_s=60), polls) == [180.0]


def test_a_firing_rule_stays_firing_into_a_new_engine_run_and_clears_there() -> None:
    fired = run(make_rule(for_s=30), [*every(10, 30, {KV: 0.95}), (40.0, {KV: 0.5})])[-1].state
    assert fired.firing and fired.clear_since == 40.0
    fresh = fired.fresh()
    assert fresh.firing and fresh.clear_since is None  # the new run must clear on its own evidence
    results = run(make_rule(for_s=30), every(10, 130, {KV: 0.5}, start=100), state=fresh)
    assert [ev.resolved for ev in results] == [False, False, False, True]


# -- all / any -------------------------------------------------------------------------------------


def test_an_all_rule_needs_every_term() -> None:
    rule = make_rule(for_s=0, all=[f"{KV} > 0.9", f"{PRE} > 0"])
    assert run(rule, [(0.0, {KV: 0.95, PRE: 0.0})])[-1].holds is False
    assert run(rule, [(0.0, {KV: 0.95, PRE: 1.0})])[-1].fired


def test_an_any_rule_needs_one_term() -> None:
    rule = make_rule(for_s=0, all=None, any=[f"{KV} > 0.9", f"{PRE} > 0"])
    assert run(rule, [(0.0, {KV: 0.5, PRE: 0.0})])[-1].holds is False
    assert run(rule, [(0.0, {KV: 0.5, PRE: 1.0})])[-1].fired


def test_condition_is_unknown_when_a_term_is_unknown() -> None:
    rule = make_rule(all=None, any=[f"{KV} > 0.9", f"{PRE} > 0"])
    terms = (TermValue("a", 1.0, 0.9, True), TermValue("b", None, 0.0, None))
    assert condition(rule, terms) is None


def test_evaluation_reports_each_term() -> None:
    result = run(make_rule(all=[f"{KV} > 0.9", f"{PRE} > 0"]), [(0.0, {KV: 0.95, PRE: 0.0})])[-1]
    assert result.terms == (
        TermValue(f"{KV} > 0.9", 0.95, 0.9, True),
        TermValue(f"{PRE} > 0", 0.0, 0.0, False),
    )
    assert result.state.last == result.terms


# -- eased -----------------------------------------------------------------------------------------


def values(rule: Rule, signals: Mapping[str, float | None], was: bool = True) -> tuple[TermValue, ...]:
    return tuple(term_value(t, signals, {}, was, rule.hysteresis) for t in rule.terms)


def test_a_condition_that_no_longer_holds_eased() -> None:
    rule = make_rule(all=[f"{KV} > 0.9"])
    assert eased(rule, values(rule, {KV: 0.95}), values(rule, {KV: 0.5}), 0.05)


def test_a_term_that_moved_away_from_holding_beyond_the_tolerance_eased_though_it_still_holds() -> None:
    rule = make_rule(all=[f"{PRE} > 0"])
    assert eased(rule, values(rule, {PRE: 2.0}), values(rule, {PRE: 1.0}), 0.05)


def test_a_less_than_term_that_rose_beyond_the_tolerance_eased() -> None:
    rule = make_rule(all=[f"{GEN} < 100"])
    assert eased(rule, values(rule, {GEN: 50.0}), values(rule, {GEN: 60.0}), 0.05)


def test_an_unchanged_condition_did_not_ease() -> None:
    rule = make_rule(all=[f"{KV} > 0.9", f"{PRE} > 0"])
    before = values(rule, {KV: 0.95, PRE: 2.0})
    assert not eased(rule, before, before, 0.05)


def test_a_move_within_the_tolerance_did_not_ease() -> None:
    rule = make_rule(all=[f"{PRE} > 0"])
    assert not eased(rule, values(rule, {PRE: 2.0}), values(rule, {PRE: 1.95}), 0.05)


def test_a_move_towards_holding_did_not_ease() -> None:
    rule = make_rule(all=[f"{PRE} > 0"])
    assert not eased(rule, values(rule, {PRE: 2.0}), values(rule, {PRE: 4.0}), 0.05)


def test_a_term_unknown_after_the_trial_did_not_ease() -> None:
    rule = make_rule(all=[f"{PRE} > 0"])
    assert not eased(rule, values(rule, {PRE: 2.0}), values(rule, {PRE: None}), 0.05)


def test_an_any_term_that_was_not_holding_moving_further_away_did_not_ease() -> None:
    rule = make_rule(all=None, any=[f"{KV} > 0.9", f"{PRE} > 0.5"])
    before = values(rule, {KV: 0.95, PRE: 0.4}, was=False)  # KV holds, PRE does not
    after = values(rule, {KV: 0.95, PRE: 0.1}, was=False)
    assert not eased(rule, before, after, 0.05)
