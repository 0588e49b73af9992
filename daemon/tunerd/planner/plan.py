"""Capacity planner: what fits before vLLM tries — weights, KV cache, budget, oversubscription (pure).

`assess(model, params, facts, backend=…, calibration=…)` is the entry point: it answers "does this
parameter set fit, and by how much" with a `PlanVerdict`, without starting vLLM. It combines
`kv_math` (the KV arithmetic, mirroring vLLM 0.32 line by line), `memory_budget` (how much memory vLLM
would hand to the KV cache) and, once one start has been seen, a `Calibration` of the non-KV memory
(`calibration`). Rendering: `plan_report`; operator checks: `preflight_checks`.

Just over 400 lines: the verdict, its figures and its suggestion (the largest setting that fits) are one
judgment read by `tunerd plan`, the preflight and the supervisor alike; the arithmetic and the budget it
combines already live in their own modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from tunerd.core.machine import MemoryFacts, MemoryKind
from tunerd.core.model import ModelInfo
from tunerd.core.params import Backend, EngineParams, default_block_size
from tunerd.core.units import GiB, bytes_text, gib_text
from tunerd.planner.calibration import Calibration
from tunerd.planner.device_memory import memory_kind
from tunerd.planner.kv_math import (
    FrontierPoint,
    KVEstimateUnavailable,
    KVLayout,
    blocks_per_request,
    frontier,
    kv_cache_tokens,
    kv_layout,
    largest_max_model_len,
    max_concurrency,
    num_blocks_for,
    request_fits,
    vllm_estimated_max_model_len,
)
from tunerd.planner.memory_budget import MemoryBudget, memory_budget, weights_on_device

Band = Literal["fine", "caution", "refuse", "never"]

# The operators' oversubscription bands: ≤ 1.2 fine, 1.2–1.5 caution, > 1.5 refuse unless forced, ≥ 2 never.
BAND_FINE_MAX = 1.2
BAND_CAUTION_MAX = 1.5
BAND_NEVER_MIN = 2.0

# vLLM assumes this max_model_len when the config names none (and warns).
DEFAULT_MAX_MODEL_LEN_WITHOUT_CONFIG = 2048


def band_for(ratio: float) -> Band:
    """The operators' bands: ≤ 1.2 fine, ≤ 1.5 caution, < 2 refuse (unless forced), ≥ 2 never."""
    if ratio <= BAND_FINE_MAX:
        return "fine"
    if ratio <= BAND_CAUTION_MAX:
        return "caution"
    if ratio < BAND_NEVER_MIN:
        return "refuse"
    return "never"


@dataclass(frozen=True)
class PlanVerdict:
    """The planner's answer for one parameter set: feasible or not, with every figure behind it.

    `feasible`: vLLM would start with these parameters (none of its own start-up checks fails) and the
    oversubscription band is fine or caution (refuse only with `forced`; never is never feasible).
    KV figures are None when `kv_unavailable` says why they cannot be computed. `reasons` are one line each,
    worded for an operator. `suggested` is a parameter set the planner expects to be feasible (or None).
    """

    feasible: bool
    band: Band
    ratio: float | None
    forced: bool
    backend: Backend
    memory_kind: str
    model: str
    params: EngineParams
    max_model_len: int
    max_num_seqs: int | None
    block_size: int
    kv_cache_dtype: str
    weights_bytes: int
    weights_source: str
    kv_bytes_per_token: int | None
    bytes_per_block: int | None
    budget: MemoryBudget
    reserve_bytes: int | None
    kv_demand_bytes: int | None
    num_blocks: int | None
    kv_cache_tokens: int | None
    kv_cache_tokens_range: tuple[int, int] | None
    max_concurrency: float | None
    largest_max_model_len: int | None
    vllm_estimated_max_model_len: int | None
    frontier: tuple[FrontierPoint, ...]
    calibrated: bool
    kv_unavailable: str | None
    reasons: tuple[str, ...]
    suggested: EngineParams | None = None


@dataclass
class _KvFigures:
    """The KV pool vLLM would build from a budget, and what it allows (None: not computable)."""

    num_blocks: int | None = None
    tokens: int | None = None
    tokens_range: tuple[int, int] | None = None
    concurrency: float | None = None
    largest: int | None = None
    estimate: int | None = None
    frontier: tuple[FrontierPoint, ...] = ()
    demand: int | None = None
    refusals: list[str] = field(default_factory=list)


def assess(
    model: ModelInfo,
    params: EngineParams,
    memory: MemoryFacts,
    *,
    backend: Backend,
    calibration: Calibration | None = None,
    force: bool = False,
    version: str | None = None,
) -> PlanVerdict:
    """Answer "does `params` fit, and by how much" without starting vLLM.

    Ratio = (weights on the device + the KV pool vLLM would allocate for these flags + the
    activation/overhead reserve) ÷ the memory physically available to the model (`MemoryBudget.physical_*`).
    vLLM allocates the whole pool at start-up whatever the load, so the pool, not the configured
    concurrency × length, is what the configuration reaches; the latter is reported as `kv_demand_bytes`
    (and as a reason line when the pool cannot hold `max_num_seqs` full-length requests).
    `feasible` also requires that none of vLLM's own start-up checks would fail (`budget.start_refusals`).
    A flag left unset takes `version`'s default (`core.params.vllm_defaults`; None: not known yet, read as
    ≤ 0.33).
    """
    plan = _assess(
        model, params, memory, backend=backend, calibration=calibration, force=force, version=version
    )
    return replace(plan, suggested=_suggest(plan, model, memory, backend, calibration, version))


def _input_reasons(model: ModelInfo, params: EngineParams, kind: MemoryKind) -> list[str]:
    """Reason lines about the flags themselves (offload on unified memory, length over the model's)."""
    reasons: list[str] = []
    if params.cpu_offload_gb and kind == "unified":
        reasons.append(
            "cpu_offload_gb moves weights to host memory, which on unified memory is the same memory: "
            "no saving"
        )
    if (
        model.max_model_len is not None
        and params.max_model_len
        and params.max_model_len > model.max_model_len
    ):
        reasons.append(
            f"max_model_len {params.max_model_len} exceeds the model's {model.max_model_len} "
            f"({model.max_model_len_source}); vLLM refuses unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
    return reasons


def _kv_figures(
    model: ModelInfo,
    params: EngineParams,
    layout: KVLayout,
    budget: MemoryBudget,
    max_len: int,
    refused: bool,
) -> tuple[_KvFigures, list[str]]:
    """The pool vLLM would build from `budget.kv_bytes` (not None), its start-up refusals (vLLM's null-block
    check), and a reason line when it cannot hold `max_num_seqs` full-length requests. `refused`: the
    budget already fails one of vLLM's checks."""
    kv_bytes = budget.kv_bytes or 0
    block_size, bpb = layout.block_size, layout.bytes_per_block
    out = _KvFigures(num_blocks=num_blocks_for(kv_bytes, layout))
    num_blocks = out.num_blocks or 0
    out.tokens = kv_cache_tokens(num_blocks, max_len, block_size)
    out.concurrency = max_concurrency(num_blocks, max_len, block_size)
    if budget.kv_bytes_low is not None and budget.kv_bytes_high is not None:
        out.tokens_range = (
            kv_cache_tokens(num_blocks_for(budget.kv_bytes_low, layout), max_len, block_size),
            kv_cache_tokens(num_blocks_for(budget.kv_bytes_high, layout), max_len, block_size),
        )
    out.largest = largest_max_model_len(kv_bytes, layout)
    if model.max_model_len is not None:
        out.largest = min(out.largest, model.max_model_len)
    out.demand = (params.max_num_seqs or 1) * blocks_per_request(max_len, block_size) * bpb
    out.frontier = frontier(num_blocks, block_size, model.max_model_len)
    if kv_bytes > 0 and kv_bytes - bpb <= 0:
        out.refusals.append(
            f"{bytes_text(kv_bytes)} of KV memory is not more than one block ({bpb:,} bytes) "
            "(vLLM: 'No available memory for the cache blocks')"
        )
    elif kv_bytes > 0 and not request_fits(kv_bytes, max_len, layout):
        out.estimate = vllm_estimated_max_model_len(kv_bytes, max_len, layout)
        out.refusals.append(
            f"one request of max_model_len {max_len:,} needs {blocks_per_request(max_len, block_size):,} "
            f"blocks but only {max(0, num_blocks - 1):,} are usable; vLLM refuses: "
            f"'the estimated maximum model length is {out.estimate}'"
        )
    reasons: list[str] = []
    if params.max_num_seqs and out.concurrency < params.max_num_seqs and not (refused or out.refusals):
        reasons.append(
            f"the KV cache holds {out.concurrency:.2f} requests of {max_len:,} tokens; max_num_seqs "
            f"{params.max_num_seqs} at full length would need {gib_text(out.demand)} (requests queue or get "
            "preempted beyond that)"
        )
    return out, reasons


def _ratio_and_band(
    weights: int, kv_pool: int, reserve: int | None, budget: MemoryBudget
) -> tuple[float | None, Band, str]:
    """Oversubscription = (weights + KV pool + reserve) / physically available memory, its band, and the
    reason line. Unknown physical memory: band caution (0 bytes: never)."""
    if budget.physical_bytes and budget.physical_bytes > 0:
        ratio = (weights + kv_pool + (reserve or 0)) / budget.physical_bytes
        band = band_for(ratio)
        return (
            ratio,
            band,
            f"oversubscription {ratio:.2f} = (weights {gib_text(weights)} + KV pool {gib_text(kv_pool)} + "
            f"reserve {gib_text(reserve)}) / {gib_text(budget.physical_bytes)} {budget.physical_source} "
            f"→ {band}",
        )
    band = "never" if budget.physical_bytes == 0 else "caution"
    return None, band, f"physical memory available to the model is not known ({budget.physical_source})"


def _unified_memory_reasons(budget: MemoryBudget, memory: MemoryFacts) -> list[str]:
    """Warnings for unified memory, where some vLLM versions count page cache as used."""
    reasons: list[str] = []
    requested = budget.requested_bytes
    if requested and memory.host_mem_free_bytes is not None:
        free_now = memory.host_mem_free_bytes + memory.own_engine_bytes
        if requested > free_now and (budget.physical_bytes or 0) >= requested:
            # vLLM before PR #35356 (and #48140, #35920) took free memory from cudaMemGetInfo, which on
            # GB10 does not count reclaimable page cache as free.
            reasons.append(
                f"the request {gib_text(requested)} fits MemAvailable but not MemFree {gib_text(free_now)}: "
                "vLLM versions that count page cache as used refuse it; drop caches first "
                "(sync; echo 3 > /proc/sys/vm/drop_caches)"
            )
    if memory.host_page_cache_bytes and memory.host_page_cache_bytes > GiB:
        reasons.append(
            f"page cache {gib_text(memory.host_page_cache_bytes)}: some vLLM versions count it as used on "
            "unified memory; dropping caches (sync; echo 3 > /proc/sys/vm/drop_caches) returns it"
        )
    return reasons


def _band_verdict(band: Band, force: bool) -> tuple[bool, list[str]]:
    """(feasible by the band alone, reason lines): never is never feasible; refuse only when forced."""
    if band == "never":
        return False, ["ratio ≥ 2: never started, even when forced"]
    if band == "refuse":
        return force, ["ratio > 1.5: refused" + (" — forced by the operator" if force else " unless forced")]
    return True, []


def _assess(
    model: ModelInfo,
    params: EngineParams,
    memory: MemoryFacts,
    *,
    backend: Backend,
    calibration: Calibration | None,
    force: bool,
    version: str | None = None,
) -> PlanVerdict:
    """`assess` without the suggestion (the suggestion re-assesses candidates with this)."""
    kind = memory_kind(backend, memory)
    block_size = params.block_size or default_block_size(backend, uses_mla=model.uses_mla, version=version)
    max_len = params.max_model_len or model.max_model_len or DEFAULT_MAX_MODEL_LEN_WITHOUT_CONFIG
    weights, weights_source = weights_on_device(model, params, kind, calibration)
    reasons = _input_reasons(model, params, kind)
    layout: KVLayout | None
    kv_unavailable: str | None = None
    try:
        layout = kv_layout(model, params.kv_cache_dtype, block_size)
    except KVEstimateUnavailable as exc:
        layout, kv_unavailable = None, str(exc)
        reasons.append(f"KV-cache estimate not available: {kv_unavailable}")
    budget = memory_budget(
        model,
        params,
        memory,
        backend=backend,
        weights_bytes=weights,
        calibration=calibration,
        version=version,
    )
    calibrated = budget.non_kv_source.startswith("calibrated")
    if params.kv_cache_memory_bytes is None and not calibrated:
        reasons.append(
            f"non-KV memory is an estimate ({gib_text(budget.non_kv_bytes)}); one start calibrates it from "
            "vLLM's log"
        )
    if calibration is not None and calibration.notes:
        reasons.extend(f"calibration: {note}" for note in calibration.notes)
    start_refusals = list(budget.start_refusals)
    kv = _KvFigures()
    if layout is not None and budget.kv_bytes is not None:
        kv, kv_reasons = _kv_figures(model, params, layout, budget, max_len, refused=bool(start_refusals))
        start_refusals += kv.refusals
        reasons += kv_reasons

    # Oversubscription ratio. reserve = non-KV memory other than the weights (activations, runtime).
    kv_pool = max(0, budget.kv_bytes or 0)
    reserve = None if budget.non_kv_bytes is None else max(0, budget.non_kv_bytes - weights)
    ratio, band, ratio_reason = _ratio_and_band(weights, kv_pool, reserve, budget)
    reasons.append(ratio_reason)
    if kind == "discrete-gpu" and params.kv_cache_memory_bytes is not None and budget.physical_bytes:
        need = kv_pool + (budget.non_kv_bytes or weights)
        if need > budget.physical_bytes:
            start_refusals.append(
                f"--kv-cache-memory-bytes {gib_text(kv_pool)} + non-KV {gib_text(budget.non_kv_bytes)} "
                f"exceed free GPU memory {gib_text(budget.physical_bytes)}: the KV allocation would run out "
                "of memory"
            )
    if kind == "unified":
        reasons += _unified_memory_reasons(budget, memory)
    reasons.extend(start_refusals)
    feasible, band_reasons = _band_verdict(band, force)
    reasons += band_reasons
    if start_refusals:
        feasible = False
    return PlanVerdict(
        feasible=feasible,
        band=band,
        ratio=ratio,
        forced=force,
        backend=backend,
        memory_kind=kind,
        model=model.path or model.identity,
        params=params,
        max_model_len=max_len,
        max_num_seqs=params.max_num_seqs,
        block_size=block_size,
        kv_cache_dtype=params.kv_cache_dtype or "auto",
        weights_bytes=weights,
        weights_source=weights_source,
        kv_bytes_per_token=None if layout is None else layout.bytes_per_token,
        bytes_per_block=None if layout is None else layout.bytes_per_block,
        budget=replace(budget, start_refusals=tuple(start_refusals)),
        reserve_bytes=reserve,
        kv_demand_bytes=kv.demand,
        num_blocks=kv.num_blocks,
        kv_cache_tokens=kv.tokens,
        kv_cache_tokens_range=kv.tokens_range,
        max_concurrency=kv.concurrency,
        largest_max_model_len=kv.largest,
        vllm_estimated_max_model_len=kv.estimate,
        frontier=kv.frontier,
        calibrated=calibrated,
        kv_unavailable=kv_unavailable,
        reasons=tuple(reasons),
    )


def _suggest(
    plan: PlanVerdict,
    model: ModelInfo,
    memory: MemoryFacts,
    backend: Backend,
    calibration: Calibration | None,
    version: str | None = None,
) -> EngineParams | None:
    """A parameter set the planner expects to be feasible, or None when it finds none.

    Starting from the given flags made explicit (max_model_len, block_size): when the memory request
    overreaches what is physically available, the utilization (or the explicit KV bytes) is lowered to 95 %
    of it; then max_model_len is cut to the largest that fits one request. Re-assessed after each step.
    """
    params = plan.params
    changes: dict[str, Any] = {}
    if params.max_model_len is None:
        changes["max_model_len"] = plan.max_model_len
    if params.block_size is None:
        changes["block_size"] = plan.block_size
    budget = plan.budget
    if budget.physical_bytes and (plan.band in ("refuse", "never") or budget.start_refusals):
        if params.kv_cache_memory_bytes is not None:
            kv = int(0.95 * budget.physical_bytes) - (budget.non_kv_bytes or plan.weights_bytes)
            if plan.bytes_per_block and kv < 2 * plan.bytes_per_block:
                return None
            changes["kv_cache_memory_bytes"] = min(params.kv_cache_memory_bytes, kv)
        elif (
            budget.total_bytes
            and budget.requested_bytes
            and budget.requested_bytes > 0.95 * budget.physical_bytes
        ):
            util = math.floor(100 * 0.95 * budget.physical_bytes / budget.total_bytes) / 100
            if util <= 0:
                return None
            changes["gpu_memory_utilization"] = util
    try:
        candidate = params.replace(**changes)
    except ValueError:
        return None
    again = _assess(
        model, candidate, memory, backend=backend, calibration=calibration, force=plan.forced, version=version
    )
    if again.largest_max_model_len is not None and again.largest_max_model_len < again.max_model_len:
        if again.largest_max_model_len < again.block_size:
            return None
        candidate = candidate.replace(max_model_len=again.largest_max_model_len)
        again = _assess(
            model,
            candidate,
            memory,
            backend=backend,
            calibration=calibration,
            force=plan.forced,
            version=version,
        )
    return candidate if again.feasible else None
