"""The door's cap is no rule's knob any more (issue 21: the door steers it live, door/limit.py): a rule
naming it moves its `then` at once, and its restart waits while the steered cap is still moving toward
targets it misses. In-process: a real Lifecycle and Tuner over fake processes and a fake clock; the
engine's /metrics follow the landscape of the sequences that run at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.unit.fakes import make_rig
from tests.unit.test_tuner import KV_RULE, LANDSCAPE, SimEngine, TunerRig, _wall
from tunerd.config.rules import parse_rules
from tunerd.core.params import EngineParams
from tunerd.observe.signals import SignalWindow
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.preflight import run_here
from tunerd.tune.tuner import Tuner

CAP = "door.max_in_flight"
DOOR_FIRST = {**KV_RULE, "action": {**KV_RULE["action"], "param": CAP, "then": ["max_num_seqs"]}}


@dataclass
class FakeKnobs:
    values: dict[str, Any] = field(default_factory=dict)
    sets: list[tuple[str, Any, str]] = field(default_factory=list)

    def value(self, name: str) -> Any:
        return self.values.get(name)

    def set(self, name: str, value: Any, why: str) -> None:
        self.values[name] = value
        self.sets.append((name, value, why))


@dataclass
class CappedEngine(SimEngine):
    knobs: FakeKnobs = field(default_factory=FakeKnobs)

    def sample(self, run_id: int, params: EngineParams, now: float) -> Any:
        cap = self.knobs.value(CAP)
        seqs = min(params.max_num_seqs or 256, cap or 1 << 30)
        return super().sample(run_id, params.replace(max_num_seqs=seqs), now)


def make(
    tmp_path: Path, *, door: bool = True, restart_wait: Callable[[], str | None] | None = None
) -> tuple[TunerRig, FakeKnobs]:
    overrides = {
        "engine": {"params": {"max_num_seqs": 32}},
        "observe": {"window_s": 20.0},
        "tuning": {"warmup_s": 5.0, "window_s": 30.0, "max_extend_s": 20.0, "min_serving_s": 0.0},
        "backoff": {"known_good_after_s": 5.0},
    }
    rig = make_rig(tmp_path, overrides)
    rig.lifecycle.capacity.check = lambda params: PlanOutcome(None, {"band": "fine"})  # type: ignore[method-assign]
    knobs = FakeKnobs()
    tuner = Tuner(
        rig.config, parse_rules({"rule": [DOOR_FIRST]}), rig.lifecycle, recorder=rig.recorder,
        dstate=rig.dstate, save_state=rig.lifecycle.save_state, metrics=rig.metrics, submit=run_here,
        wallclock=lambda: _wall(rig), knobs=knobs if door else None, restart_wait=restart_wait,
    )  # fmt: skip
    rig.on_change = tuner.on_change  # the loop delivers a change's outcome to the tuner
    engine = CappedEngine(LANDSCAPE, knobs=knobs)
    sim = TunerRig(rig, tuner, engine, SignalWindow(20.0))
    rig.serve()
    return sim, knobs


def test_a_rule_naming_the_doors_cap_moves_its_then_and_never_the_cap(tmp_path: Path) -> None:
    sim, knobs = make(tmp_path)
    sim.run_until(lambda: bool(sim.decided()))
    trial = sim.decided()[0]
    assert (trial["param"], trial["old"], trial["new"]) == ("max_num_seqs", 32, 16)
    started = sim.rig.last("trial.started")
    assert any(note.startswith("door.max_in_flight: the door's own cap") for note in started["notes"])
    assert sim.rig.intents("trial")  # a restart's trial
    assert knobs.sets == []  # the cap was never touched by a trial


def test_restart_knobs_wait_while_the_steered_cap_still_moves(tmp_path: Path) -> None:
    waits: list[str | None] = ["the door's cap (12) is still steering toward the targets"]
    sim, _ = make(tmp_path, restart_wait=lambda: waits[0])
    sim.run_for(600)
    assert not sim.decided() and not sim.rig.records("trial.started")
    deferred = sim.rig.records("rule.deferred")
    assert deferred and "still steering" in deferred[0]["reason"]
    assert not sim.rig.records("rule.exhausted") and sim.tuner.memory.state.muted == {}  # deferred, not muted
    waits[0] = None  # the cap met the targets, or cannot: restart knobs are tried
    sim.run_until(lambda: bool(sim.decided()), limit_s=7200)
    assert sim.decided()[0]["param"] == "max_num_seqs"


def test_without_the_door_the_rule_moves_max_num_seqs_at_once(tmp_path: Path) -> None:
    sim, _ = make(tmp_path, door=False)
    sim.run_until(lambda: bool(sim.decided()))
    trial = sim.decided()[0]
    assert (trial["param"], trial["old"], trial["new"]) == ("max_num_seqs", 32, 16)
    assert sim.rig.intents("trial")
