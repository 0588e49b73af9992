"""Why an engine run failed: a classified kind, the evidence, and what can cure it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    # Classified from vLLM's output (engine/logwatch.py).
    KV_CACHE_TOO_SMALL = "kv_cache_too_small"
    NO_KV_MEMORY = "no_kv_memory"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    OUT_OF_MEMORY = "out_of_memory"
    INVALID_BLOCK_SIZE = "invalid_block_size"
    MODEL_NOT_FOUND = "model_not_found"
    PORT_IN_USE = "port_in_use"
    BAD_ARGUMENTS = "bad_arguments"
    ENGINE_INIT_FAILED = "engine_init_failed"
    ENGINE_DEAD = "engine_dead"
    # Observed by the supervisor.
    SPAWN_FAILED = "spawn_failed"  # the program could not be executed at all
    STARTUP_TIMEOUT = "startup_timeout"  # no /health 200 within the start-up budget
    HEALTH_FAILED = "health_failed"  # /health failed repeatedly while running
    EXITED = "exited"  # the process exited on its own (exit code 0 included: not a clean stop)
    KILLED = "killed"  # killed by a signal tunerd did not send (SIGKILL: likely the OOM killer)
    MEMORY_EMERGENCY = "memory_emergency"  # the host-wedge guard stopped it (MemAvailable / PSI)
    WEDGED = "wedged"  # requests running, no token produced for too long (/health may still say 200)
    PREFLIGHT = "preflight"  # the start's preflight did not clear in time (memory, port, leftovers)
    PLAN_REFUSED = "plan_refused"  # the capacity planner predicts these parameters cannot fit


# Failures that no retry with the same command line can cure.
UNFIXABLE = frozenset(
    {
        FailureKind.MODEL_NOT_FOUND,
        FailureKind.BAD_ARGUMENTS,
        FailureKind.SPAWN_FAILED,
        FailureKind.PLAN_REFUSED,
    }
)
# Failures that blame the parameters in force: roll back to last-known-good at once when it differs.
BLAMES_PARAMS = frozenset({FailureKind.MEMORY_EMERGENCY})
# Generic kinds: a more specific cause seen in the same run replaces them.
GENERIC = frozenset(
    {FailureKind.ENGINE_INIT_FAILED, FailureKind.ENGINE_DEAD, FailureKind.EXITED, FailureKind.KILLED}
)


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """What failed, the evidence (a log line or a description), and what vLLM said would fit."""

    kind: FailureKind
    detail: str
    estimated_max_model_len: int | None = None

    def as_dict(self) -> dict[str, object]:
        data: dict[str, object] = {"kind": str(self.kind), "detail": self.detail}
        if self.estimated_max_model_len is not None:
            data["estimated_max_model_len"] = self.estimated_max_model_len
        return data


def more_specific(current: EngineFailure | None, new: EngineFailure) -> EngineFailure:
    """The failure to report when `new` is seen after `current` in the same run.

    The first specific failure wins; a generic one (init failed, engine dead, exited) is kept only
    until a specific one shows up: vLLM prints the root cause, then "Engine core initialization
    failed"; and the exit comes after both.
    """
    if current is None or (current.kind in GENERIC and new.kind not in GENERIC):
        return new
    return current
