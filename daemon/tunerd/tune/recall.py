"""The tuning memory at work: what the tuner writes into the experience file (records/experience.py)
and what it asks of it — "record every change with its figures; over time the best settings for each
model and load show a pattern".

Written: every probe (kind `probe`), every exploration point (`explore`) and every trial's verdict
(`trial`), with the whole configuration measured, keyed by the model's identity, the hardware, vLLM's
version and the workload's shape of what measured the value: the probe's shape is fixed by `[probe]`,
so probe entries (and exploration points the probe scored) compare across boxes and deployments; an
exploration point scored on live traffic is filed under the live load of the window before the search
(the window that made it a live search), a trial under the live load of its before window. Every value
carries its objective's name and unit and its source (policy/objective.py).

Asked: known-bad values (the tabu list at a start), the points already measured (an exploration skips
them), the best known configuration (the first proposal of a new deployment). Nothing is asked or
written before vLLM's identity is known (the first start's identity job), since the key needs it.

The file is small and written on rare events (a probe, a verdict), on the loop like the state file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import structlog

from tunerd.config import Config
from tunerd.core.params import EngineParams
from tunerd.observe.probe import ProbeResult
from tunerd.policy.evidence import WindowStats
from tunerd.policy.objective import EXPLORE, Objective, Source, objective
from tunerd.policy.tunables import REGISTRY, Value
from tunerd.policy.verdict import Verdict
from tunerd.records.experience import (
    Experience,
    ExperienceKey,
    hardware_key,
    model_key,
    workload_key,
)
from tunerd.records.recorder import Recorder
from tunerd.supervise.lifecycle import Lifecycle

log = structlog.get_logger("tunerd")

PROBE_KINDS = ("probe", "explore")


class Recall:
    def __init__(
        self,
        experience: Experience,
        lifecycle: Lifecycle,
        config: Callable[[], Config],
        *,
        recorder: Recorder,
        wallclock: Callable[[], datetime],
    ) -> None:
        self.experience = experience
        self.life = lifecycle
        self.config = config
        self.rec = recorder
        self.wallclock = wallclock
        if experience.load_error:
            log.warning("memory.unreadable", path=str(experience.path), detail=experience.load_error)

    # -- keys ---------------------------------------------------------------------------------------

    def key(self, workload: str) -> ExperienceKey | None:
        """The key of the engine serving now under `workload`; None before its identity is known."""
        identity = self.life.dstate.identity or {}
        if not identity:
            return None
        run = self.life.engine.run
        machine = run.machine if run is not None else None
        gpu = identity.get("gpu_name")
        if machine is not None:
            memory = machine.memory
            hardware = hardware_key(gpu, memory.gpu_total_bytes, memory.unified, machine.backend)
        else:  # no plan was made for this start (planner off, model not a directory): the GPU's name
            hardware = hardware_key(gpu, None, False, "cuda" if gpu else "cpu")
        model = model_key(identity.get("model") or {})
        return ExperienceKey(model, hardware, identity.get("vllm_version"), workload)

    def probe_key(self) -> ExperienceKey | None:
        probe = self.config().probe
        return self.key(workload_key(probe.prompt_tokens, probe.max_tokens, probe.concurrency))

    def measure_key(self, source: Source, live: WindowStats | None) -> ExperienceKey | None:
        """The key of what measured a value: the live load of `live` for a live value (None without a
        window: nothing to file it under), else the probe's."""
        if source == "live":
            return self.live_key(live) if live is not None else None
        return self.probe_key()

    def live_key(self, window: WindowStats) -> ExperienceKey | None:
        """The key of live traffic's load in `window`. Its concurrency is the requests outstanding
        (running + waiting): what the clients offer. The running ones alone are capped by max_num_seqs
        when the engine is saturated, so each point of a live search would have had a key of its own."""
        outstanding = (window.running_avg or 0) + (window.waiting_avg or 0)
        return self.key(
            workload_key(
                window.prompt_tokens_per_request or 0,
                window.generation_tokens_per_request or 0,
                outstanding,
            )
        )

    # -- writing ------------------------------------------------------------------------------------

    def probe(self, result: ProbeResult, params: EngineParams) -> None:
        """A probe: its value of the exploration's objective (generation throughput), None when a request
        failed."""
        goal = EXPLORE()
        value = goal.of_probe(result.signals()) if not result.errors else None
        decision = "measured" if value is not None else "failed"
        key = self.probe_key()
        self._record(key, params, value, goal, "probe", "probe", decision, result.as_dict())

    def point(
        self,
        params: EngineParams,
        param: str,
        value: float | None,
        figures: Mapping[str, Any],
        *,
        goal: Objective,
        source: Source,
        live: WindowStats | None = None,
    ) -> None:
        """An exploration point: its `value` of `goal` (None = infeasible: its start failed, a limit
        broke), measured by `source`, filed under that source's key (`measure_key`: `live` is the live
        window whose load a live value measured)."""
        decision = "measured" if value is not None else "failed"
        key = self.measure_key(source, live)
        self._record(key, params, value, goal, source, "explore", decision, {**figures, "param": param})

    def trial(
        self,
        params: EngineParams,
        param: str,
        decision: Literal["keep", "revert", "failed"],
        before: WindowStats,
        reason: str,
        verdict: Verdict | None = None,
        *,
        old: Value | None = None,
    ) -> None:
        """A rule's trial under the live load of its `before` window: the `verdict`'s value after the
        change when it was kept (a reverted change is not a configuration to return to), with the
        objective it compared (`Verdict.goal`: goodput's unit is what it counted) and both windows'
        service levels where there are targets (`goodput_unit` names their goodput's); no verdict when
        the start failed. `old`: the value before the change (the shared memory's "old → new")."""
        value = verdict.after if verdict is not None and decision == "keep" else None
        figures: dict[str, Any] = {"param": param, "reason": reason, "old": old}
        goal = None
        if verdict is not None:
            if verdict.goal is not None or verdict.objective:
                goal = verdict.goal or objective(verdict.objective)
                figures["objective_before"] = verdict.before
            if verdict.service.get("attainment_before") is not None:
                figures.update(verdict.service)
            if verdict.objective_reason:
                figures["objective_reason"] = verdict.objective_reason
        if verdict is not None:  # the evidence, in brief: what the shared memory shows of the verdict
            interval = list(verdict.interval) if verdict.interval is not None else None
            figures["evidence"] = {"interval": interval, "inconclusive": verdict.inconclusive}
        self._record(self.live_key(before), params, value, goal, "live", "trial", decision, figures)

    def _record(
        self,
        key: ExperienceKey | None,
        params: EngineParams,
        value: float | None,
        goal: Objective | None,
        source: Source,
        kind: Literal["trial", "probe", "explore"],
        decision: str,
        figures: Mapping[str, Any],
    ) -> None:
        if key is None:
            return
        driver = (self.life.dstate.identity or {}).get("driver_version")
        written = self.experience.record(
            key,
            params.as_dict(),
            value,
            kind=kind,
            decision=decision,
            figures={**figures, "driver": driver},
            at=self.wallclock().timestamp(),
            **(goal.fields() if goal is not None else {}),  # name and unit: tok/s and req/s never mix
            objective_source=source,
        )
        if not written:
            log.warning(
                "memory.unwritable", path=str(self.experience.path), detail=self.experience.save_error
            )

    # -- asking -------------------------------------------------------------------------------------

    def on_identity(self) -> None:
        """vLLM's identity is known (every start): entries of another vLLM or driver become hints."""
        identity = self.life.dstate.identity or {}
        vllm, driver = identity.get("vllm_version"), identity.get("driver_version")
        if vllm is None and driver is None:
            return
        flagged = self.experience.mark_unverified(
            f"measured before an upgrade to vLLM {vllm}, driver {driver}", vllm=vllm, driver=driver
        )
        if flagged:
            self.rec.record("memory.unverified", entries=flagged, vllm=vllm, driver=driver)

    def bad_values(self, window: WindowStats | None = None) -> list[tuple[str, Any, str]]:
        """(param, value, why) known to be bad for this model on this box: under the probe's load, and
        under the live load of `window` when one is given."""
        keys = [self.probe_key(), self.live_key(window) if window is not None else None]
        seen: dict[tuple[str, str], tuple[str, Any, str]] = {}
        for key in keys:
            if key is not None:
                for param, value, why in self.experience.bad_values(key):
                    seen.setdefault((param, repr(value)), (param, value, why))
        return list(seen.values())

    def known(
        self,
        names: Sequence[str],
        params: EngineParams,
        *,
        goal: Objective,
        source: Source,
        live: WindowStats | None = None,
    ) -> dict[tuple[str, Value], float | None]:
        """The points of `names` already measured as a search scoring `goal` by `source` would measure
        them — under that source's load (`measure_key`), values of that objective from that source —
        with every other parameter as in `params`: {(param, value): value, None = infeasible}. For an
        exploration to skip them."""
        key = self.measure_key(source, live)
        if key is None:
            return {}
        current = params.as_dict()
        points: dict[tuple[str, Value], float | None] = {}
        for name in names:
            others = {k: v for k, v in current.items() if k != name}
            measured = self.experience.measured(
                key, name, others, objective=goal.name, source=source, unit=goal.unit, kinds=PROBE_KINDS
            )
            for value, figure in measured.items():
                points[(name, value)] = figure
        return points

    def best_known(self, params: EngineParams) -> tuple[EngineParams, float] | None:
        """The best configuration the probe measured under its load (any vLLM version: a first proposal,
        verified by a trial) with its value of the exploration's objective, when it differs from `params`
        in tunable parameters only."""
        key, goal = self.probe_key(), EXPLORE
        entry = (
            self.experience.best_entry(
                key,
                objective=goal.name,
                maximize=goal.direction == "higher",
                source="probe",
                unit=goal.unit,
                any_vllm=True,
                kinds=PROBE_KINDS,
            )
            if key
            else None
        )
        if entry is None or entry.objective is None:
            return None
        changes = {k: v for k, v in entry.params.items() if k in REGISTRY and getattr(params, k) != v}
        if not changes:
            return None
        try:
            return params.replace(**changes), entry.objective
        except ValueError:  # an entry from an older format or a hand edit: not a configuration to try
            return None
