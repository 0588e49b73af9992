"""The status document `/status` serves and `tunerd status` prints, built from what the loop hands over.

Read-only: the main loop calls `build_status` once per step with its own objects; the HTTP threads only
read the document it returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tunerd import __version__
from tunerd.config import Config
from tunerd.config.objective import in_force
from tunerd.config.rules import Rule
from tunerd.core.params import EngineParams
from tunerd.core.slo_estimate import HistogramEstimate
from tunerd.policy.rules import RuleState
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.tuner import Tuner


@dataclass(frozen=True)
class DaemonFacts:
    """What the status says about the daemon itself."""

    pid: int
    uptime_s: float
    config: str
    journal: str
    journal_error: str | None


def build_status(
    daemon: DaemonFacts,
    life: Lifecycle,
    params_in_force: EngineParams,
    signals: Mapping[str, float | None],
    units: Mapping[str, str],
    last_record: dict[str, Any] | None,
    now: float,
) -> dict[str, Any]:
    """A JSON-ready snapshot of the daemon, the engine and the signals."""
    run = life.engine.run
    pending = life.pending
    dstate = life.dstate
    return {
        "daemon": {
            "version": __version__,
            "pid": daemon.pid,
            "uptime_s": round(daemon.uptime_s, 1),
            "config": daemon.config,
            "journal": daemon.journal,
            "journal_error": daemon.journal_error,
        },
        "engine": {
            "state": life.engine.state.name,
            "status": life.status_line(),
            "pid": run.pid if run else None,
            "uptime_s": round(run.uptime(now), 1) if run and run.ready_mono else None,
            "params": params_in_force.as_dict(),
            "known_good": life.known_good.as_dict() if life.known_good else None,
            "known_good_verified": dstate.known_good_verified,
            "kv_cache_tokens": run.kv_cache.tokens if run and run.kv_cache else None,
            "log": str(run.log_path) if run else None,
            "consecutive_failures": life.failures,
            "fatal_reason": life.fatal_reason,
            "waiting_reason": life.waiting_reason,
            "next_start_in_s": round(max(0.0, pending.not_before - now), 1) if pending else None,
            "restarts": dict(life.restarts),
            "notes": dict(life.notes),
            "identity": dstate.identity,
            "memory_baseline": dstate.baseline,
        },
        "last_journal": last_record,
        "signals": {name: {"value": value, "unit": units.get(name, "")} for name, value in signals.items()},
    }


def objective_status(
    config: Config, signals: Mapping[str, float | None], estimate: HistogramEstimate | None = None
) -> dict[str, Any]:
    """The objective part of the status document: what is configured, what is in force and why, and
    the window's attainment and goodput beside throughput (`tunerd status`). `estimate`: attainment
    bounds from vLLM's histograms over the window (core/slo_estimate.py), shown as `histograms`
    (None without targets or requests)."""
    objective = config.objective
    applies = in_force(objective, config.door.enabled)
    attainment = signals.get("slo.attainment")
    feasible = None if attainment is None else attainment >= objective.attainment
    return {
        "kind": objective.kind,
        "in_force": applies.kind,
        "name": applies.name,
        "why": applies.reason or None,
        "trials_compare": applies.name,  # what a trial's verdict compares: the objective in force
        "targets": {"ttft_s": objective.ttft_s, "tpot_s": objective.tpot_s, "e2e_s": objective.e2e_s},
        "attainment_target": objective.attainment,
        "count": objective.count,
        "feasible": feasible,
        "histograms": None if estimate is None else estimate.as_dict(),
        "window": {
            name: signals.get(name)
            for name in (
                "slo.attainment",
                "slo.attainment.ttft",
                "slo.attainment.tpot",
                "slo.attainment.e2e",
                "slo.goodput",
                "slo.requests",
                "throughput.generation",
                "door.ttft.p50",
                "door.ttft.p95",
                "door.tpot.p50",
                "door.tpot.p95",
                "door.wait.p95",
                "door.waiting",
            )
        },
    }


def tuning_status(tuner: Tuner, now: float) -> dict[str, Any]:
    """The tuning part of the status document (`tunerd status`, `tunerd rules`)."""
    left = tuner.memory.budget()
    trial = tuner.trial
    wall = tuner.memory.wall()
    return {
        "mode": tuner.config.tuning.mode,
        "paused": tuner.paused,
        "trial": None
        if trial is None
        else {
            **trial.describe(),
            "phase": trial.phase.name.lower(),
            "phase_s": round(now - trial.phase_since, 1),
        },
        "budget": {"hour_left": left.hour_left, "day_left": left.day_left},
        "baseline": tuner.memory.baseline,
        "baseline_why": tuner.memory.state.baseline_why if tuner.memory.baseline else None,
        "exploration": tuner.explorer.status(now) if tuner.explorer is not None else None,
        "probe": _probe_view(tuner, now),
        "noise": tuner.noise(now),  # the objective's noise for the configuration in force, and the MDE
        "tabu": [e.model_dump() for e in tuner.memory.state.tabu if e.until > wall],
        "rules": [_rule_view(tuner, rule, now) for rule in tuner.rules],
        "fleet": _fleet_view(tuner),
    }


def _fleet_view(tuner: Tuner) -> dict[str, Any] | None:
    """The shared tuning memory: its database (password redacted), whether it is reachable, what the
    snapshot holds, what waits to be sent. None: this box tunes alone."""
    fleet = tuner.fleet
    if fleet is None:
        return None
    return {
        "url": fleet.url,
        "host": fleet.host,
        "reachable": fleet.unreachable is None,
        "unreachable": fleet.unreachable,
        "schema": fleet.schema,
        "snapshot_entries": len(fleet.snapshot),
        "unsent": len(fleet.unsent()),
    }


def _probe_view(tuner: Tuner, now: float) -> dict[str, Any] | None:
    """The last probe's figures and age, and whether one runs now."""
    prober = tuner.prober
    if prober is None:
        return None
    last = prober.last
    return {
        "running": prober.running is not None,
        "last": last.as_dict() if last is not None else None,
        "age_s": round(now - prober.last_at, 1) if prober.last_at is not None else None,
    }


def _rule_view(tuner: Tuner, rule: Rule, now: float) -> dict[str, Any]:
    state = tuner.states.get(rule.name, RuleState())
    mute = tuner.memory.muted(rule.name)
    return {
        "name": rule.name,
        "action": rule.action.model_dump(),
        "terms": [t.as_dict() for t in state.last],
        "holding_s": None if state.holding_since is None else round(now - state.holding_since, 1),
        "for_s": rule.for_s,
        "cooldown_left_s": max(0.0, round(state.cooldown_until - now, 1)) if state.last_fired else 0.0,
        "last_fired_s_ago": None if state.last_fired is None else round(now - state.last_fired, 1),
        "firing": state.firing,
        "muted_left_s": round(mute[0], 1) if mute else None,
        "muted_why": mute[1] if mute else None,
        "losses": tuner.memory.state.losses.get(rule.name, 0),
    }
