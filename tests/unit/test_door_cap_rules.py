"""The door's cap is no rule's knob any more (issue 21: the door steers it live, door/limit.py): a rule
naming it moves its `then` at once, and its restart waits while the steered cap is still moving toward
targets it misses. In-process: a real Lifecycle and Tuner over fake processes and a fake clock; the
engine's /metrics follow the landscape of the sequences that run at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.unit.fakes import EngineScript, make_rig
from tests.unit.test_tuner import KV_RULE, LANDSCAPE, RULE_STEP_START, SimEngine, TunerRig, _wall
from tunerd.config.rules import parse_rules
from tunerd.observe.signals import SignalWindow
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.preflight import run_here
from tunerd.tune.tuner import Tuner

CAP = "door.max_in_flight"
DOOR_FIRST = {**KV_RULE, "action": {**KV_RULE["action"], "param": CAP, "then": ["max_num_seqs"]}}


def make(tmp_path: Path, *, restart_wait: Callable[[], str | None] | None = None) -> TunerRig:
    overrides = {
        "engine": {"params": {"max_num_seqs": 32}},
        "observe": {"window_s": 20.0},
        "tuning": {"warmup_s": 5.0, "window_s": 30.0, "max_extend_s": 20.0, "min_serving_s": 0.0},
        "backoff": {"known_good_after_s": 5.0},
    }
    rig = make_rig(tmp_path, overrides)
    rig.os.default = EngineScript(lines=RULE_STEP_START)  # the rule's own step: no KV size to model
    rig.lifecycle.capacity.check = lambda params: PlanOutcome(None, {"band": "fine"})  # type: ignore[method-assign]
    tuner = Tuner(
        rig.config, parse_rules({"rule": [DOOR_FIRST]}), rig.lifecycle, recorder=rig.recorder,
        dstate=rig.dstate, save_state=rig.lifecycle.save_state, metrics=rig.metrics, submit=run_here,
        wallclock=lambda: _wall(rig), restart_wait=restart_wait,
    )  # fmt: skip
    rig.on_change = tuner.on_change  # the loop delivers a change's outcome to the tuner
    sim = TunerRig(rig, tuner, SimEngine(LANDSCAPE), SignalWindow(20.0))
    rig.serve()
    return sim


def test_a_rule_naming_the_doors_cap_moves_its_then_at_once(tmp_path: Path) -> None:
    sim = make(tmp_path)
    sim.run_until(lambda: bool(sim.decided()))
    trial = sim.decided()[0]
    assert (trial["param"], trial["old"], trial["new"]) == ("max_num_seqs", 32, 16)
    started = sim.rig.last("trial.started")
    assert any(note.startswith("door.max_in_flight: the door's own cap") for note in started["notes"])
    assert sim.rig.intents("trial")  # a restart's trial
    assert all(r["param"] != CAP for r in sim.rig.records("trial.started"))  # never a trial of the cap


def test_restart_knobs_wait_while_the_steered_cap_still_moves(tmp_path: Path) -> None:
    waits: list[str | None] = ["the door's cap (12) is still steering toward the targets"]
    sim = make(tmp_path, restart_wait=lambda: waits[0])
    sim.run_for(600)
    assert not sim.decided() and not sim.rig.records("trial.started")
    deferred = sim.rig.records("rule.deferred")
    assert deferred and "still steering" in deferred[0]["reason"]
    assert not sim.rig.records("rule.exhausted") and sim.tuner.memory.state.muted == {}  # deferred, not muted
    waits[0] = None  # the cap met the targets, or cannot: restart knobs are tried
    sim.run_until(lambda: bool(sim.decided()), limit_s=7200)
    assert sim.decided()[0]["param"] == "max_num_seqs"
