"""The probe's scheduling, exploration and the tuning memory in-process: a real Lifecycle, Tuner, Prober
and Explorer over fake processes and a fake clock. The probe's figures come from a synthetic landscape
of the max_num_seqs in force (a peak at 8), so each story runs in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fakes import make_rig, record_phases
from tests.unit.test_tuner import KV_RULE, LANDSCAPE, Perf, SimEngine, TunerRig, _wall
from tunerd.commands import Commands
from tunerd.config import ProbeConfig
from tunerd.config.rules import parse_rules
from tunerd.core.commands import Command
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.engine.admin import CacheResetResult
from tunerd.observe.probe import ProbeResult
from tunerd.observe.signals import SignalWindow
from tunerd.records.experience import Experience, ExperienceKey, experience_path, workload_key
from tunerd.records.state import DaemonState
from tunerd.supervise.cache_reset import CacheReset
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.preflight import run_here
from tunerd.tune.experiment import Phase
from tunerd.tune.prober import Prober
from tunerd.tune.recall import Recall
from tunerd.tune.tuner import Tuner

IDENTITY = {
    "vllm_version": "0.32.0",
    "model": {"path": "/models/tiny", "fingerprint": "2bf7696420e6144d"},
    "driver_version": None,
    "cuda_version": None,
    "gpu_name": None,
}
PROBE_KEY = ExperienceKey("2bf7696420e6144d", "cpu", "0.32.0", "prompt~128 output~128 concurrency~4")


def peak_at_8(seqs: int) -> float:
    """Probe tokens/s: unimodal in log2(max_num_seqs), 1200 at 8; 4 and 16 give 935, 6 and 11 ~1150
    (within the tolerance of 8's), 32 gives 441."""
    return 1200.0 * math.exp(-((math.log2(seqs) - 3) ** 2) / 4)


class Landscape(dict[int, Perf]):
    """The live /metrics of any max_num_seqs (the rules stay quiet: no rule is loaded here)."""

    def __missing__(self, seqs: int) -> Perf:
        return Perf(peak_at_8(seqs), 0.0, 0.5)


@dataclass
class ProbeSim:
    """Stands in for observe.probe.run_probe: figures from the landscape of the run probed."""

    sim: ExploreRig | None = None
    wedged: bool = False
    calls: int = 0
    ttft_per_seq_s: float | None = None  # TTFT p95 = this × max_num_seqs (a queue that grows with it)
    lucky: dict[int, list[float]] = field(default_factory=dict)  # the next probes' factors, per max_num_seqs

    def __call__(self, run_id: int, base_url: str, model: str, cfg: ProbeConfig, **_: Any) -> ProbeResult:
        self.calls += 1
        assert self.sim is not None
        run = self.sim.rig.lifecycle.engine.run
        assert run is not None and run.run_id == run_id
        tokens = 0 if self.wedged else cfg.requests * cfg.max_tokens
        seqs = run.params.max_num_seqs or 256
        factors = self.lucky.get(seqs)
        rate = peak_at_8(seqs) * (factors.pop(0) if factors else 1.0) if tokens else None
        seconds = tokens / rate if rate else cfg.timeout_s
        errors = tuple("timeout" for _ in range(cfg.requests)) if self.wedged else ()
        ttft_p95 = 0.08 if self.ttft_per_seq_s is None else self.ttft_per_seq_s * seqs
        return ProbeResult(
            run_id, self.calls, "2026-12-01T12:00:00Z", seconds, cfg.requests, cfg.requests - len(errors),
            errors, tokens, rate, 0.05, ttft_p95, 0.01, 0.012, cfg.prompt_tokens, cfg.max_tokens,
            cfg.concurrency,
        )  # fmt: skip


@dataclass
class ExploreRig(TunerRig):
    prober: Prober | None = None
    probe: ProbeSim | None = None
    fail_starts: frozenset[int] = frozenset()  # max_num_seqs values whose start fails

    def tick(self, seconds: float = 1.0) -> None:
        assert self.prober is not None
        self.prober.step(self.rig.now)  # the loop's order: a finished probe's callbacks may restart
        life = self.rig.lifecycle
        run = life.engine.run
        starting = life.engine.state is EngineState.STARTING and run is not None
        if starting and run.params.max_num_seqs in self.fail_starts and self.rig.os.alive(run.pid):
            self.rig.os.exit(run.pid, 1)  # its start fails: vLLM exits by itself
        pending = life.pending.params if life.pending is not None else run.params if run else None
        self.answer_health = pending is None or pending.max_num_seqs not in self.fail_starts
        super().tick(seconds)

    def explored(self) -> list[dict[str, Any]]:
        return self.rig.records("explore.finished")

    def explore(self, *names: str) -> dict[str, Any]:
        done = len(self.explored())
        assert self.tuner.explore(list(names), "test") is None
        self.run_until(lambda: len(self.explored()) > done)
        return self.explored()[-1]


def make_explorer(
    tmp_path: Path,
    *,
    seqs: int = 32,
    memory: Experience | None = None,
    live: dict[int, Perf] | None = None,
    rules: list[dict[str, Any]] | None = None,
    **tuning: Any,
) -> ExploreRig:
    overrides: dict[str, Any] = {
        "engine": {"params": {"max_num_seqs": seqs}},
        "observe": {"window_s": 20.0},
        "tuning": {"warmup_s": 5.0, "window_s": 30.0, "min_serving_s": 0.0, "restarts_per_hour": 100,
                   "restarts_per_day": 100, "bounds": {"max_num_seqs": [1, 64]}, **tuning},
        "probe": {"interval_s": 0, "requests": 8, "concurrency": 4},
        "backoff": {"known_good_after_s": 5.0},
    }  # fmt: skip
    rig = make_rig(tmp_path, overrides, dstate=DaemonState())
    rig.lifecycle.capacity.check = lambda params: PlanOutcome(None, {"band": "fine"})  # type: ignore[method-assign]
    experience = memory or Experience(experience_path(rig.config.paths.state_dir))
    recall = Recall(experience, rig.lifecycle, lambda: rig.config, recorder=rig.recorder,
                    wallclock=lambda: _wall(rig))  # fmt: skip
    probe = ProbeSim()
    prober = Prober(rig.config, rig.lifecycle, recorder=rig.recorder, submit=run_here, vocab=lambda: 1000,
                    monotonic=rig.clock, recall=recall, run=probe)  # fmt: skip
    ruleset = parse_rules({"rule": rules}) if rules else None
    tuner = Tuner(
        rig.config, ruleset, rig.lifecycle, recorder=rig.recorder, dstate=rig.dstate,
        save_state=rig.lifecycle.save_state, metrics=rig.metrics, submit=run_here,
        wallclock=lambda: _wall(rig), prober=prober, recall=recall,
    )  # fmt: skip
    rig.on_change = tuner.on_change  # the loop delivers a change's outcome to the tuner
    sim = ExploreRig(
        rig,
        tuner,
        SimEngine(live if live is not None else Landscape()),
        SignalWindow(20.0),
        prober=prober,
        probe=probe,
    )
    probe.sim = sim
    rig.serve()
    rig.dstate.identity = dict(IDENTITY)  # what the identity job finds once vLLM serves
    tuner.on_identity()
    sim.run_for(10)
    return sim


# -- exploration -----------------------------------------------------------------------------------------


def test_an_exploration_finds_the_peak_and_makes_it_last_known_good(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    finished = sim.explore("max_num_seqs")
    started = sim.rig.last("explore.started")
    assert started["ladders"]["max_num_seqs"] == [1, 2, 4, 8, 16, 32, 64]
    assert started["objective"] == pytest.approx(peak_at_8(32))  # the mean of its probes
    assert started["baseline_probes"] == pytest.approx([peak_at_8(32)] * 3)  # tuning.explore_probes
    assert started["objective_source"] == "probe"  # 24 clients do not saturate max_num_seqs 32
    assert finished["best"] == {"max_num_seqs": 8} and finished["reason"] == "done"
    assert sim.params().max_num_seqs == 8 and sim.rig.lifecycle.known_good == sim.params()
    points = [(p["value"], p["objective"]) for p in sim.rig.records("explore.point")]
    # Two rungs a step: up from 32 (64, the ladder's end: worse), down (8: better), past the peak (2);
    # then one rung each side of 8 (16, 4: worse). The parabola through 4, 8 and 16 peaks at 8: its
    # midpoints (11, 6) are not expected better by the tolerance, so no restart goes to them.
    assert [v for v, _ in points] == [64, 8, 2, 16, 4]
    # One restart per point and one to go back to the best: fewer than a sweep of the 7 ladder values,
    # and within the plan's bound.
    trial_intents = [i for i in sim.rig.intents("trial") if i["trial"] == started["explore"]]
    assert finished["restarts"] == len(trial_intents) == len(points) + 1 == 6
    assert finished["restarts"] <= started["at_most_restarts"]
    assert sim.tuner.exploring is False and not sim.rig.lifecycle.slot.in_flight


class PeakAt4(dict[int, Perf]):
    """Live traffic's landscape with its peak at 4, where the probe's (peak_at_8) is at 8."""

    def __missing__(self, seqs: int) -> Perf:
        return Perf(1200.0 * math.exp(-((math.log2(seqs) - 2) ** 2) / 4), 0.0, 0.5)


def test_under_saturating_live_traffic_the_live_window_scores_the_points(tmp_path: Path) -> None:
    # 24 clients against max_num_seqs 16: requests wait, the engine is saturated; its capacity is what
    # the live window measures, and the probe's 8 requests only their share of it.
    sim = make_explorer(tmp_path, seqs=16, live=PeakAt4())
    finished = sim.explore("max_num_seqs")
    started = sim.rig.last("explore.started")
    assert started["objective_source"] == "live" and started["live"]["saturated"]
    assert finished["best"] == {"max_num_seqs": 4}  # the probe alone would have chosen 8
    points = sim.rig.records("explore.point")
    assert {p["objective_source"] for p in points} == {"live"}
    four = next(p for p in points if p["value"] == 4)
    # Its value is the mean of its measurements, each a live window of its own (the last one journaled).
    assert four["objective"] == pytest.approx(sum(four["samples"]) / len(four["samples"]))
    assert four["samples"][-1] == pytest.approx(four["live"]["throughput"]["median"], rel=0.01)
    assert four["probe"]["throughput"] == pytest.approx(peak_at_8(4))  # what the probe alone saw
    # A point is scored on a window as long as a trial's evidence, not on the probe's few seconds.
    assert all(p["live"]["seconds"] >= 0.9 * sim.rig.config.tuning.window_s for p in points)


def test_live_traffic_is_read_after_tunerds_last_probe_not_over_it(tmp_path: Path) -> None:
    # The window that decides what scores the points reaches back no further than the last probe before
    # the exploration: its requests are tunerd's, not live traffic (CI: a second exploration began 7 s
    # after the first one's baseline probe, read that probe's saturated window as "live", and re-measured
    # a point the memory knew). Here the saturating live load is real, but the window left after the probe
    # is too short to tell: the probe scores, as it does without a window.
    sim = make_explorer(tmp_path, seqs=16, live=PeakAt4())
    sim.run_for(40)  # a whole tuning window of saturated live traffic
    assert sim.prober is not None
    sim.prober.request("the operator", lambda result, why: None)
    sim.tick()
    sim.explore("max_num_seqs")
    started = sim.rig.last("explore.started")
    assert started["objective_source"] == "probe" and started["live"] is None


def test_points_are_not_promoted_while_the_exploration_runs(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path, warmup_s=10.0)
    before = sim.rig.lifecycle.known_good
    assert sim.tuner.explore(["max_num_seqs"], "test") is None
    served_long = False
    while sim.tuner.exploring:  # points serve past known_good_after_s (5 s) between restarts
        sim.tick()
        run = sim.rig.lifecycle.engine.run
        served_long |= run is not None and run.uptime(sim.now) > 5.0 and run.params != before
        if sim.tuner.exploring:
            assert sim.rig.lifecycle.known_good == before
    assert served_long
    assert sim.rig.lifecycle.known_good.max_num_seqs == 8  # promoted once, at the end


def test_a_second_exploration_under_the_same_load_spends_fewer_restarts(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    first = sim.explore("max_num_seqs")
    second = sim.explore("max_num_seqs")
    assert first["restarts"] == 6
    assert second["restarts"] == 0 and second["best"] == {"max_num_seqs": 8}
    assert sim.rig.last("explore.started")["known_points"] >= 6  # every point the first one measured
    assert sim.params().max_num_seqs == 8


def test_a_new_deployment_with_the_memory_skips_what_it_knows(tmp_path: Path) -> None:
    first = make_explorer(tmp_path / "a")
    first.explore("max_num_seqs")
    exported = tmp_path / "memory.json"
    first.tuner.recall.experience.export(exported)  # type: ignore[union-attr]
    # Another box of the same kind, the same model: the memory imported, a fresh state file.
    memory = Experience(tmp_path / "b-memory.json")
    assert memory.import_(exported).added > 0
    second = make_explorer(tmp_path / "b", memory=memory)
    consulted = second.rig.last("memory.consulted")
    assert consulted["best_known"] == {"max_num_seqs": 8}
    # The best known configuration is the first proposal: tried against the one in force, and kept.
    second.run_until(lambda: bool(second.explored()))
    point = second.rig.last("explore.point")
    assert point["kept"] is True and point["objective"] > point["objective_before"]
    assert second.params().max_num_seqs == 8 and second.rig.lifecycle.known_good == second.params()
    assert second.explored()[-1]["restarts"] == 1


def test_a_recalled_configuration_that_loses_is_reverted_and_goes_tabu(tmp_path: Path) -> None:
    memory = Experience(tmp_path / "memory.json")
    # Measured elsewhere as best; here 64 is far worse than the 8 in force.
    memory.record(
        PROBE_KEY, {"max_num_seqs": 64}, 5000.0, kind="probe", decision="measured", figures={}, at=1.0
    )
    sim = make_explorer(tmp_path, seqs=8, memory=memory)
    sim.run_until(lambda: bool(sim.explored()))
    assert sim.rig.last("explore.point")["kept"] is False
    assert sim.rig.intents()[-1]["action"] == "revert"
    assert sim.params().max_num_seqs == 8
    assert ("max_num_seqs", 64) in {(e.param, e.value) for e in sim.rig.dstate.tuning.tabu}


def test_a_point_whose_start_fails_is_infeasible_tabu_and_the_search_goes_on(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    sim.fail_starts = frozenset({16})
    finished = sim.explore("max_num_seqs")
    failed = [p for p in sim.rig.records("explore.point") if p["value"] == 16]
    assert failed and failed[0]["objective"] is None and "failure" in failed[0]["probe"]
    assert [i["action"] for i in sim.rig.intents()].count("revert") == 1  # back to 8 at once
    assert ("max_num_seqs", 16) in {(e.param, e.value) for e in sim.rig.dstate.tuning.tabu}
    # 64, 8 (better), 2; one rung from 8: 16 failed, 4; the midpoint towards the failed 16 (11), where
    # feasibility ends, is still measured — and is no better than 8.
    assert [p["value"] for p in sim.rig.records("explore.point")] == [64, 8, 2, 16, 4, 11]
    assert finished["best"] == {"max_num_seqs": 8} and sim.params().max_num_seqs == 8
    bad = {(p, v) for p, v, _ in sim.tuner.recall.bad_values()}  # type: ignore[union-attr]
    assert ("max_num_seqs", 16) in bad  # the memory knows it for the next start


def test_every_phase_an_exploration_takes_goes_through_the_experiment_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search with a failed point: its phases are a walk of tune/experiment.py's table."""
    seen = record_phases(monkeypatch)
    sim = make_explorer(tmp_path)
    sim.fail_starts = frozenset({16})
    sim.explore("max_num_seqs")
    p = Phase
    assert seen[0] == (p.NONE, p.BASELINE) and seen[-1][1] is p.NONE
    assert all(new is old_next for (_, new), (old_next, _) in pairwise(seen))
    # the point at 16 failed to start: reverted, then the search goes on with the next point
    assert (p.APPLYING, p.REVERTING) in seen and (p.REVERTING, p.PLANNING) in seen
    assert seen[-1] == (p.FINISHING, p.NONE)  # the last point measured (11) is not the best (8): back to it


def test_from_a_start_over_the_latency_limit_the_search_walks_to_the_limit_and_past_it(
    tmp_path: Path,
) -> None:
    # bench/tuner_vs_sweep.py, seed 1: vLLM's defaults broke the TTFT limit, so did every neighbour, and
    # an exploration with nothing feasible to rank stood still at the defaults.
    sim = make_explorer(tmp_path, ttft_p95_max_s=0.5)
    assert sim.probe is not None
    sim.probe.ttft_per_seq_s = 0.1  # 32 → 3.2 s: 6.4× the limit; only 4 and below meet it
    finished = sim.explore("max_num_seqs")
    started = sim.rig.last("explore.started")
    assert started["objective"] is None and started["limit_excess"] == pytest.approx(6.4)
    points = [(p["value"], p["objective"], p["limit_excess"]) for p in sim.rig.records("explore.point")]
    # 64 (breaks it more), 8 (less: moved), 2 (meets it: moved), 1 (worse), 4 (better: moved), and the
    # midpoint towards 8, where the limit breaks (6: breaks it).
    assert [v for v, _, _ in points] == [64, 8, 2, 1, 4, 6]
    assert points[1][1] is None and points[1][2] == pytest.approx(1.6)
    assert points[4][1] == pytest.approx(peak_at_8(4)) and points[4][2] is None
    assert finished["best"] == {"max_num_seqs": 4} and sim.params().max_num_seqs == 4
    assert finished["objective"] == pytest.approx(peak_at_8(4)) and finished["limit_excess"] is None


def test_ending_at_vllms_default_of_an_unset_parameter_costs_no_restart(tmp_path: Path) -> None:
    # bench/tuner_vs_sweep.py --quick: `explore block_size` measured nothing (the budget was spent) and
    # still restarted vLLM with --block-size 128, the value it ran with the flag unset.
    sim = make_explorer(tmp_path)
    assert sim.params().block_size is None
    sim.rig.lifecycle.capacity.check = lambda params: PlanOutcome("refused", {"band": "never"})  # type: ignore[method-assign]
    finished = sim.explore("block_size")
    # vLLM's default: 16 here, CUDA's (the fake run has no plan, so no backend says otherwise).
    assert finished["best"] == {"block_size": 16} and finished["restarts"] == 0
    assert not sim.rig.intents("trial") and sim.params().block_size is None


def test_known_bad_values_start_on_the_tabu_list_and_old_versions_become_hints(tmp_path: Path) -> None:
    memory = Experience(tmp_path / "memory.json")
    figures = {"param": "max_num_seqs", "reason": "its start failed"}
    memory.record(
        PROBE_KEY, {"max_num_seqs": 16}, None, kind="explore", decision="failed", figures=figures, at=1.0
    )
    old = ExperienceKey(PROBE_KEY.model, PROBE_KEY.hardware, "0.31.0", PROBE_KEY.workload)
    memory.record(old, {"max_num_seqs": 4}, 900.0, kind="probe", decision="measured", figures={}, at=1.0)
    sim = make_explorer(tmp_path, seqs=8, memory=memory)
    assert ("max_num_seqs", 16) in {(e.param, e.value) for e in sim.rig.dstate.tuning.tabu}
    assert sim.rig.last("memory.consulted")["tabu"][0]["value"] == 16
    assert sim.rig.last("memory.unverified")["entries"] == 1
    stale = [e for e in memory.entries() if e.key.vllm == "0.31.0"]
    assert stale and not stale[0].verified


def test_an_exploration_refused_while_paused_or_off(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    sim.tuner.pause()
    assert sim.tuner.explore(["max_num_seqs"], "test") == "tuning is paused (tunerd resume)"
    sim.tuner.resume()
    assert sim.tuner.explore(["max_num_seqs"], "test") is None
    assert sim.tuner.explore(["max_num_seqs"], "test") == "an exploration is running"


# -- the probe's schedule ----------------------------------------------------------------------------------


def test_the_periodic_probe_is_skipped_while_busy_and_during_an_exploration(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    prober = sim.prober
    assert prober is not None and sim.probe is not None
    calls = sim.probe.calls
    prober.due("periodic", busy=3.0)
    assert "3 requests running" in sim.rig.last("probe.skipped")["reason"]
    assert sim.probe.calls == calls
    prober.due("periodic", busy=0.0)
    prober.step(sim.now)
    assert sim.rig.last("probe.result")["trigger"] == "periodic" and sim.probe.calls == calls + 1
    assert prober.signals(sim.now)["probe.throughput"] == peak_at_8(32)
    assert sim.tuner.explore(["max_num_seqs"], "test") is None
    sim.run_until(lambda: sim.rig.lifecycle.slot.current is not None)
    prober.due("periodic", busy=0.0)
    assert sim.rig.last("probe.skipped")["reason"] == "a trial or an exploration is running"


def test_a_trials_before_window_holds_no_probe_and_the_first_baseline_probe_waits_for_quiet(
    tmp_path: Path,
) -> None:
    # 24 clients on max_num_seqs 16: the KV rule holds. A probe's requests inside the before window
    # would change the offered load it compares (a real trial was made inconclusive that way).
    sim = make_explorer(tmp_path, seqs=16, live=LANDSCAPE, rules=[{**KV_RULE, "cooldown_s": 3600}])
    sim.run_for(30)  # settled; the rule holds and fires a few seconds from now
    assert sim.prober is not None
    sim.prober.request("the operator", lambda result, why: None)
    sim.tick()
    probe_ended = sim.now
    sim.run_until(lambda: bool(sim.rig.records("trial.started")))
    deferred = sim.rig.last("rule.deferred")
    assert "a probe ran" in deferred["reason"] and "live traffic only" in deferred["reason"]
    # Held until the probe left the before window, not a cooldown (an hour) later.
    waited = sim.now - probe_ended
    assert sim.rig.config.tuning.window_s <= waited < sim.rig.config.tuning.window_s + 5
    # The first start's probe baseline was not taken under this load: it waits, said once.
    waits = [r for r in sim.rig.records("probe.skipped") if "baseline probe waits" in r["reason"]]
    assert len(waits) == 1
    assert not [r for r in sim.rig.records("probe.result") if r["trigger"].startswith("baseline")]


def test_a_revert_rule_with_nothing_to_revert_alerts_at_once_even_right_after_a_probe(tmp_path: Path) -> None:
    # A probe rule fires right after its probe; the probe-free before window only matters to a trial.
    revert = {**KV_RULE, "name": "revert-under-pressure", "action": {"kind": "revert"}}
    sim = make_explorer(tmp_path, seqs=16, live=LANDSCAPE, rules=[revert])
    sim.run_for(30)
    assert sim.prober is not None
    sim.prober.request("the operator", lambda result, why: None)
    sim.tick()
    sim.run_until(lambda: bool(sim.rig.records("rule.alert")))
    assert "no kept change" in sim.rig.last("rule.alert")["reason"]
    assert not sim.rig.records("rule.deferred") and not sim.rig.records("trial.started")


def test_a_probe_without_tokens_from_a_healthy_engine_is_a_wedge_and_restarts_it(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    assert sim.prober is not None and sim.probe is not None
    old = sim.rig.run
    sim.probe.wedged = True
    sim.prober.due("periodic", busy=0.0)
    sim.prober.step(sim.now)
    wedged = sim.rig.last("guard.wedged")
    assert "no token" in wedged["reason"] and wedged["pid"] == old.pid
    sim.probe.wedged = False
    sim.run_until(lambda: sim.rig.lifecycle.engine.run is not old and sim.rig.state is EngineState.RUNNING)
    assert not sim.rig.os.alive(old.pid)


# -- the off-peak cache reset --------------------------------------------------------------------------------


def test_the_cache_reset_runs_only_idle_in_dev_mode_on_loopback(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    resets: list[str] = []

    def reset(base_url: str, **_: Any) -> CacheResetResult:
        resets.append(base_url)
        return CacheResetResult(True, 3, 'HTTP 200 {"success": true}', 0.5)

    cache = CacheReset(
        sim.rig.config, sim.rig.lifecycle, recorder=sim.rig.recorder, submit=run_here, reset=reset
    )
    idle = {"requests.running": 0.0, "requests.waiting": 0.0, "kv_cache.usage": 0.4}
    cache.due(idle)
    assert "VLLM_SERVER_DEV_MODE" in sim.rig.last("cache_reset.skipped")["reason"] and not resets
    cache.config = sim.rig.config.model_copy(
        update={"engine": sim.rig.config.engine.model_copy(update={"env": {"VLLM_SERVER_DEV_MODE": "1"}})}
    )
    cache.due({**idle, "requests.running": 2.0})
    assert sim.rig.last("cache_reset.skipped")["reason"] == "vLLM is not idle" and not resets
    cache.due(idle)
    cache.step({**idle, "kv_cache.usage": 0.0})
    done = sim.rig.last("cache_reset.done")
    assert resets == [sim.rig.run.base_url] and done["attempts"] == 3
    assert done["before"]["kv_cache.usage"] == 0.4 and done["after"]["kv_cache.usage"] == 0.0
    assert done["trigger"] == "cron"


def test_tunerd_cache_reset_runs_the_same_reset_now_with_the_same_checks(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    resets: list[str] = []

    def reset(base_url: str, **kwargs: Any) -> CacheResetResult:
        resets.append(base_url)
        assert kwargs == {"retries": 5, "retry_after_s": 10.0}  # [cache_reset]'s, as the cron's
        return CacheResetResult(True, 2, 'HTTP 200 {"success": true}', 0.5)

    cache = CacheReset(
        sim.rig.config, sim.rig.lifecycle, recorder=sim.rig.recorder, submit=run_here, reset=reset
    )
    signals = {"requests.running": 1.0, "requests.waiting": 0.0, "kv_cache.usage": 0.4}
    commands = Commands(
        sim.rig.lifecycle, sim.tuner, sim.prober, lambda: None, recorder=sim.rig.recorder, submit=run_here,
        cache_reset=lambda trigger: cache.due(signals, trigger),
    )  # fmt: skip
    commands.run(Command("cache-reset", reason="operator token 1"))  # no dev mode (and no cron at all)
    skipped = sim.rig.last("cache_reset.skipped")
    assert "VLLM_SERVER_DEV_MODE" in skipped["reason"] and skipped["trigger"] == "operator token 1"
    cache.config = sim.rig.config.model_copy(
        update={"engine": sim.rig.config.engine.model_copy(update={"env": {"VLLM_SERVER_DEV_MODE": "1"}})}
    )
    commands.run(Command("cache-reset", reason="operator token 2"))  # a request running: not idle
    skipped = sim.rig.last("cache_reset.skipped")
    assert (skipped["reason"], skipped["trigger"]) == ("vLLM is not idle", "operator token 2") and not resets
    signals["requests.running"] = 0.0
    commands.run(Command("cache-reset", reason="operator token 3"))
    cache.step(signals)
    done = sim.rig.last("cache_reset.done")
    assert resets == [sim.rig.run.base_url] and (done["attempts"], done["trigger"]) == (2, "operator token 3")


def test_a_maintenance_window_starts_one_exploration_per_opening(tmp_path: Path) -> None:
    from datetime import timedelta

    probe = make_explorer(tmp_path / "probe")
    opens = (_wall(probe.rig) + timedelta(seconds=120)).astimezone()  # local time, as the cron is read
    window = {"cron": f"{opens.minute} {opens.hour} * * *", "duration_s": 1800}
    sim = make_explorer(tmp_path / "sim", maintenance=[window], explore_in_windows=["max_num_seqs"])
    assert not sim.rig.records("explore.started")  # before the window: nothing
    sim.run_until(lambda: bool(sim.explored()))
    started = sim.rig.last("explore.started")
    assert started["trigger"] == "a maintenance window opened"
    assert sim.explored()[-1]["best"] == {"max_num_seqs": 8}
    sim.run_for(600)  # still inside the same window
    assert len(sim.rig.records("explore.started")) == 1


def test_a_point_the_planner_refuses_costs_no_restart(tmp_path: Path) -> None:
    sim = make_explorer(tmp_path)
    sim.rig.lifecycle.capacity.check = lambda params: (  # type: ignore[method-assign]
        PlanOutcome("oversubscription 2.10", {"band": "never"})
        if params.max_num_seqs == 64
        else PlanOutcome(None, {"band": "fine"})
    )
    finished = sim.explore("max_num_seqs")
    refused = [p for p in sim.rig.records("explore.point") if p["value"] == 64]
    assert refused and refused[0]["objective"] is None and refused[0]["probe"]["refused"]
    trial_intents = [i["params"]["max_num_seqs"] for i in sim.rig.intents("trial")]
    assert 64 not in trial_intents and finished["restarts"] == len(trial_intents) == 5
    assert ("max_num_seqs", 64) in {(e.param, e.value) for e in sim.rig.dstate.tuning.tabu}


def test_points_scored_on_live_traffic_are_filed_under_the_live_load_not_the_probes(tmp_path: Path) -> None:
    # Issue 20: a point scored on the live window (live traffic's tok/s) was filed under the probe's
    # workload key, beside the probe's own tok/s of another load: a later search, or a recall, compared
    # the two as one figure.
    sim = make_explorer(tmp_path, seqs=16, live=PeakAt4())
    sim.explore("max_num_seqs")
    live = sim.rig.last("explore.started")["live"]
    live_load = workload_key(
        live["prompt_tokens_per_request"],
        live["generation_tokens_per_request"],
        live["running_avg"] + live["waiting_avg"],
    )
    assert live_load != PROBE_KEY.workload
    memory = sim.tuner.recall.experience  # type: ignore[union-attr]
    points = [e for e in memory.entries() if e.kind == "explore"]
    assert points and {e.objective_source for e in points} == {"live"}
    assert {e.key.workload for e in points} == {live_load}
    assert {(e.objective_name, e.objective_unit) for e in points} == {("throughput.generation", "tok/s")}
    probes = [e for e in memory.entries() if e.kind == "probe"]
    assert probes and {(e.key, e.objective_source) for e in probes} == {(PROBE_KEY, "probe")}
    # The next live search under the same load knows them: no point is measured again.
    sim.run_for(sim.rig.config.tuning.window_s + 10)  # a live window before it, as before the first
    second = sim.explore("max_num_seqs")
    started = sim.rig.last("explore.started")
    assert started["objective_source"] == "live" and started["known_points"] >= len(points)
    assert second["best"] == {"max_num_seqs": 4} and second["restarts"] == 0


def test_the_planner_is_asked_once_per_point(tmp_path: Path) -> None:
    # Issue 20: a point's planning asked the planner, then its start's preflight asked again for the
    # same parameters. Now a point is asked about once; the restart to the best point (a new start, after
    # the points' calibrations) is asked about by its own preflight.
    sim = make_explorer(tmp_path)
    asked: list[int | None] = []

    def check(params: EngineParams) -> PlanOutcome:
        asked.append(params.max_num_seqs)
        return PlanOutcome(None, {"band": "fine"})

    sim.rig.lifecycle.capacity.check = check  # type: ignore[method-assign]
    finished = sim.explore("max_num_seqs")
    points = [p["value"] for p in sim.rig.records("explore.point")]
    assert finished["best"] == {"max_num_seqs": 8} and points == [64, 8, 2, 16, 4]
    assert asked == [*points, 8]


def test_a_point_that_looks_better_on_one_probe_is_probed_again_before_the_search_moves(
    tmp_path: Path,
) -> None:
    # Issue 22: the explorer moved on one window's noise. 64's first probe reads 4× (504 tok/s against
    # the 441 of 32 in force): it is probed again in the same start (no restart), reads 126, and the
    # search does not move there.
    sim = make_explorer(tmp_path)
    assert sim.probe is not None
    sim.probe.lucky = {64: [4.0]}
    finished = sim.explore("max_num_seqs")
    started = sim.rig.last("explore.started")
    assert started["tolerance_floor"] == 0.03 and started["tolerance"] >= 0.03
    assert started["noise"]["start_noise"] == sim.rig.config.tuning.start_noise
    point = next(p for p in sim.rig.records("explore.point") if p["value"] == 64)
    assert point["verdict"] == "stay" and point["probes"] == 2 == len(point["samples"])
    assert point["samples"] == pytest.approx([4 * peak_at_8(64), peak_at_8(64)])
    assert point["objective"] == pytest.approx(2.5 * peak_at_8(64))  # the mean of its probes
    assert point["tolerance"] >= point["tolerance_floor"] == 0.03 and point["noise"]["probe_spread"] > 0
    assert finished["best"] == {"max_num_seqs": 8}
    moved = next(p for p in sim.rig.records("explore.point") if p["value"] == 8)
    assert moved["verdict"] == "move" and moved["ratio_interval"][0] > 1.03
    # One restart per point, none per probe.
    trial_intents = [i for i in sim.rig.intents("trial") if i["trial"] == started["explore"]]
    assert finished["restarts"] == len(trial_intents) == len(sim.rig.records("explore.point")) + 1
