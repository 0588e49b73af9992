"""The capacity planner where the daemon uses it: the verdict in every start's preflight, and the
calibration from what vLLM reported at each start.

I/O edge of the pure planner (`tunerd.planner`): reads the model directory, probes the machine (NVML, /proc,
the NUMA node vLLM's CPU backend reads), keeps calibrations in the state dir.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunerd.config import Config
from tunerd.core.machine import MachineFacts
from tunerd.core.model import ModelInfo, ModelInfoError
from tunerd.core.params import Backend, EngineParams, backend_problems, sizing_flag
from tunerd.core.report import StartReport
from tunerd.observe.machine_facts import probe_machine
from tunerd.observe.model.directory import load_model_info
from tunerd.planner.calibration import (
    Calibration,
    calibrate,
    calibration_key,
    pick_calibration,
)
from tunerd.planner.checks import preflight_checks
from tunerd.planner.plan import PlanVerdict, assess
from tunerd.planner.report import plan_to_json
from tunerd.records.calibrations import CalibrationFile


@dataclass(frozen=True)
class PlanOutcome:
    """The preflight's view of a plan: a refusal reason (None: start), the figures for the journal."""

    refusal: str | None
    figures: dict[str, Any]
    predicted_kv_tokens: int | None = None
    machine: MachineFacts | None = None  # what the plan was made against
    estimated_max_model_len: int | None = None  # vLLM's own estimate, when it would refuse max_model_len


@dataclass(frozen=True)
class CalibrationDone:
    """Posted by the background calibration after a start: what vLLM reported, what was stored."""

    run_id: int
    figures: dict[str, Any]


# What a `preflight.plan` journal record keeps of `tunerd plan --json` (same names, fewer of them).
_JOURNAL_KEYS = (
    "feasible", "band", "ratio", "backend", "memory_kind", "weights_bytes", "kv_bytes_per_token",
    "kv_cache_tokens", "kv_cache_tokens_range", "max_concurrency", "largest_max_model_len", "calibrated",
    "reasons", "suggested_params",
)  # fmt: skip


def summarize(plan: PlanVerdict) -> dict[str, Any]:
    """The figures an operator needs to understand a verdict, in one journal record: a selection of
    `tunerd plan --json` under the same names."""
    full = plan_to_json(plan)
    figures = {key: full[key] for key in _JOURNAL_KEYS}
    figures["ratio"] = None if plan.ratio is None else round(plan.ratio, 3)
    figures["budget"] = {key: full["budget"][key] for key in ("kv_bytes", "source", "physical_bytes")}
    return figures


class CalibrationStore:
    """Calibrations per model and non-KV-relevant configuration, kept in the state dir.

    Each key (`calibration_key`) keeps its last `keep` starts; `get` combines them, or falls back to the
    newest calibration of the same model and backend (`pick_calibration`).
    """

    def __init__(self, state_dir: str | Path, keep: int = 8) -> None:
        self.file = CalibrationFile(state_dir)
        self.keep = keep

    def get(self, model: ModelInfo, params: EngineParams, backend: Backend) -> Calibration | None:
        """The calibration that applies to this configuration, or None. Never raises."""
        return pick_calibration(self.file.entries(), model, params, backend)

    def put(
        self,
        model: ModelInfo,
        params: EngineParams,
        backend: Backend,
        calibration: Calibration,
        *,
        now: float,
    ) -> None:
        """Keep `calibration` for this configuration (wall time `now`). Raises OSError."""
        key = calibration_key(model, params, backend)
        self.file.append(key, calibration.to_json(), keep=self.keep, now=now)


class Capacity:
    """Answers "does this parameter set fit?" before a start, and learns from each start.

    `check` and `calibrate` run in worker jobs, several of which may run at once (a start's preflight, an
    operator's `restart --set`, a trial's plan, a calibration): one lock serialises them, so the model
    cache, the once-only checks and the calibration file are never read half-written.
    """

    def __init__(self, config: Config, vllm_version: Callable[[], str | None] = lambda: None) -> None:
        self.config = config
        # The version the last start reported (state file); the planner reads vLLM's defaults for it.
        self.vllm_version = vllm_version
        self.store = CalibrationStore(config.paths.state_dir)
        self._model: ModelInfo | None = None
        self._model_key: tuple[str, float, str | None] | None = None
        self._checked = False  # the operator's preflight checks are journaled once, before the first start
        self._lock = threading.Lock()

    def model(self) -> ModelInfo | None:
        """The model's description in the dtype vLLM is told to serve it in (`--dtype` in extra_args: the
        weights and the KV cache follow it), re-read when its config.json changes; None when not a
        readable directory."""
        path = Path(self.config.engine.model)
        dtype = self.config.engine.extra_flag("dtype")
        try:
            key = (str(path), (path / "config.json").stat().st_mtime, dtype)
        except OSError:
            return None
        if key != self._model_key:
            self._model, self._model_key = load_model_info(path, dtype=dtype), key
        return self._model

    def sized(self, params: EngineParams, machine: MachineFacts) -> EngineParams:
        """`params` as tunerd launches them on `machine`: on unified memory always with an explicit
        KV sizing (`core.params.sizing_flag`; the start's command line carries the same value)."""
        cap = self.config.tuning.unified_max_gpu_memory_utilization
        return sizing_flag(params, backend=machine.backend, unified=machine.memory.unified, cap=cap)

    def check(self, params: EngineParams) -> PlanOutcome:
        """The planner's verdict for `params` (see `_check`), one caller at a time."""
        with self._lock:
            return self._check(params)

    def _check(self, params: EngineParams) -> PlanOutcome:
        """The planner's verdict for `params` on this machine now (with the stored calibration), and the
        backend's own constraints on the flags (`core.params.backend_problems`).

        `preflight.planner`: enforce (refusals stop the start), warn (journaled only), off.
        """
        mode = self.config.preflight.planner
        if mode == "off":
            return PlanOutcome(None, {"planner": "off"})
        try:
            model = self.model()
        except ModelInfoError as exc:
            return PlanOutcome(None, {"planner": f"no plan: {exc}"})
        if model is None:
            return PlanOutcome(
                None, {"planner": f"no plan: {self.config.engine.model} is not a model directory here"}
            )
        try:
            machine = probe_machine("auto", proc=self.config.observe.memory_proc)
        except OSError as exc:
            return PlanOutcome(None, {"planner": f"no plan: {exc}"})
        params = self.sized(params, machine)
        calibration = self.store.get(model, params, machine.backend)
        plan = assess(
            model,
            params,
            machine.memory,
            backend=machine.backend,
            calibration=calibration,
            version=self.vllm_version(),
        )
        figures = summarize(plan)
        if not self._checked:
            self._checked = True
            checks = preflight_checks(machine.preflight, plan)
            figures["checks"] = [
                {"check": c.name, "verdict": c.verdict, "detail": c.detail, "remedy": c.remedy}
                for c in checks
            ]
        # A flag the backend rejects (CPU: block size not a multiple of 32) is refused here, before a start
        # that vLLM would end after loading the model (fixture fail_block_size.log).
        problems = backend_problems(params, machine.backend)
        if problems:
            figures["backend_problems"] = problems
        refusals = list(problems)
        if not plan.feasible:
            refusals.append(
                "; ".join(plan.budget.start_refusals)
                or (
                    f"oversubscription {plan.ratio:.2f} is in band {plan.band}"
                    if plan.ratio is not None
                    else plan.band
                )
            )
        refusal = "; ".join(refusals) if refusals and mode == "enforce" else None
        return PlanOutcome(
            refusal,
            figures,
            plan.kv_cache_tokens,
            machine,
            plan.vllm_estimated_max_model_len if refusal and not plan.feasible else None,
        )

    def calibrate(
        self, run_id: int, report: StartReport, params: EngineParams, machine: MachineFacts | None
    ) -> CalibrationDone | None:
        """`_calibrate`, one caller at a time."""
        with self._lock:
            return self._calibrate(run_id, report, params, machine)

    def _calibrate(
        self, run_id: int, report: StartReport, params: EngineParams, machine: MachineFacts | None
    ) -> CalibrationDone | None:
        """Keep what vLLM reported at this start (`report`, gathered from its log as it was read) for the
        next prediction, against the machine the start's plan was made for (probed afresh only when
        there was no plan). Runs in a worker job (model directory, the calibration file). None when the
        report says nothing usable.
        """
        if report.kv_cache_tokens is None and report.estimated_max_model_len is None:
            return None
        try:
            model = self.model()
            if model is None:
                return None
            if machine is None:
                machine = probe_machine("auto", proc=self.config.observe.memory_proc)
            params = self.sized(params, machine)  # what the command line carried
            calibration = calibrate(report, model, params, machine.memory, backend=machine.backend)
            self.store.put(model, params, machine.backend, calibration, now=time.time())
        except (OSError, ModelInfoError, ValueError) as exc:
            return CalibrationDone(run_id, {"error": f"{type(exc).__name__}: {exc}"})
        return CalibrationDone(
            run_id,
            {
                "kv_cache_tokens": report.kv_cache_tokens,
                "non_kv_bytes": calibration.non_kv_bytes,
                "samples": calibration.samples,
                "notes": list(calibration.notes),
            },
        )
