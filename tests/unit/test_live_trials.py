"""Trials of a knob that needs no restart — the front door's in-flight cap — in-process: a real Lifecycle
and Tuner over fake processes and a fake clock; the engine's /metrics follow the landscape of the
sequences that run at once (the door's cap or max_num_seqs, whichever is lower).

The KV rule moves the cap first (kept or reverted at once, no restart), then max_num_seqs.
"""

from __future__ import annotations

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


def make(tmp_path: Path, *, door: bool = True) -> tuple[TunerRig, FakeKnobs]:
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
        wallclock=lambda: _wall(rig), knobs=knobs if door else None,
    )  # fmt: skip
    rig.on_change = tuner.on_change  # the loop delivers a change's outcome to the tuner
    engine = CappedEngine(LANDSCAPE, knobs=knobs)
    sim = TunerRig(rig, tuner, engine, SignalWindow(20.0))
    rig.serve()
    return sim, knobs


def test_the_door_cap_is_lowered_kept_and_its_overshoot_reverted_without_a_restart(tmp_path: Path) -> None:
    sim, knobs = make(tmp_path)
    spawns = len(sim.rig.os.spawns)
    sim.run_until(lambda: len(sim.decided()) >= 2 and sim.tuner.trial is None)
    first, second = sim.decided()[:2]
    assert (first["param"], first["old"], first["new"], first["decision"]) == (CAP, None, 16, "kept")
    assert (second["param"], second["old"], second["new"], second["decision"]) == (CAP, 16, 8, "reverted")
    assert [(v, why.split(" ")[0]) for _, v, why in knobs.sets] == [
        (16, "trial"),
        (8, "trial"),
        (16, "trial"),
    ]
    assert knobs.value(CAP) == 16
    assert len(sim.rig.os.spawns) == spawns  # not one restart
    assert not sim.rig.intents("trial") and not sim.rig.intents("revert")
    started = sim.rig.records("trial.started")
    assert all(s["restart"] is False for s in started[:2])
    assert sim.tuner.memory.budget().left == sim.rig.config.tuning.restarts_per_hour  # none spent
    assert (CAP, 8) in {(e.param, e.value) for e in sim.rig.dstate.tuning.tabu}


def test_once_the_cap_can_go_no_lower_the_rule_restarts_vllm_with_fewer_sequences(tmp_path: Path) -> None:
    sim, _ = make(tmp_path)
    sim.run_until(lambda: any(d["param"] == "max_num_seqs" for d in sim.decided()), limit_s=7200)
    trial = next(d for d in sim.decided() if d["param"] == "max_num_seqs")
    started = next(s for s in sim.rig.records("trial.started") if s["param"] == "max_num_seqs")
    assert any("door.max_in_flight: the next value" in note and "tabu" in note for note in started["notes"])
    assert sim.rig.intents("trial")[0]["trial"] == trial["trial"]  # this one restarted vLLM


def test_without_the_door_the_rule_moves_max_num_seqs_at_once(tmp_path: Path) -> None:
    sim, _ = make(tmp_path, door=False)
    sim.run_until(lambda: bool(sim.decided()))
    trial = sim.decided()[0]
    assert (trial["param"], trial["old"], trial["new"]) == ("max_num_seqs", 32, 16)
    started = sim.rig.last("trial.started")
    assert "door.max_in_flight: the front door is off ([door] enabled)" in started["notes"]
    assert sim.rig.intents("trial")
