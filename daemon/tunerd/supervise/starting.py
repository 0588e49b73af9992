"""One start, from the queue to a spawned vLLM: preflight, then spawn (the lifecycle decides the rest).

`Starter.step` is called every loop tick while a start is pending and the engine has no process. It
answers Waiting (the preflight holds the start back: why), Refused (the start fails without a launch:
the preflight's verdict, or the program cannot be executed) or Launched (the run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from tunerd.config import Config
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.machine import GpuFacts
from tunerd.core.params import EngineParams, sizing_flag
from tunerd.engine.launch import (
    access_log_args,
    build_argv,
    build_env,
    drain_args,
    histogram_buckets_args,
    per_request_metrics_args,
)
from tunerd.engine.leftovers import LeftoverReaper
from tunerd.engine.oscalls import OsCalls
from tunerd.engine.process import Engine, EngineRun
from tunerd.policy.corrections import without_flags
from tunerd.policy.guards import MemoryGate
from tunerd.records.recorder import Recorder
from tunerd.records.state import DaemonState, EngineRecord
from tunerd.supervise.capacity import Capacity, PlanOutcome
from tunerd.supervise.preflight import Preflight, Submit, run_here


@dataclass
class PendingStart:
    """A start the loop makes once `not_before` has passed and the preflight clears it."""

    params: EngineParams
    intent: int | None  # the journal intent this start fulfils
    action: str
    not_before: float
    preflight: Preflight | None = None
    plan: PlanOutcome | None = None  # the planner's outcome for `params`, asked before (a change's owner)


@dataclass(frozen=True)
class Waiting:
    reason: str


@dataclass(frozen=True)
class Refused:
    failure: EngineFailure


@dataclass(frozen=True)
class Launched:
    run: EngineRun


StartStep = Waiting | Refused | Launched


class Starter:
    def __init__(
        self,
        config: Config,
        *,
        oscalls: OsCalls,
        engine: Engine,
        recorder: Recorder,
        dstate: DaemonState,
        save_state: Callable[[], None],
        capacity: Capacity,
        gpu: Callable[[], GpuFacts | None],
        wallclock: Callable[[], datetime],
        submit: Submit = run_here,
    ) -> None:
        self.config = config
        self.os = oscalls
        self.engine = engine
        self.rec = recorder
        self.dstate = dstate
        self.save_state = save_state
        self.capacity = capacity
        self.gpu = gpu
        self.wallclock = wallclock
        self.submit = submit
        recorded = dstate.engine.pgid if dstate.engine else None
        self.reaper = LeftoverReaper(oscalls, dstate.instance_id, recorded)

    def step(self, pending: PendingStart, now: float) -> StartStep:
        if pending.preflight is None:
            pending.preflight = self._preflight(pending.params, now, pending.plan)
        preflight = pending.preflight
        result = preflight.step(now)
        for record in result.records:
            self.rec.record(record.pop("event"), **record)
        if preflight.baseline is not None:
            self._save_baseline(preflight.baseline)
            preflight.baseline = None
        if result.failure is not None:
            self.rec.record("engine.start_refused", failure=result.failure.as_dict(), params=pending.params)
            return Refused(result.failure)
        if not result.clear:
            return Waiting(result.reason or "preflight")
        return self._spawn(pending, now)

    def _preflight(self, params: EngineParams, now: float, plan: PlanOutcome | None) -> Preflight:
        baseline = self.dstate.baseline
        return Preflight(
            self.config,
            params,
            oscalls=self.os,
            marker=self.dstate.instance_id,
            reaper=self.reaper,
            gate=MemoryGate(**baseline) if baseline else None,  # type: ignore[arg-type]
            gpu=self.gpu,
            plan_check=self.capacity.check,
            plan=plan,
            started=now,
            submit=self.submit,
        )

    def _save_baseline(self, gate: MemoryGate) -> None:
        self.dstate.baseline = {
            "baseline_available_bytes": gate.baseline_available_bytes,
            "tolerance_bytes": gate.tolerance_bytes,
            "baseline_gpu_free_bytes": gate.baseline_gpu_free_bytes,
        }
        self.save_state()

    def _launched(self, pending: PendingStart) -> EngineParams:
        """The parameters the command line carries: `pending.params`, on unified memory with an explicit
        KV sizing (`core.params.sizing_flag`, the same value the plan assessed: `Capacity.sized`). The
        machine is the plan's; without a plan (planner off) the last poll's GPU facts say whether the
        memory is unified. The run keeps `pending.params` (what tunerd decided), not this."""
        plan = pending.preflight.plan if pending.preflight else None
        machine = plan.machine if plan else None
        if machine is not None:
            return self.capacity.sized(pending.params, machine)
        gpu = self.gpu()
        unified = bool(gpu is not None and gpu.unified_memory)
        cap = self.config.tuning.unified_max_gpu_memory_utilization
        return sizing_flag(pending.params, backend="cuda", unified=unified, cap=cap)

    def _spawn(self, pending: PendingStart, now: float) -> StartStep:
        engine_cfg = self.config.engine
        capabilities = self.dstate.capabilities or {}
        argv = build_argv(engine_cfg, self._launched(pending)) + access_log_args(self.config)
        argv += drain_args(self.config, capabilities)
        argv += per_request_metrics_args(self.config, capabilities)
        argv += histogram_buckets_args(self.config, capabilities)
        if capabilities.get("command") == list(engine_cfg.command) and capabilities.get("dropped_flags"):
            argv = without_flags(argv, capabilities["dropped_flags"])  # this vLLM does not know them
        try:
            run = self.engine.spawn(argv, build_env(engine_cfg), pending.params, now, self.wallclock())
        except OSError as exc:
            failure = EngineFailure(FailureKind.SPAWN_FAILED, f"cannot execute {argv[0]}: {exc}")
            self.rec.record("engine.failed", phase="spawn", failure=failure.as_dict())
            return Refused(failure)
        host = "127.0.0.1" if engine_cfg.host in ("0.0.0.0", "") else engine_cfg.host
        run.base_url = f"http://{host}:{engine_cfg.port}"
        plan = pending.preflight.plan if pending.preflight else None
        run.predicted_kv_tokens = plan.predicted_kv_tokens if plan else None
        run.machine = plan.machine if plan else None
        self.dstate.engine = EngineRecord(
            pid=run.pid, pgid=run.pgid, started=run.started_wall.isoformat(), log=str(run.log_path)
        )
        self.save_state()
        self.rec.record(
            "engine.spawned", pid=run.pid, argv=argv, log=str(run.log_path), intent=pending.intent
        )
        return Launched(run)
