"""Pure guard decisions: host memory emergency, the memory-return gate, forward progress.

No I/O and no clocks: readings and `now` come in, verdicts come out. The supervisor acts on them.

- Host-wedge guard: on unified memory a runaway start can freeze the whole host (vLLM #46307,
  #56824); stop vLLM while `MemAvailable` is still above a floor and memory pressure (PSI) is below
  a ceiling.
- Memory-return gate: after a process dies its memory can take a minute or more to come back on
  unified memory (#55510, #48140); a start waits until free memory is back near its baseline.
- Forward progress: `/health` answers 200 on a wedged engine (#39863, #11996). Wedged = requests
  running while the generation-token counter stands still; idle is never wedged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tunerd.core.machine import MemoryReading
from tunerd.core.units import GiB


@dataclass(frozen=True, slots=True)
class MemoryFloor:
    """Limits of the host-wedge guard."""

    min_available_bytes: int
    min_available_ratio: float  # of MemTotal; the larger of the two floors applies
    max_psi_full_avg10: float  # percent of time all tasks stalled on memory (10 s average)


def memory_emergency(reading: MemoryReading, floor: MemoryFloor) -> str | None:
    """A one-line reason when the host is about to stall on memory, else None.

    Unknown readings never trigger: no decision is made on missing data.
    """
    available = reading.mem_available_bytes
    if available is not None:
        limit = floor.min_available_bytes
        if reading.mem_total_bytes:
            limit = max(limit, int(reading.mem_total_bytes * floor.min_available_ratio))
        if available < limit:
            return f"MemAvailable {available / GiB:.2f} GiB below the floor of {limit / GiB:.2f} GiB"
    psi = reading.psi_full_avg10
    if psi is not None and psi > floor.max_psi_full_avg10:
        return f"memory pressure full avg10 {psi:.1f}% above {floor.max_psi_full_avg10:.1f}%"
    return None


@dataclass(frozen=True, slots=True)
class MemoryGate:
    """The memory-return gate's limit: free memory within `tolerance` of the baseline."""

    baseline_available_bytes: int
    tolerance_bytes: int
    baseline_gpu_free_bytes: int | None = None  # discrete GPU: NVML free memory at the baseline


def memory_returned(
    gate: MemoryGate, available_bytes: int | None, gpu_free_bytes: int | None = None
) -> tuple[bool, str]:
    """(True, why) when memory is back; (False, what is still missing) otherwise.

    Unknown readings do not block (the gate cannot be measured; the emergency guard still watches).
    """
    wanted = gate.baseline_available_bytes - gate.tolerance_bytes
    if available_bytes is not None and available_bytes < wanted:
        return False, (
            f"MemAvailable {available_bytes / GiB:.2f} GiB, waiting for {wanted / GiB:.2f} GiB "
            f"(baseline {gate.baseline_available_bytes / GiB:.2f} GiB - {gate.tolerance_bytes / GiB:.2f} GiB)"
        )
    if gate.baseline_gpu_free_bytes is not None and gpu_free_bytes is not None:
        gpu_wanted = gate.baseline_gpu_free_bytes - gate.tolerance_bytes
        if gpu_free_bytes < gpu_wanted:
            return False, f"GPU free {gpu_free_bytes / GiB:.2f} GiB, waiting for {gpu_wanted / GiB:.2f} GiB"
    return True, "memory back within tolerance of its baseline"


@dataclass(frozen=True, slots=True)
class Progress:
    """Forward-progress state: when the engine was last seen making progress (or idle)."""

    last_tokens: float | None = None
    progress_at: float | None = None  # monotonic time of the last token movement or idle sample
    last_gpu_util: float | None = None


def track_progress(
    state: Progress,
    now: float,
    *,
    running: float | None,
    generation_tokens: float | None,
    gpu_util: float | None = None,
) -> Progress:
    """Fold one sample in. Missing engine data leaves the state untouched (no judgment on it).

    Progress = the token counter moved (a decrease is a restart: also movement), or no request runs
    (idle resets the clock), or the GPU shows work (utilization changed or is busy): where NVML works,
    a busy GPU contradicts "wedged" (e.g. a long prefill produces no tokens yet).
    """
    if running is None or generation_tokens is None:
        return state
    moved = state.last_tokens is None or generation_tokens != state.last_tokens
    gpu_busy = gpu_util is not None and (
        gpu_util > 0 and (state.last_gpu_util is None or gpu_util != state.last_gpu_util)
    )
    if moved or running <= 0 or gpu_busy or state.progress_at is None:
        return Progress(generation_tokens, now, gpu_util)
    return replace(state, last_tokens=generation_tokens, last_gpu_util=gpu_util)


def wedged(state: Progress, now: float, *, running: float | None, after_s: float) -> str | None:
    """A reason when requests have run without any token for `after_s`, else None."""
    if state.progress_at is None or not running or running <= 0:
        return None
    stalled = now - state.progress_at
    if stalled < after_s:
        return None
    return (
        f"{running:g} request(s) running but generation_tokens_total stuck at {state.last_tokens:g} "
        f"for {stalled:.0f} s"
    )
