"""The tunable parameters and the one change a step proposes (pure).

Each tunable has bounds, a step rule and per-backend constraints: `block_size` is a multiple of 32 on
vLLM's CPU backend (fixture fail_block_size.log) and one of {16, 32, 64} elsewhere (FlashInfer; a
multiple of 16 for FlashAttention); on unified memory `gpu_memory_utilization` is capped (hosts freeze
above ~0.9, vLLM #46307) and never probed downward from near 1 as `auto_tune.sh` does; where the
operator sized the KV cache with `kv_cache_memory_bytes`, a step of `gpu_memory_utilization` moves that
instead. A proposal never lands on a value that is tabu (recently reverted or failed), and never
jumps over one: the next value in that direction is the only candidate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tunerd.config.rules import StepAction
from tunerd.core.params import Backend, EngineParams, batch_defaults, default_block_size

Value = int | float | bool


@dataclass(frozen=True)
class Tunable:
    """One parameter a trial may move. `choices` (per backend) replace the bounds where they are given."""

    name: str
    integer: bool
    low: float
    high: float
    default_cpu: Value | None = None  # what vLLM uses when the flag is not passed (None: unknown)
    default_cuda: Value | None = None
    choices_cpu: tuple[int, ...] = ()
    choices_cuda: tuple[int, ...] = ()
    boolean: bool = False

    def default(self, backend: Backend, gpu_total_bytes: int | None = None) -> Value | None:
        """What vLLM uses when the flag is not passed; the batch limits depend on the GPU's memory."""
        if self.name in BATCH_LIMITS:
            return batch_defaults(backend, gpu_total_bytes)[BATCH_LIMITS.index(self.name)]
        if self.name == "block_size":
            return default_block_size(backend)
        return self.default_cpu if backend == "cpu" else self.default_cuda

    def choices(self, backend: Backend) -> tuple[int, ...]:
        return self.choices_cpu if backend == "cpu" else self.choices_cuda


BATCH_LIMITS = ("max_num_seqs", "max_num_batched_tokens")  # the order of core.params.batch_defaults


# Defaults as vLLM 0.32 resolves them for the OpenAI server (the batch limits: core.params.batch_defaults).
REGISTRY: dict[str, Tunable] = {
    t.name: t
    for t in (
        Tunable("max_num_seqs", True, 1, 1024),
        Tunable("max_num_batched_tokens", True, 64, 65536),
        Tunable("max_model_len", True, 64, 1 << 20),
        Tunable("block_size", True, 16, 128, choices_cpu=(32, 64, 128), choices_cuda=(16, 32, 64)),
        Tunable("gpu_memory_utilization", False, 0.05, 0.95, default_cpu=0.92, default_cuda=0.92),
        Tunable("kv_cache_memory_bytes", True, 1 << 20, 1 << 50),
        Tunable("enable_chunked_prefill", False, 0, 1, True, True, boolean=True),
        Tunable("enable_prefix_caching", False, 0, 1, True, True, boolean=True),
    )
}


# The door's cap (core.params.LIVE_PARAMS) is not a tunable any more: the door steers it live toward the
# [objective] targets (door/limit.py) or the operator pins it; a rule naming it moves its `then` (issue 21).


@dataclass(frozen=True)
class Proposal:
    """One change: `param` from `old` to `new`; `params` is the whole set with it applied (a restart's).
    `proposed_by` says where the value comes from ("rule step": the rule's direction and factor; "kv
    model": the KV cache's arithmetic, policy/first_step.py; "fleet": another box kept it; "rule revert"),
    `arithmetic` how it was computed, when it was (both journaled with `trial.started`)."""

    param: str
    old: Value | None
    new: Value
    params: EngineParams
    notes: tuple[str, ...] = ()
    proposed_by: str = "rule step"
    arithmetic: str | None = None


@dataclass(frozen=True)
class NoProposal:
    """Why a step proposes nothing (at a bound, next value tabu, nothing known to step from), or not yet
    (`exhausted` False: the rule is deferred, not muted — restart knobs wait while the door's steered cap
    is still moving toward the targets)."""

    reason: str
    exhausted: bool = True  # nothing further in this direction: mute the rule


def bounds_of(
    tunable: Tunable,
    configured: Mapping[str, tuple[float, float]],
    backend: Backend,
    unified: bool,
    cap: float,
) -> tuple[float, float]:
    """The effective bounds: the registry's, narrowed by `tuning.bounds`, capped on unified memory."""
    low, high = tunable.low, tunable.high
    if tunable.name in configured:
        low, high = max(low, configured[tunable.name][0]), min(high, configured[tunable.name][1])
    if tunable.name == "gpu_memory_utilization" and unified and backend == "cuda":
        high = min(high, cap)
    return low, high


def propose(
    action: StepAction,
    params: EngineParams,
    *,
    backend: Backend,
    unified: bool = False,
    bounds: Mapping[str, tuple[float, float]] | None = None,
    unified_cap: float = 0.85,
    tabu: Mapping[tuple[str, Value], str] | None = None,
    gpu_total_bytes: int | None = None,
    running: float | None = None,
) -> Proposal | NoProposal:
    """The one change `action` asks of `params`, or why there is none. `tabu` maps (param, value) to
    why it is tabu; `gpu_total_bytes` picks vLLM's defaults for unset batch limits; `running` (requests
    vLLM ran at once on average, before) is where a concurrency limit that does not bind steps down from."""
    name, notes = action.param, []
    if name == "gpu_memory_utilization" and params.kv_cache_memory_bytes is not None:
        # The operator sized the KV cache in bytes: vLLM ignores the utilization then; move the bytes by
        # the same share a utilization step would move (by 0.05 of 0.92 is a factor of 0.946).
        name = "kv_cache_memory_bytes"
        action = _as_share(
            action, params.gpu_memory_utilization or REGISTRY["gpu_memory_utilization"].default(backend)
        )
        notes.append("kv_cache_memory_bytes is set: stepping it instead of gpu_memory_utilization")
    tunable = REGISTRY[name]
    current = getattr(params, name)
    old = current
    if current is None:
        current = tunable.default(backend, gpu_total_bytes)
        if current is None:
            return NoProposal(f"{name} is not set and vLLM's default is not known: nothing to step from")
        notes.append(f"{name} is not set: stepping from vLLM's default {current}")
    low, high = bounds_of(tunable, bounds or {}, backend, unified, unified_cap)
    new = _from_what_runs(tunable, action, current, running, (low, high), backend, notes)
    if new is None or new == current:
        return NoProposal(
            f"{name} {current} is at its {'lower' if action.direction == 'down' else 'upper'} bound"
        )
    why_tabu = (tabu or {}).get((name, new))
    if why_tabu is not None:
        return NoProposal(f"the next value {name}={new} is tabu: {why_tabu}")
    changed = params.replace(**{name: new})
    if problem := _cross_check(changed, backend, gpu_total_bytes):
        return NoProposal(f"{name}={new}: {problem}")
    return Proposal(name, old, new, changed, tuple(notes))


CONCURRENCY_LIMITS = ("max_num_seqs",)


def _from_what_runs(
    tunable: Tunable,
    action: StepAction,
    current: Value,
    running: float | None,
    bounds: tuple[float, float],
    backend: Backend,
    notes: list[str],
) -> Value | None:
    """The step of a concurrency limit: from the limit, unless that step would still not bind (the new
    limit at or above what vLLM ran at once): then from what ran. Halving a limit that does not bind
    changes nothing: vLLM's default 1024 sequences on an H200 whose KV cache holds 14 would take six
    restarts to reach a value that acts. A limit that binds steps as any parameter does."""
    low, high = bounds
    new = _step(tunable, action, current, backend, low, high)
    if tunable.name not in CONCURRENCY_LIMITS or action.direction != "down" or running is None:
        return new
    ran = max(1, math.ceil(running))
    if new is None or ran >= current or new < ran:
        return new
    from_ran = _step(tunable, action, ran, backend, low, high)
    if from_ran is None:  # nothing below what ran (about one request): the limit steps as any does
        return new
    notes.append(
        f"{tunable.name} {current} does not bind (vLLM ran {running:.1f} requests at once before): "
        f"stepping from {ran}"
    )
    return from_ran


def _as_share(action: StepAction, utilization: Value | None) -> StepAction:
    """A utilization step as a factor, for the byte count that stands in for the utilization."""
    if action.factor is not None or action.by is None or not utilization:
        return action
    sign = -1.0 if action.direction == "down" else 1.0
    factor = (float(utilization) + sign * action.by) / float(utilization)
    return action.model_copy(update={"by": None, "factor": factor})


def _step(
    tunable: Tunable, action: StepAction, current: Value, backend: Backend, low: float, high: float
) -> Value | None:
    down = action.direction == "down"
    if tunable.boolean:
        return not down
    choices = [c for c in tunable.choices(backend) if low <= c <= high]
    if choices:
        ahead = [c for c in choices if (c < current if down else c > current)]
        if not ahead:
            return None
        if action.next or action.by is not None:
            return max(ahead) if down else min(ahead)
        target = float(current) * (action.factor or 1.0)
        return min(ahead, key=lambda c: abs(c - target))  # the allowed value nearest the factor's
    if action.factor is not None:
        raw = float(current) * action.factor
    else:
        raw = float(current) + (-(action.by or 1.0) if down else (action.by or 1.0))
    if tunable.integer:
        value: Value = math.floor(raw) if not down else math.ceil(raw)
        if value == current:
            value = int(current) + (-1 if down else 1)
    else:
        value = round(raw, 4)
    if down and value < low:
        value = low if current > low else None  # type: ignore[assignment]
    if not down and value > high:
        value = high if current < high else None  # type: ignore[assignment]
    if value is None:
        return None
    # A value outside the bounds (unset: vLLM's default above a cap) is brought inside by the step.
    value = min(value, high) if down else max(value, low)
    return int(value) if tunable.integer else float(value)


def _cross_check(params: EngineParams, backend: Backend, gpu_total_bytes: int | None) -> str | None:
    """Constraints between parameters that vLLM enforces at start (a start refused is a lost restart);
    an unset parameter counts with vLLM's default."""
    batched = params.max_num_batched_tokens
    seqs = params.max_num_seqs or batch_defaults(backend, gpu_total_bytes)[0]
    if batched is not None and isinstance(seqs, int) and batched < seqs:
        return f"max_num_batched_tokens {batched} < max_num_seqs {seqs}"
    return None
