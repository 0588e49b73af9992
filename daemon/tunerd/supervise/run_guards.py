"""The guards that watch a run while it starts or serves, as the main loop feeds them readings.

- Host-wedge guard: `MemAvailable` or memory pressure crossing the configured floor (policy/guards.py).
- Forward progress: requests running while the generation-token counter stands still (idle is
  never wedged).
Each returns the failure to act on (the lifecycle stops the tree) after journaling its evidence. They
also keep the GPU facts of the last poll, which the next start's preflight needs.
"""

from __future__ import annotations

from tunerd.config import GuardConfig
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.machine import GpuFacts, MemoryReading
from tunerd.core.params import EngineParams
from tunerd.observe.poller import PollSample
from tunerd.policy.guards import MemoryFloor, Progress, memory_emergency, track_progress, wedged
from tunerd.records.recorder import Recorder


class RunGuards:
    def __init__(self, recorder: Recorder) -> None:
        self.rec = recorder
        self.gpu: GpuFacts | None = None  # None until the first poll
        self.progress = Progress()

    def new_run(self) -> None:
        self.progress = Progress()

    def check_memory(
        self, reading: MemoryReading, guard: GuardConfig, params: EngineParams
    ) -> EngineFailure | None:
        """A memory emergency (journaled with the figures), or None."""
        floor = MemoryFloor(guard.min_available_bytes, guard.min_available_ratio, guard.max_psi_full_avg10)
        reason = memory_emergency(reading, floor)
        if reason is None:
            return None
        self.rec.record(
            "guard.memory_emergency",
            reason=reason,
            mem_available_bytes=reading.mem_available_bytes,
            mem_total_bytes=reading.mem_total_bytes,
            psi_some_avg10=reading.psi_some_avg10,
            psi_full_avg10=reading.psi_full_avg10,
            params=params,
        )
        return EngineFailure(FailureKind.MEMORY_EMERGENCY, reason)

    def remember_gpu(self, sample: PollSample) -> None:
        """Keep what the preflight of the next start wants to know about the GPU."""
        gpu = sample.gpu
        if not gpu.available:
            self.gpu = GpuFacts()
            return
        frees = [d.mem_free_bytes for d in gpu.devices]
        free = sum(f for f in frees if f is not None) if all(f is not None for f in frees) else None
        self.gpu = GpuFacts(gpu.unified_memory, free)

    def check_progress(
        self, sample: PollSample, guard: GuardConfig, pid: int, now: float
    ) -> EngineFailure | None:
        """A wedge (journaled with the evidence), or None. `sample` is of the current, serving run."""
        engine = sample.scrape.sample if sample.scrape is not None else None
        if engine is None or guard.wedge_after_s <= 0:
            return None
        running, tokens = engine.requests_running, engine.generation_tokens_total
        util = sample.readings.get("gpu.util_percent")
        self.progress = track_progress(
            self.progress, now, running=running, generation_tokens=tokens, gpu_util=util
        )
        reason = wedged(self.progress, now, running=running, after_s=guard.wedge_after_s)
        if reason is None:
            return None
        self.rec.record(
            "guard.wedged",
            reason=reason,
            running=running,
            generation_tokens_total=tokens,
            gpu_util_percent=util,
            pid=pid,
        )
        return EngineFailure(FailureKind.WEDGED, reason)
