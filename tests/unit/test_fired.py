"""What to do with a fired rule (policy/fired.py): one call per outcome, in a table; the order in which
the checks apply; and that the proposal is asked for only past the gates (asking has effects)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tunerd.config import TuningConfig
from tunerd.config.rules import Rule
from tunerd.core.params import EngineParams
from tunerd.policy.evidence import Spread, WindowStats
from tunerd.policy.fired import Act, Alert, Decision, Defer, Facts, Mute, decide
from tunerd.policy.gates import Budget
from tunerd.policy.rules import RuleState
from tunerd.policy.tunables import NoProposal, Proposal

NOW, WALL = 1000.0, 1_750_000_000.0
STEP: dict[str, Any] = {"kind": "step", "param": "max_num_seqs", "direction": "down", "factor": 0.5}
BEFORE = WindowStats(
    start=970.0, end=1000.0, polls=30, throughput=Spread(100.0, 90.0, 110.0, 30), throughput_samples=(),
    prompt_rate=None, completed_rate=1.0, prompt_tokens_per_request=None, generation_tokens_per_request=None,
    preemption_rate=1.0, running_avg=24.0, waiting_avg=0.0, waiting_max=0.0, kv_usage_avg=0.95,
    kv_usage_max=0.99, ttft_p50=None, ttft_p95=None, itl_p95=None, e2e_p95=None, saturated=True,
)  # fmt: skip
HALVE = Proposal("max_num_seqs", 64, 32, EngineParams(max_num_seqs=32))
TUNING = TuningConfig(min_serving_s=300, window_s=30.0, tabu_s=3600.0)


def rule(action: dict[str, Any] | None = None) -> Rule:
    return Rule.model_validate(
        {
            "name": "kv",
            "all": ["kv_cache.usage_avg > 0.9"],
            "for_s": 60,
            "cooldown_s": 600,
            "action": action or STEP,
        }
    )


def facts(**changes: Any) -> Facts:
    base = Facts(
        paused=False,
        change_in_flight=False,
        budget=Budget(4, 24),
        served_s=600.0,
        window_open=True,
        before=BEFORE,
        kept=(),
        probe_quiet_s=None,
    )
    return replace(base, **changes)


REVERT = {"kind": "revert"}
ALERT = {"kind": "alert"}
UNDONE = ((WALL - 60, "max_num_seqs", 32, 64),)  # 32 → 64 kept a minute ago; halving undoes it

# (case, rule's action, facts, tuning, proposal, the decision)
CASES: list[tuple[str, dict[str, Any] | None, Facts, TuningConfig, Proposal | NoProposal, Decision]] = [
    ("act", None, facts(), TUNING, HALVE, Act(HALVE, BEFORE, dry_run=False)),
    (
        "act, dry-run",
        None,
        facts(),
        TUNING.model_copy(update={"mode": "dry-run"}),
        HALVE,
        Act(HALVE, BEFORE, dry_run=True),
    ),
    ("an alert rule", ALERT, facts(paused=True), TUNING, HALVE, Alert()),
    (
        "mode off",
        None,
        facts(),
        TUNING.model_copy(update={"mode": "off"}),
        HALVE,
        Defer("tuning.mode is off"),
    ),
    ("paused", None, facts(paused=True), TUNING, HALVE, Defer("tuning is paused (tunerd resume)")),
    ("a change in flight", None, facts(change_in_flight=True), TUNING, HALVE, Defer("a trial is running")),
    (
        "served too briefly",
        None,
        facts(served_s=120.0),
        TUNING,
        HALVE,
        Defer("vLLM has served 120 s since its last start (tuning.min_serving_s 300)"),
    ),
    (
        "budget spent",
        None,
        facts(budget=Budget(0, 20)),
        TUNING,
        HALVE,
        Defer("restart budget spent (4/h, 24/day of trial restarts)"),
    ),
    (
        "window closed",
        None,
        facts(window_open=False),
        TUNING,
        HALVE,
        Defer("outside the maintenance windows"),
    ),
    (
        "no before window",
        None,
        facts(before=None),
        TUNING,
        HALVE,
        Defer("not enough samples for a before window"),
    ),
    (
        "revert with nothing to revert to",
        REVERT,
        facts(),
        TUNING,
        NoProposal("no earlier value"),
        Alert("no earlier value"),
    ),
    (
        "exhausted",
        None,
        facts(),
        TUNING,
        NoProposal("at its bound 1"),
        Mute("nothing further to try: at its bound 1", exhausted="at its bound 1"),
    ),
    (
        "flip-flop",
        None,
        facts(kept=UNDONE),
        TUNING,
        HALVE,
        Mute("would undo the change max_num_seqs 32 → 64 kept 60 s ago"),
    ),
    (
        "flip-flop, past tabu_s",
        None,
        facts(kept=((WALL - 4000, "max_num_seqs", 32, 64),)),
        TUNING,
        HALVE,
        Act(HALVE, BEFORE, dry_run=False),
    ),
    (
        "a probe in the before window",
        None,
        facts(probe_quiet_s=10.0),
        TUNING,
        HALVE,
        Defer(
            "a probe ran 10 s ago: the before window (30 s) must hold live traffic only",
            state=RuleState(cooldown_until=NOW + 20.0),
        ),
    ),
    (
        "a probe long enough ago",
        None,
        facts(probe_quiet_s=30.0),
        TUNING,
        HALVE,
        Act(HALVE, BEFORE, dry_run=False),
    ),
]


@pytest.mark.parametrize(
    ("case", "action", "gates", "tuning", "proposal", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_a_fired_rule_is_decided_in_one_call(
    case: str,
    action: dict[str, Any] | None,
    gates: Facts,
    tuning: TuningConfig,
    proposal: Proposal | NoProposal,
    expected: Decision,
) -> None:
    decision = decide(
        rule(action), RuleState(), gates, lambda _before: proposal, tuning=tuning, now=NOW, now_wall=WALL
    )
    assert decision == expected


def test_the_gates_defer_before_the_proposal_is_asked_for() -> None:
    """Asking the proposer puts the recall's known-bad values tabu: a deferred rule must not."""
    asked: list[WindowStats] = []

    def propose(before: WindowStats) -> Proposal:
        asked.append(before)
        return HALVE

    kv = rule()
    blocked = decide(kv, RuleState(), facts(paused=True), propose, tuning=TUNING, now=NOW, now_wall=WALL)
    assert isinstance(blocked, Defer) and asked == []
    assert (
        decide(kv, RuleState(), facts(before=None), propose, tuning=TUNING, now=NOW, now_wall=WALL).kind
        == "defer"
    )
    assert asked == []
    assert decide(kv, RuleState(), facts(), propose, tuning=TUNING, now=NOW, now_wall=WALL).kind == "act"
    assert asked == [BEFORE]  # once, with the before window


def test_the_gates_come_before_the_probe_and_the_flip_flop() -> None:
    """Every reason at once: the first in the documented order wins (a pause, not the probe)."""
    everything = facts(paused=True, kept=UNDONE, probe_quiet_s=0.0)
    decision = decide(
        rule(), RuleState(), everything, lambda _b: HALVE, tuning=TUNING, now=NOW, now_wall=WALL
    )
    assert decision == Defer("tuning is paused (tunerd resume)")
    no_gate = replace(everything, paused=False)
    decision = decide(rule(), RuleState(), no_gate, lambda _b: HALVE, tuning=TUNING, now=NOW, now_wall=WALL)
    assert isinstance(decision, Mute)  # the flip-flop before the probe's deferral
