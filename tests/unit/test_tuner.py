"""The tuning loop in-process: a real Lifecycle and Tuner over fake processes, a fake clock, and an
engine whose /metrics follow a synthetic performance model of its parameters.

Each test runs a whole story in milliseconds: a rule fires on the before window, the trial restarts
vLLM through the normal start path, the after window decides, the journal tells it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fakes import INIT_ENGINE_LINE, KV_CACHE_LINE, EngineScript, Rig, make_rig, record_phases
from tunerd.cli.status import render_status
from tunerd.config.rules import RuleSet, parse_rules
from tunerd.core.engine_sample import EngineSample, Histogram
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.core.stats import min_detectable_effect, window_for
from tunerd.faces.status import tuning_status
from tunerd.observe.gpu import GpuSample
from tunerd.observe.poller import PollSample
from tunerd.observe.signals import SignalWindow
from tunerd.observe.vllm_metrics import ScrapeResult
from tunerd.policy.first_step import LostCap
from tunerd.policy.objective import Throughput
from tunerd.records.experience import Experience
from tunerd.supervise.capacity import PlanOutcome
from tunerd.tune.curve import CurvePoint
from tunerd.tune.experiment import Phase
from tunerd.tune.recall import Recall
from tunerd.tune.tuner import Tuner

CLIENTS = 24
TOKENS_PER_REQUEST = 400
LES = (0.005, 0.01, 0.025, 0.05, 0.1, math.inf)

KV_RULE = {
    "name": "kv-cache-pressure",
    "all": ["preemptions.rate > 0", "kv_cache.full_share >= 0.1"],  # as shipped (etc/tunerd/rules.toml)
    "for_s": 20,
    "cooldown_s": 60,
    "action": {"kind": "step", "param": "max_num_seqs", "direction": "down", "factor": 0.5},
}
# The stories of the rule's own step (its factor: the fallback of the KV model, tune/proposer.py): the fake
# vLLM logs no KV cache size, so the KV model has nothing to compute from.
RULE_STEP_START = (INIT_ENGINE_LINE,)
FAST = {
    "observe": {"window_s": 20.0},
    # The sim's vLLM serves each configuration alike at every start: no spread between starts.
    "tuning": {
        "warmup_s": 5.0,
        "window_s": 30.0,
        "max_extend_s": 20.0,
        "min_serving_s": 0.0,
        "start_noise": 0.0,
    },
}


@dataclass(frozen=True)
class Perf:
    """What the engine does under the steady closed-loop load at one max_num_seqs."""

    tokens_per_s: float
    preemptions_per_s: float
    kv_usage: float
    itl_s: float = 0.02


# Measured shape of the CPU case (issue 11): lowering helps, then overshoots.
LANDSCAPE = {
    64: Perf(1900.0, 6.0, 0.99),
    32: Perf(2000.0, 5.0, 0.98),
    16: Perf(2850.0, 1.0, 0.96),
    8: Perf(1950.0, 0.3, 0.93),
    4: Perf(1200.0, 0.0, 0.70),
}


@dataclass
class SimEngine:
    """/metrics of the current run: counters grow per the model of its max_num_seqs."""

    landscape: dict[int, Perf]
    clients: int = CLIENTS
    run_id: int | None = None
    t: float = 0.0
    gen: float = 0.0
    prompt: float = 0.0
    preempt: float = 0.0
    done: float = 0.0
    itl: list[float] = field(default_factory=lambda: [0.0] * len(LES))
    e2e: list[float] = field(default_factory=lambda: [0.0] * len(LES))
    load_factor: float = 1.0  # 0: the clients went away
    cap: int | None = None  # the front door's cap in force (FakeDoor): vLLM runs no more at once
    finish_s: float | None = None  # requests finish only in a run's first finish_s seconds (None: always)
    run_start: float = 0.0

    def sample(self, run_id: int, params: EngineParams, now: float) -> EngineSample:
        if run_id != self.run_id:  # a new vLLM: its counters start from zero
            fresh = SimEngine(self.landscape, self.clients, run_id, now, run_start=now)
            fresh.load_factor, fresh.finish_s = self.load_factor, self.finish_s
            self.__dict__.update(fresh.__dict__)
        dt = now - self.t
        self.t = now
        perf = self.landscape[min(params.max_num_seqs or 256, self.cap or 1 << 30)]
        wobble = 1.0 + 0.04 * math.sin(now * 1.7)  # per-second noise, deterministic
        tokens = perf.tokens_per_s * wobble * dt * self.load_factor
        self.gen += tokens
        self.prompt += tokens / TOKENS_PER_REQUEST * 16
        self.preempt += perf.preemptions_per_s * dt * self.load_factor
        finishing = self.finish_s is None or now - self.run_start < self.finish_s
        finished = tokens / TOKENS_PER_REQUEST if finishing else 0.0
        self.done += finished
        itl_bucket = next(i for i, le in enumerate(LES) if perf.itl_s <= le)
        for i in range(itl_bucket, len(LES)):
            self.itl[i] += tokens
        for i in range(len(LES) - 1, len(LES)):
            self.e2e[i] += finished
        running = min(params.max_num_seqs or 256, self.clients) * self.load_factor
        return EngineSample(
            kv_cache_usage=perf.kv_usage * self.load_factor,
            requests_running=running,
            requests_waiting=(self.clients - running / max(self.load_factor, 1e-9)) * self.load_factor
            if self.load_factor
            else 0.0,
            preemptions_total=self.preempt,
            prompt_tokens_total=self.prompt,
            generation_tokens_total=self.gen,
            inter_token_latency=Histogram(tuple(zip(LES, self.itl, strict=True)), self.itl[-1], 0.0),
            e2e_latency=Histogram(tuple(zip(LES, self.e2e, strict=True)), self.e2e[-1], 0.0),
            ttft=Histogram(tuple(zip(LES, self.e2e, strict=True)), self.e2e[-1], 0.0),
        )


@dataclass
class TunerRig:
    rig: Rig
    tuner: Tuner
    engine: SimEngine
    window: SignalWindow
    answer_health: bool = True  # False: a starting vLLM is not answered (it stays STARTING)

    @property
    def now(self) -> float:
        return self.rig.now

    def tick(self, seconds: float = 1.0) -> None:
        """One loop second: the lifecycle and the tuner step, a starting vLLM answers /health, a poll."""
        rig = self.rig
        rig.step(seconds)
        self.tuner.step(rig.now)
        life = rig.lifecycle
        if self.answer_health and life.engine.state is EngineState.STARTING and life.engine.run is not None:
            rig.step()  # reads the start-up lines
            rig.health(True)
        run = life.engine.run
        if run is None or life.engine.state is not EngineState.RUNNING:
            return
        engine = self.engine.sample(run.run_id, run.params, rig.now)
        sample = PollSample(
            run.run_id,
            rig.now,
            ScrapeResult(engine, None, 0.01, 1000),
            None,
            GpuSample(False, "none", rig.now),
            {},
        )
        signals = self.window.update(rig.now, engine, {})
        life.on_poll(sample, rig.now)
        self.tuner.on_poll(sample, signals, rig.now)

    def run_for(self, seconds: float) -> None:
        for _ in range(int(seconds)):
            self.tick()

    def run_until(self, done: Any, limit_s: float = 3600) -> None:
        for _ in range(int(limit_s)):
            if done():
                return
            self.tick()
        raise AssertionError(f"not reached in {limit_s} s; journal: {self.rig.events()[-30:]}")

    def decided(self) -> list[dict[str, Any]]:
        return self.rig.records("trial.decided")

    def params(self) -> EngineParams:
        return self.rig.lifecycle.params


def make_tuner(
    tmp_path: Path,
    *,
    rules: list[dict[str, Any]] | None = None,
    params: dict[str, Any] | None = None,
    tuning: dict[str, Any] | None = None,
    landscape: dict[int, Perf] | None = None,
    refuse: set[int] | None = None,
    memory: Experience | None = None,
    start_lines: Sequence[str] = RULE_STEP_START,
    door_lost: Any = None,
    door: Any = None,
) -> TunerRig:
    overrides: dict[str, Any] = {
        "engine": {"params": params or {"max_num_seqs": 32}},
        "observe": dict(FAST["observe"]),
        "tuning": {**FAST["tuning"], **(tuning or {})},
        "backoff": {"known_good_after_s": 5.0},
    }
    rig = make_rig(tmp_path, overrides)
    rig.os.default = EngineScript(lines=start_lines)
    ruleset: RuleSet = parse_rules({"rule": rules if rules is not None else [KV_RULE]})
    refused = refuse or set()

    def check(params: EngineParams) -> PlanOutcome:
        if params.max_num_seqs in refused:
            return PlanOutcome("oversubscription 2.10 is in band never", {"band": "never", "ratio": 2.1})
        return PlanOutcome(None, {"band": "fine", "ratio": 0.4})

    rig.lifecycle.capacity.check = check  # type: ignore[method-assign]
    from tunerd.supervise.preflight import run_here

    recall = None
    if memory is not None:
        recall = Recall(memory, rig.lifecycle, lambda: rig.config, recorder=rig.recorder,
                        wallclock=lambda: _wall(rig))  # fmt: skip
    tuner = Tuner(
        rig.config,
        ruleset,
        rig.lifecycle,
        recorder=rig.recorder,
        dstate=rig.dstate,
        save_state=rig.lifecycle.save_state,
        metrics=rig.metrics,
        submit=run_here,
        wallclock=lambda: _wall(rig),
        recall=recall,
        door_lost=door_lost,
        door=door,
    )
    rig.on_change = tuner.on_change  # the loop delivers a change's outcome to the tuner
    sim = TunerRig(rig, tuner, SimEngine(landscape or LANDSCAPE), SignalWindow(rig.config.observe.window_s))
    rig.serve()
    if memory is not None:  # what the identity job finds once vLLM serves: the memory's key needs it
        rig.dstate.identity = {"vllm_version": "0.32.0", "model": {"fingerprint": "2bf7"}, "gpu_name": None}
    return sim


def _wall(rig: Rig) -> Any:
    from datetime import UTC, datetime, timedelta

    return datetime(2026, 12, 1, 12, 0, tzinfo=UTC) + timedelta(seconds=rig.now)


# -- the story -----------------------------------------------------------------------------------


def test_kv_pressure_steps_down_keeps_what_helped_reverts_the_overshoot_and_stops(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)
    sim.run_until(lambda: len(sim.decided()) >= 2 and sim.tuner.trial is None)
    first, second = sim.decided()[:2]
    assert (first["old"], first["new"], first["decision"]) == (32, 16, "kept")
    assert first["objective"] == "throughput.generation" and first["objective_unit"] == "tok/s"
    assert first["objective_after"] > first["objective_before"] * 1.2
    assert (second["old"], second["new"], second["decision"]) == (16, 8, "reverted")
    assert "worse" in second["reason"]
    assert sim.params().max_num_seqs == 16
    assert sim.rig.lifecycle.known_good == sim.params()  # the kept trial promoted it
    # It stops there: 8 is tabu, and the step past it is never tried.
    sim.run_for(600)
    assert len(sim.decided()) == 2
    events = sim.rig.events()
    assert "rule.exhausted" in events or "rule.muted" in events
    assert [i["action"] for i in sim.rig.intents()][-3:] == ["trial", "trial", "revert"]
    assert sim.rig.sample("tunerd_trials_total", outcome="kept") == 1
    assert sim.rig.sample("tunerd_trials_total", outcome="reverted") == 1


def test_a_kept_step_that_clears_the_condition_resolves_the_rule_and_the_story_ends(tmp_path: Path) -> None:
    cleared = {32: Perf(2000.0, 5.0, 0.98), 16: Perf(2400.0, 0.0, 0.75)}
    sim = make_tuner(tmp_path, landscape=cleared)
    sim.run_until(lambda: sim.rig.records("rule.resolved"))
    (decided,) = sim.decided()
    assert (decided["old"], decided["new"], decided["decision"]) == (32, 16, "kept")
    (resolved,) = sim.rig.records("rule.resolved")
    assert resolved["rule"] == "kv-cache-pressure" and resolved["seq"] > decided["seq"]
    assert all(t["holds"] is False for t in resolved["terms"][1:])  # no preemptions at 16
    sim.run_for(600)
    assert len(sim.decided()) == 1 and len(sim.rig.records("rule.resolved")) == 1
    assert "rule.exhausted" not in sim.rig.events()


def test_every_phase_a_trial_takes_goes_through_the_experiment_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = record_phases(monkeypatch)
    sim = make_tuner(tmp_path)
    sim.run_until(lambda: len(sim.decided()) >= 1 and sim.tuner.trial is None)
    p = Phase
    walk = [(p.NONE, p.PLANNING), (p.PLANNING, p.APPLYING), (p.APPLYING, p.WARMUP), (p.WARMUP, p.MEASURING)]
    assert seen[:5] == [*walk, (p.MEASURING, p.DECIDED)]
    assert seen[-1][1] is p.NONE and all(new is old_next for (_, new), (old_next, _) in pairwise(seen))


def test_the_journal_tells_the_trial_in_order(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)
    sim.run_until(lambda: len(sim.decided()) >= 1 and sim.tuner.trial is None)
    events = sim.rig.events()
    story = ["rule.fired", "trial.started", "intent", "engine.stopped", "engine.spawned", "engine.ready"]
    positions = [events.index(e, events.index("rule.fired")) for e in story]
    assert positions == sorted(positions)
    decided = sim.decided()[0]
    assert decided["before"]["throughput"]["n"] >= 20  # per-second samples behind the median
    assert decided["after"]["throughput"]["n"] >= 20
    assert decided["before"]["saturated"] and decided["after"]["saturated"]
    intent = sim.rig.intents("trial")[0]
    assert intent["params_before"]["max_num_seqs"] == 32 and intent["params"]["max_num_seqs"] == 16
    assert intent["trial"] == decided["trial"]


def test_a_trial_whose_start_fails_is_reverted_at_once_and_the_engine_serves_again(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)
    rig = sim.rig
    sim.run_until(lambda: sim.tuner.trial is not None and sim.tuner.trial.phase is Phase.APPLYING)
    sim.answer_health = False
    sim.run_until(lambda: rig.state is EngineState.STARTING)
    run = rig.lifecycle.engine.run
    assert run is not None and run.params.max_num_seqs == 16  # the trial's vLLM ...
    rig.os.exit(run.pid, 1)  # ... exits by itself during its start
    sim.answer_health = True
    sim.run_until(lambda: sim.tuner.trial is None)
    decided = sim.decided()[0]
    assert decided["decision"] == "failed"
    assert [i["action"] for i in rig.intents()][-2:] == ["trial", "revert"]  # no retry with the trial's
    assert rig.state is EngineState.RUNNING and sim.params().max_num_seqs == 32
    assert ("max_num_seqs", 16) in {(e.param, e.value) for e in rig.dstate.tuning.tabu}


def test_a_change_the_planner_refuses_costs_no_restart(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path, refuse={16})
    spawns = len(sim.rig.os.spawns)
    sim.run_until(lambda: bool(sim.rig.records("trial.refused")))
    refused = sim.rig.last("trial.refused")
    assert "band never" in refused["reason"] and refused["plan"]["ratio"] == 2.1
    assert len(sim.rig.os.spawns) == spawns and not sim.rig.intents("trial")
    assert sim.tuner.trial is None


def test_dry_run_journals_the_proposal_and_changes_nothing(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path, tuning={"mode": "dry-run"})
    spawns = len(sim.rig.os.spawns)
    sim.run_until(lambda: bool(sim.rig.records("trial.proposed")))
    proposed = sim.rig.last("trial.proposed")
    assert (proposed["old"], proposed["new"]) == (32, 16)
    assert (proposed["proposed_by"], proposed["arithmetic"]) == ("rule step", None)
    assert proposed["before"]["throughput"]["n"] > 0
    sim.run_for(300)
    assert len(sim.rig.os.spawns) == spawns and sim.params().max_num_seqs == 32


# -- the first step from the KV model (issue 22) -----------------------------------------------------------

H200 = Path(__file__).parents[1] / "fixtures" / "vllm-0.24.0-h200"


def h200_line(needle: str) -> str:
    """The first line of the H200's default start (vLLM 0.24) that contains `needle`."""
    return next(line for line in (H200 / "default_cold.log").read_text().splitlines() if needle in line)


# The H200's engine config line (its CUDA-graph capture sizes: 1, 2, 4, 8, 16, 24, ...) and its KV cache
# line, resized to the issue's case: 599 blocks of 16 hold 23 requests of 16 prompt + 400 output tokens
# (598 usable ÷ 26 blocks a request) — and 23 lands between capture sizes.
H200_CONFIG_LINE = h200_line("Initializing a V1 LLM engine")
H200_KV_23 = h200_line("GPU KV cache size:").replace("1,182,912", f"{599 * 16:,}")
KV_MODEL_START = (INIT_ENGINE_LINE, H200_CONFIG_LINE, H200_KV_23)


def test_the_first_step_under_kv_pressure_comes_from_the_kv_models_arithmetic(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path, start_lines=KV_MODEL_START)
    sim.run_until(lambda: bool(sim.decided()))
    started = sim.rig.last("trial.started")
    assert (started["old"], started["new"]) == (32, 16)  # not 23: vLLM captured graphs up to 16 there
    assert started["proposed_by"] == "kv model"
    assert started["arithmetic"] == (
        "KV cache 9,584 tokens (vLLM's log) = 599 blocks of 16, 598 usable (one is vLLM's null block) ÷ "
        "26 blocks per request (16 prompt + 400 output = 416 tokens) = 23.00 → 23; "
        "down to a CUDA-graph capture size in vLLM's log → 16"
    )
    assert sim.decided()[0]["decision"] == "kept"


def test_with_none_finished_in_the_before_window_the_runs_history_sizes_the_step(tmp_path: Path) -> None:
    # Requests finished in the run's first 5 s only; the before window (10 s, ending at the firing ~25 s
    # in) saw none: the run so far gives the tokens per request, and the journal says so.
    sim = make_tuner(tmp_path, start_lines=KV_MODEL_START, tuning={"window_s": 10.0})
    sim.engine.finish_s = 5.0
    sim.run_until(lambda: bool(sim.rig.records("trial.started")))
    started = sim.rig.last("trial.started")
    assert started["proposed_by"] == "kv model", started
    assert "none finished in the before window" in started["arithmetic"], started
    assert started["before"]["generation_tokens_per_request"] is None, started["before"]


def test_a_model_value_that_lost_falls_back_to_the_rules_step(tmp_path: Path) -> None:
    # The vLLM of the CPU fixtures (1,952 tokens; no capture sizes logged: vLLM's default list): the model
    # says 4, which loses and goes tabu; the rule's own step (halving) is then proposed, saying why.
    sim = make_tuner(tmp_path, start_lines=(INIT_ENGINE_LINE, KV_CACHE_LINE))
    sim.run_until(lambda: len(sim.decided()) >= 2, limit_s=7200)
    first, second = sim.rig.records("trial.started")[:2]
    assert (first["new"], first["proposed_by"]) == (4, "kv model")
    assert "vLLM's default capture sizes (1, 2, 4, multiples of 8; none logged) → 4" in first["arithmetic"]
    assert sim.decided()[0]["decision"] == "reverted"
    assert (second["new"], second["proposed_by"], second["arithmetic"]) == (16, "rule step", None)
    assert any(n.startswith("kv model: max_num_seqs=4 is tabu: reverted") for n in second["notes"])


def test_without_kv_cache_size_the_rules_step_is_proposed_and_says_why(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)  # the fake vLLM logs no KV cache size
    sim.run_until(lambda: bool(sim.rig.records("trial.started")))
    started = sim.rig.last("trial.started")
    assert (started["new"], started["proposed_by"], started["arithmetic"]) == (16, "rule step", None)
    assert "kv model: the KV cache's size is not known" in " ".join(started["notes"])


def test_a_concurrency_the_doors_cap_lost_is_not_tried_for_max_num_seqs(tmp_path: Path) -> None:
    lost = [LostCap(16, "its requests missed the targets only by the door's wait")]
    sim = make_tuner(tmp_path, start_lines=KV_MODEL_START, door_lost=lambda: lost)
    sim.run_for(600)
    # The model's 16 and the rule's 16 are both at the lost cap: deferred (the door's memory ages out).
    assert not sim.rig.records("trial.started") and not sim.rig.records("rule.exhausted")
    deferred = sim.rig.last("rule.deferred")
    assert deferred["reason"] == (
        "max_num_seqs: the door's cap at 16 already lost under this load (its requests missed the targets "
        "only by the door's wait): max_num_seqs=16 runs no more at once"
    )
    lost[:] = [LostCap(8, "its requests missed the targets only by the door's wait")]
    sim.run_until(lambda: bool(sim.rig.records("trial.started")), limit_s=7200)
    assert sim.rig.last("trial.started")["new"] == 16  # above the cap lost at 8


def test_pause_stops_rules_acting_and_survives_a_daemon_restart(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)
    assert sim.tuner.pause()
    sim.run_until(lambda: bool(sim.rig.records("rule.deferred")))
    assert "paused" in sim.rig.last("rule.deferred")["reason"]
    assert not sim.rig.intents("trial")
    state = sim.rig.store.load()[0]  # what the next daemon reads
    assert state.tuning.paused is True
    assert sim.rig.sample("tunerd_tuning_mode") == -1


def test_no_promotion_by_time_while_a_trial_runs(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)
    sim.run_until(lambda: sim.tuner.trial is not None and sim.tuner.trial.phase is Phase.MEASURING)
    sim.run_for(10)  # longer than backoff.known_good_after_s (5 s) into the trial's run
    assert sim.rig.lifecycle.known_good is not None
    assert sim.rig.lifecycle.known_good.max_num_seqs == 32


def test_an_operator_restart_during_a_trial_ends_it_as_aborted(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)
    sim.run_until(lambda: sim.tuner.trial is not None and sim.tuner.trial.phase is Phase.MEASURING)
    assert sim.rig.lifecycle.restart(EngineParams(max_num_seqs=24), "operator restart", action="change")
    sim.rig.deliver()  # the loop delivers the change's outcome (aborted) to the tuner
    aborted = sim.rig.last("trial.aborted")
    assert "superseded" in aborted["reason"] and aborted["new"] == 16
    assert sim.tuner.trial is None and sim.rig.lifecycle.slot.current is None


def test_a_trial_aborted_in_the_lifecycle_is_not_decided_before_its_outcome_arrives(tmp_path: Path) -> None:
    # The outcome comes back through the loop's queue: between the abort and its delivery, the tuner's
    # step must not judge (and keep or revert) a change the lifecycle no longer runs.
    sim = make_tuner(tmp_path)
    sim.run_until(lambda: sim.tuner.trial is not None and sim.tuner.trial.phase is Phase.MEASURING)
    assert sim.rig.lifecycle.restart(EngineParams(max_num_seqs=24), "operator restart", action="change")
    sim.rig.clock.advance(sim.rig.config.tuning.window_s + sim.rig.config.tuning.max_extend_s)
    sim.tuner.step(sim.now)  # the after window is over, the outcome not yet delivered
    assert not sim.decided()
    sim.rig.deliver()
    assert sim.rig.last("trial.aborted")["new"] == 16 and sim.tuner.trial is None
    assert not sim.decided()


def test_a_load_that_goes_away_makes_the_result_inconclusive_and_reverts(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)
    sim.run_until(lambda: sim.tuner.trial is not None and sim.tuner.trial.phase is Phase.MEASURING)
    sim.engine.load_factor = 0.3  # most clients left: the offered load is not the one measured before
    sim.run_until(lambda: bool(sim.decided()))
    decided = sim.decided()[0]
    assert decided["decision"] == "reverted" and decided["inconclusive"] is True
    assert "trial.extended" in sim.rig.events()


def test_an_oscillating_pair_of_rules_stops_causing_restarts(tmp_path: Path) -> None:
    # Two rules pull max_num_seqs both ways, and each change eases its own rule's condition without
    # costing throughput (16 serves more: issue 22 keeps only what the evidence calls better): each would
    # be kept, round and round, unless something stops it.
    landscape = {16: Perf(2400.0, 0.0, 0.85), 32: Perf(2000.0, 0.0, 0.95), 64: Perf(2000.0, 0.0, 0.95)}
    down = {
        "name": "kv-full",
        "all": ["kv_cache.usage_avg > 0.9"],
        "for_s": 20,
        "cooldown_s": 30,
        "action": {"kind": "step", "param": "max_num_seqs", "direction": "down", "factor": 0.5},
    }
    up = {
        "name": "queue",
        "all": ["requests.waiting_max >= 4"],
        "for_s": 20,
        "cooldown_s": 30,
        "action": {"kind": "step", "param": "max_num_seqs", "direction": "up", "factor": 2.0},
    }
    sim = make_tuner(tmp_path, rules=[down, up], landscape=landscape)
    sim.run_for(4 * 3600)
    kept = [(d["rule"], d["old"], d["new"]) for d in sim.decided() if d["decision"] == "kept"]
    assert kept == [("kv-full", 32, 16)]
    # The other rule's change would undo the kept one within tabu_s: refused, the rule muted.
    (muted,) = [r for r in sim.rig.records("rule.muted") if r["rule"] == "queue"]
    assert "would undo the change max_num_seqs 32 → 16" in muted["reason"]
    assert sim.rig.records("rule.fired")[-1]["rule"] in ("queue", "kv-full")
    sim.run_for(2 * 3600)
    assert len(sim.rig.intents("trial")) == 1  # no restart since


def test_the_restart_budget_defers_a_rule_when_spent(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path, tuning={"restarts_per_hour": 0})
    sim.run_until(lambda: bool(sim.rig.records("rule.deferred")))
    assert "budget" in sim.rig.last("rule.deferred")["reason"]
    assert not sim.rig.intents("trial")


def test_a_trial_decided_on_latency_names_its_objective_in_the_journal_and_the_memory(tmp_path: Path) -> None:
    # Issue 20: unsaturated, a trial compares ITL p95 in seconds, and the tuning memory filed that value
    # in the field where saturated trials and probes put tokens per second, with nothing to tell which.
    memory = Experience(tmp_path / "memory.json")
    unsaturated = {"saturated_waiting": 1000.0, "saturated_kv_usage": 1.0, "load_tolerance": 0.6}
    sim = make_tuner(tmp_path, tuning=unsaturated, memory=memory)
    sim.run_until(lambda: len(sim.decided()) >= 1 and sim.tuner.trial is None)
    first = sim.decided()[0]
    assert (first["objective"], first["objective_unit"]) == ("itl.p95", "s")
    (entry,) = [e for e in Experience(memory.path).entries() if e.kind == "trial"][:1]
    assert (entry.objective_name, entry.objective_unit, entry.objective_source) == ("itl.p95", "s", "live")
    # Issue 22: the same ITL before and after is "no difference": reverted (a reverted entry keeps no value).
    decision = "keep" if first["decision"] == "kept" else "revert"
    assert entry.decision == decision
    assert entry.objective == (first["objective_after"] if decision == "keep" else None)
    assert entry.figures["objective_before"] == first["objective_before"]  # seconds too, not tok/s


@dataclass
class QueueFromStart(SimEngine):
    """Requests queue up 30 s after each start (12 waiting from then on): once they do, the last poll's
    queue is far longer than the window's average, so the last value and the mean disagree."""

    run_start: float = 0.0

    def sample(self, run_id: int, params: EngineParams, now: float) -> EngineSample:
        new_run = run_id != self.run_id
        sample = super().sample(run_id, params, now)
        if new_run:
            self.run_start = now
        return replace(sample, requests_waiting=12.0 if now - self.run_start >= 30 else 0.0)


def test_eased_reads_the_statistic_the_rule_fired_on(tmp_path: Path) -> None:
    # Issue 20: the rules read `requests.waiting` as the last poll's value, the trial's `eased` as the
    # window's mean. A rule that fired on the last value (12 > 10) was judged on the mean (about 2: "no
    # longer holds") and the change was kept as having eased the queue, though the after window repeats
    # the before window's samples: the same queue at the same age of the run, the change did nothing.
    same = Perf(2000.0, 0.0, 0.5)
    queue = {
        "name": "queue",
        "all": ["requests.waiting > 10"],
        "for_s": 2,
        "cooldown_s": 600,
        "purpose": "safety",
        "action": {"kind": "step", "param": "max_num_seqs", "direction": "up", "factor": 2},
    }
    sim = make_tuner(tmp_path, rules=[queue], landscape={32: same, 64: same})
    sim.engine = QueueFromStart(sim.engine.landscape)
    sim.run_until(lambda: len(sim.decided()) >= 1 and sim.tuner.trial is None)
    (fired,) = sim.rig.records("rule.fired")[:1]
    assert fired["terms"][0]["value"] > 10  # the last value fired it
    first = sim.decided()[0]
    assert (first["old"], first["new"]) == (32, 64)
    assert first["before"]["waiting_avg"] < 10  # the mean never held
    assert (first["decision"], first["reason"]) == ("reverted", "the safety condition did not ease")


def test_the_planner_is_asked_once_for_a_trials_parameters(tmp_path: Path) -> None:
    # Issue 20: the trial's planning step asked the planner, then the start's preflight asked it again
    # for the same parameters; the plan made in planning now travels with the request to the preflight.
    sim = make_tuner(tmp_path)
    asked: list[EngineParams] = []
    check = sim.rig.lifecycle.capacity.check

    def counting(params: EngineParams) -> PlanOutcome:
        asked.append(params)
        return check(params)

    sim.rig.lifecycle.capacity.check = counting  # type: ignore[method-assign]
    sim.run_until(lambda: len(sim.decided()) >= 1 and sim.tuner.trial is None)
    started = sim.rig.last("trial.started")
    assert started["plan"] == {"band": "fine", "ratio": 0.4}
    assert [p.max_num_seqs for p in asked].count(16) == 1
    plans = [r for r in sim.rig.records("preflight.plan") if r["params"]["max_num_seqs"] == 16]
    assert len(plans) == 1 and plans[0]["band"] == "fine"  # the preflight still journals the plan it used


def test_a_concurrency_the_curve_lost_is_not_tried_for_max_num_seqs_on_that_run(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path, start_lines=KV_MODEL_START)
    run = sim.rig.lifecycle.engine.run
    assert run is not None
    points = (
        CurvePoint(16, 30.0, 50.0, 0.02, 50.0, None, None, None, None, None),
        CurvePoint(32, 30.0, 100.0, 0.02, 100.0, None, None, None, None, None),
    )
    sim.tuner.curves.keep(run.run_id, points, Throughput())  # what `tunerd door --curve 16,32` leaves
    why = (
        "the concurrency curve: the door's cap at 16 served 50 tok/s against 100 tok/s at 32 (-50%, "
        "noise ±3%)"
    )
    sim.run_for(600)
    assert not sim.rig.records("trial.started")
    assert sim.rig.last("rule.deferred")["reason"] == (
        f"max_num_seqs: the door's cap at 16 already lost under this load ({why}): max_num_seqs=16 runs no "
        "more at once"
    )


def test_a_restart_the_curve_measured_says_what_it_is_expected_to_gain(tmp_path: Path) -> None:
    # The restart is let through only where the cap at the new value ranked first on the curve; its note
    # compares that cap with the cap at the max_num_seqs in force (32), not with the best (itself: +0 %).
    sim = make_tuner(tmp_path, start_lines=KV_MODEL_START)
    run = sim.rig.lifecycle.engine.run
    assert run is not None
    points = (
        CurvePoint(16, 30.0, 104.0, 0.02, 104.0, None, None, None, None, None),
        CurvePoint(32, 30.0, 100.0, 0.02, 100.0, None, None, None, None, None),
    )
    sim.tuner.curves.keep(run.run_id, points, Throughput())  # what `tunerd door --curve 16,32` leaves
    sim.run_until(lambda: bool(sim.rig.records("trial.started")))
    started = sim.rig.last("trial.started")
    assert started["new"] == 16
    assert (
        "the concurrency curve measured the door's cap at 16: 104 tok/s, against 100 tok/s at 32 (the "
        "max_num_seqs in force): expected gain of the restart +4% (about what the cap served; more only for "
        "memory or batch shapes)"
    ) in started["notes"]


# -- evidence before a decision (issue 22) ------------------------------------------------------------


def test_a_gain_the_evidence_cannot_tell_extends_the_window_then_is_reverted_as_no_difference(
    tmp_path: Path,
) -> None:
    # 16 serves exactly 1 + tolerance (5 %) more: the ratio's interval straddles the threshold whatever the
    # window. The after window doubles within the budget (30 s, then + 20 s: max_extend_s), the before
    # window grows with it (as far as the run before served past its warm-up), then "no difference".
    landscape = {**LANDSCAPE, 16: Perf(2100.0, 1.0, 0.96)}
    sim = make_tuner(tmp_path, landscape=landscape)
    sim.run_until(lambda: bool(sim.decided()))
    (extended,) = sim.rig.records("trial.extended")
    assert (extended["by_s"], extended["window_s"], extended["budget_left_s"]) == (20.0, 50.0, 0.0)
    assert extended["evidence"]["ratio_interval"][0] < 1.05 < extended["evidence"]["ratio_interval"][1]
    decided = sim.decided()[0]
    assert decided["decision"] == "reverted" and decided["evidence"] == "no difference (budget spent)"
    low, high = decided["ratio_interval"]
    assert low < 1.05 < high and decided["confidence"] == 0.95
    windows = decided["windows"]
    assert (windows["extensions"], windows["extended_s"], windows["window_s"]) == (1, 20.0, 50.0)
    assert windows["before_s"] > 30.0  # grew with the after window, past the 30 s the rule fired on
    figures = decided["figures"]
    assert figures["n_after"] >= 45 and figures["n_before"] == pytest.approx(windows["before_s"], abs=1)
    assert figures["effective_n_after"] > 0 and figures["noise_after"] > 0
    assert figures["min_detectable_effect"] > 0


def test_a_clear_gain_is_kept_at_the_first_look(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path)  # 32 → 16: 2000 → 2850 tok/s
    sim.run_until(lambda: bool(sim.decided()))
    decided = sim.decided()[0]
    assert (decided["decision"], decided["evidence"]) == ("kept", "better")
    assert decided["ratio_interval"][0] > 1.05 and decided["windows"]["extensions"] == 0
    assert "trial.extended" not in sim.rig.events()


# Starts a side: a spread between vLLM starts of 5 % hides +18 % from one start a side (the interval's
# half-width is at least 1.96 × √2 × 5 % ≈ 14 %), and the sim's windows are quiet: more starts, not longer
# windows, are what tell.
SEVERAL_STARTS = {"start_noise": 0.05, "max_starts": 3, "max_extend_s": 0.0, "restarts_per_hour": 100}


def test_a_gain_the_spread_between_starts_hides_is_measured_over_more_starts_a_side_then_kept(
    tmp_path: Path,
) -> None:
    landscape = {**LANDSCAPE, 16: Perf(2360.0, 1.0, 0.96)}  # 32 → 16: +18 %
    sim = make_tuner(tmp_path, landscape=landscape, tuning=SEVERAL_STARTS)
    sim.run_until(lambda: bool(sim.decided()) and sim.tuner.trial is None)
    (extended,) = sim.rig.records("trial.extended")
    assert (extended["by"], extended["starts_a_side"], extended["max_starts"]) == ("start", 2, 3)
    assert "another vLLM start a side" in extended["reason"]
    low, high = extended["evidence"]["ratio_interval"]
    assert low < 1.05 < high  # one start a side could not tell
    # The restarts alternate: the change, the configuration before, the change again; then it is kept.
    assert [i["params"]["max_num_seqs"] for i in sim.rig.intents("trial")] == [16, 32, 16]
    decided = sim.decided()[0]
    assert (decided["decision"], decided["evidence"]) == ("kept", "better")
    figures = decided["figures"]
    assert (figures["starts_before"], figures["starts_after"]) == (2, 2)
    assert len(figures["start_means_before"]) == 2 and len(figures["start_means_after"]) == 2
    # The sim's starts agree with each other: pooled with the setting, the spread used is below 5 %.
    assert 0 < figures["start_noise_pooled"] < 0.05
    assert decided["ratio_interval"][0] > 1.05 and decided["windows"]["starts_a_side"] == 2
    assert sim.params().max_num_seqs == 16 and sim.rig.dstate.last_known_good["max_num_seqs"] == 16


def test_a_gain_that_max_starts_cannot_tell_is_reverted_as_no_difference_after_the_last_start(
    tmp_path: Path,
) -> None:
    # +6 %: at 3 starts a side the spread between starts (5 % a start, pooled with the starts' own) still
    # leaves the interval's low end below 1 + tolerance: "no difference", reverted after the third start.
    landscape = {**LANDSCAPE, 16: Perf(2120.0, 1.0, 0.96)}
    sim = make_tuner(tmp_path, landscape=landscape, tuning=SEVERAL_STARTS)
    sim.run_until(lambda: bool(sim.decided()) and sim.tuner.trial is None)
    assert [e["starts_a_side"] for e in sim.rig.records("trial.extended")] == [2, 3]
    assert [i["params"]["max_num_seqs"] for i in sim.rig.intents("trial")] == [16, 32, 16, 32, 16]
    decided = sim.decided()[0]
    assert (decided["decision"], decided["evidence"]) == ("reverted", "no difference")
    assert decided["figures"]["starts_after"] == 3 and "no_window_can_tell" in decided["figures"]
    assert sim.rig.intents()[-1]["action"] == "revert" and sim.params().max_num_seqs == 32


def test_without_two_restarts_left_in_the_budget_a_trial_decides_on_one_start_a_side(tmp_path: Path) -> None:
    landscape = {**LANDSCAPE, 16: Perf(2360.0, 1.0, 0.96)}
    sim = make_tuner(tmp_path, landscape=landscape, tuning={**SEVERAL_STARTS, "restarts_per_hour": 2})
    sim.run_until(lambda: bool(sim.decided()) and sim.tuner.trial is None)
    assert "trial.extended" not in sim.rig.events()  # the change's restart left one: no start a side more
    decided = sim.decided()[0]
    assert (decided["decision"], decided["evidence"]) == ("reverted", "no difference")
    assert decided["figures"]["starts_after"] == 1
    assert [i["params"]["max_num_seqs"] for i in sim.rig.intents("trial")] == [16]


def test_a_start_of_the_configuration_before_that_fails_aborts_the_trial_without_blaming_the_change(
    tmp_path: Path,
) -> None:
    landscape = {**LANDSCAPE, 16: Perf(2360.0, 1.0, 0.96)}
    sim = make_tuner(tmp_path, landscape=landscape, tuning=SEVERAL_STARTS)
    rig = sim.rig
    sim.run_until(lambda: bool(rig.records("trial.extended")))
    sim.answer_health = False
    sim.run_until(lambda: rig.state is EngineState.STARTING)
    run = rig.lifecycle.engine.run
    assert run is not None and run.params.max_num_seqs == 32  # the configuration before's second start
    rig.os.exit(run.pid, 1)
    sim.answer_health = True
    sim.run_until(lambda: sim.tuner.trial is None)
    aborted = rig.last("trial.aborted")
    assert "the configuration before failed to start" in aborted["reason"]
    assert not sim.decided()
    assert rig.state is EngineState.RUNNING and sim.params().max_num_seqs == 32
    assert ("max_num_seqs", 16) not in {(e.param, e.value) for e in rig.dstate.tuning.tabu}


def test_the_noise_meter_shows_the_objectives_noise_and_what_a_window_can_detect(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path, rules=[])
    sim.run_for(60)
    noise = sim.tuner.noise(sim.now)
    assert noise is not None and noise["objective"] == "throughput.generation"
    assert noise["window_s"] == 30.0 and 28 <= noise["samples"] <= 30
    rel = noise["relative_noise"]
    assert 0 < rel < 0.04  # the simulated ±4 % per second; a window's mean is known better
    mde = min_detectable_effect(rel, rel, confidence=0.95)
    assert noise["min_detectable_effect"] == pytest.approx(mde, abs=2e-4)
    need = window_for(0.05, rel, 30.0, confidence=0.95)
    assert noise["window_for_tolerance_s"] == pytest.approx(need, rel=0.02)
    status = tuning_status(sim.tuner, sim.now)
    assert status["noise"] == noise
    page = render_status({"tuning": status})
    assert f"noise: throughput.generation known to ±{rel:.1%} over 30 s" in page
    assert f"detects ≥ {noise['min_detectable_effect']:.1%}" in page


def test_the_noise_meter_says_what_the_spread_between_starts_leaves_to_a_restart(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path, rules=[], tuning={"start_noise": 0.05})
    sim.run_for(60)
    noise = sim.tuner.noise(sim.now)
    assert noise is not None
    rel = noise["relative_noise"]
    across = min_detectable_effect(rel, rel, confidence=0.95, start_noise=0.05)
    assert noise["min_detectable_effect_across_starts"] == pytest.approx(across, abs=2e-4)
    # (1.96 + 1.28) × √2 × 5 % ≈ 23 % from the starts alone: no window detects 5 %, 22 starts a side would.
    assert noise["window_for_tolerance_across_starts_s"] is None
    assert noise["starts_per_arm_for_tolerance"] == 22
    page = render_status({"tuning": tuning_status(sim.tuner, sim.now)})
    assert "across a restart (start_noise 5% a start): ≥ 23." in page
    assert "no window would: 22 starts a side would" in page


def test_no_noise_figure_without_polls(tmp_path: Path) -> None:
    sim = make_tuner(tmp_path, rules=[])
    assert sim.tuner.noise(sim.now) is None


# -- the door's cap measured before a restart of max_num_seqs (issue 22) ----------------------------------


class FakeDoor:
    """The door's cap as the tuner's curve moves it: the simulated vLLM runs no more than it at once."""

    def __init__(self, steered: int | None = None) -> None:
        self.sim: TunerRig | None = None
        self.calls: list[tuple[str, int | None]] = []
        self.steered = steered  # the cap the door's controller holds (None: none)

    def try_cap(self, cap: int, why: str) -> None:
        assert self.sim is not None
        self.sim.engine.cap = cap
        self.calls.append(("cap", cap))

    def restore(self, why: str) -> None:
        assert self.sim is not None
        self.sim.engine.cap = self.steered
        self.calls.append(("restore", None))

    def steered_cap(self) -> int | None:
        return self.steered


def curve_tuner(
    tmp_path: Path, at_16: Perf, steered: int | None = None, more: dict[int, Perf] | None = None
) -> tuple[TunerRig, FakeDoor]:
    door = FakeDoor(steered)
    landscape = {**LANDSCAPE, 16: at_16, **(more or {})}
    sim = make_tuner(tmp_path, start_lines=KV_MODEL_START, landscape=landscape, door=door)
    door.sim = sim
    sim.engine.cap = steered
    return sim, door


def test_with_the_door_on_a_lower_max_num_seqs_is_measured_through_the_cap_before_any_restart(
    tmp_path: Path,
) -> None:
    # The cap at 16 serves far less than at 32: lost without a restart, and the step is not taken.
    sim, door = curve_tuner(tmp_path, Perf(1000.0, 0.0, 0.7))
    spawns = len(sim.rig.os.spawns)
    sim.run_until(lambda: bool(sim.rig.records("door.curve.finished")))
    sim.run_for(5)
    started = sim.rig.last("door.curve.started")
    assert started["caps"] == [16, 32] and started["trigger"].startswith("rule kv-cache-pressure")
    done = sim.rig.last("door.curve.finished")
    assert done["best"] == 32 and [lost["cap"] for lost in done["lost"]] == [16], done
    assert door.calls == [("cap", 16), ("cap", 32), ("restore", None)]
    deferred = sim.rig.last("rule.deferred")
    assert "the door's cap at 16 already lost under this load (the concurrency curve:" in deferred["reason"]
    assert not sim.rig.records("trial.started") and len(sim.rig.os.spawns) == spawns  # no restart


def test_a_rule_firing_in_the_same_poll_waits_for_the_curve_another_one_began(tmp_path: Path) -> None:
    # The KV rule fires and its step waits on the door's curve; a second rule holding on the same poll
    # must not start a trial (its restart would abort the curve): one experiment at a time.
    door = FakeDoor()
    batched = {
        "name": "batched-tokens",
        "all": ["preemptions.rate > 0"],
        "for_s": 20,
        "cooldown_s": 60,
        "action": {"kind": "step", "param": "max_num_batched_tokens", "direction": "down", "factor": 0.5},
    }
    sim = make_tuner(tmp_path, start_lines=KV_MODEL_START, rules=[KV_RULE, batched], door=door)
    door.sim = sim
    sim.run_until(lambda: bool(sim.rig.records("door.curve.started")))
    sim.run_until(
        lambda: bool(sim.rig.records("door.curve.finished") or sim.rig.records("door.curve.aborted"))
    )
    assert not sim.rig.records("door.curve.aborted"), sim.rig.last("door.curve.aborted")
    started = sim.rig.records("trial.started")
    curve_done = sim.rig.last("door.curve.finished")
    assert all(t["seq"] > curve_done["seq"] for t in started), started


def test_a_cap_that_serves_no_more_is_not_worth_a_restart(tmp_path: Path) -> None:
    # The cap at 16 serves what the cap at 32 serves: a restart to max_num_seqs 16 would buy nothing the
    # cap does not (the H200's open loop paid 81.6 s for such a restart): deferred, no restart.
    sim, _ = curve_tuner(tmp_path, LANDSCAPE[32])
    spawns = len(sim.rig.os.spawns)
    sim.run_until(lambda: bool(sim.rig.records("door.curve.finished")))
    sim.run_for(5)
    deferred = sim.rig.last("rule.deferred")
    assert "a restart to it buys no more than the cap" in deferred["reason"], deferred
    assert not sim.rig.records("trial.started") and len(sim.rig.os.spawns) == spawns


def test_a_cap_that_serves_more_lets_the_restart_go_ahead_with_its_expected_gain(tmp_path: Path) -> None:
    sim, door = curve_tuner(tmp_path, LANDSCAPE[16])  # 2,850 tok/s at 16 against 2,000 at 32
    sim.run_until(lambda: bool(sim.rig.records("trial.started")))
    started = sim.rig.last("trial.started")
    assert (started["old"], started["new"]) == (32, 16)
    assert any(
        note.startswith("the concurrency curve measured the door's cap at 16:") and "expected gain" in note
        for note in started["notes"]
    ), started["notes"]
    assert door.calls == [("cap", 16), ("cap", 32), ("restore", None)]


def test_a_max_num_seqs_no_lower_than_the_steered_cap_is_not_restarted_to(tmp_path: Path) -> None:
    # The H100's closed loop (docs/gpu.md, the seventh lease): the door's cap met the targets at 18 while
    # the KV rule's window still held the preemptions of no cap; its restart to max_num_seqs 8 held 64
    # clients for 93 s. Here the door steers 16 and the KV model says 16: vLLM runs 16 at once already.
    sim, door = curve_tuner(tmp_path, LANDSCAPE[16], steered=16)
    spawns = len(sim.rig.os.spawns)
    sim.run_until(lambda: bool(sim.rig.records("rule.deferred")))
    deferred = sim.rig.last("rule.deferred")
    assert deferred["reason"] == (
        "max_num_seqs: the door's steered cap runs 16 at once already, no more than max_num_seqs=16 would: "
        "a restart to it buys nothing the cap does not"
    ), deferred
    sim.run_for(600)
    assert not sim.rig.records("trial.started") and len(sim.rig.os.spawns) == spawns  # no restart
    assert not sim.rig.records("door.curve.started") and door.calls == []
    assert not sim.rig.records("rule.exhausted")  # deferred: the cap moves


def test_a_lower_max_num_seqs_is_measured_against_the_cap_the_door_steers(tmp_path: Path) -> None:
    # The door steers 24 (below max_num_seqs 32): the curve compares the KV model's 16 with 24, the
    # concurrency in force, not with 32, which the door does not let run.
    sim, door = curve_tuner(tmp_path, Perf(1000.0, 0.0, 0.7), steered=24, more={24: Perf(2900.0, 0.5, 0.97)})
    sim.run_until(lambda: bool(sim.rig.records("door.curve.finished")))
    sim.run_for(5)
    started = sim.rig.last("door.curve.started")
    assert started["caps"] == [16, 24], started
    assert started["trigger"].endswith(
        "measured through the door's cap first, against the cap it steers (24)"
    )
    assert door.calls == [("cap", 16), ("cap", 24), ("restore", None)] and sim.engine.cap == 24
    assert sim.rig.last("door.curve.finished")["best"] == 24
    assert not sim.rig.records("trial.started")
