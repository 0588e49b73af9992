"""Calibration: what vLLM reported about memory at a start, and the non-KV memory it implies (pure).

The non-KV part of vLLM's memory (CPU: the worker's RSS; GPU: weights + activation peak + non-torch +
CUDA graphs) cannot be derived from the model directory. One start tells it: the engine's log reader
gathers vLLM's start-up lines into a `StartReport` (`tunerd.engine.logwatch`), `calibrate` turns it
into exact non-KV bounds, `combine_calibrations` merges several starts of one configuration
(`calibration_key`). Calibrating from the exact token count pins the KV memory to one block; the GiB
figures in the log are rounded to 2 decimals and are only used where nothing better exists. Which
stored calibration applies is `pick_calibration`; the file itself is `tunerd.records.calibrations`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from tunerd.core.machine import MemoryFacts
from tunerd.core.model import ModelInfo
from tunerd.core.params import Backend, EngineParams, vllm_defaults
from tunerd.core.report import StartReport
from tunerd.core.units import GiB
from tunerd.planner.device_memory import utilization_total
from tunerd.planner.kv_math import (
    KVEstimateUnavailable,
    KVLayout,
    blocks_from_logged_tokens,
    kv_layout,
)


@dataclass(frozen=True)
class Calibration(StartReport):
    """What one vLLM start reported about memory (the `StartReport` fields, from its log), plus what
    `calibrate` derives from it: the non-KV memory it implies.

    `non_kv_low..non_kv_high` is the exact integer range of the non-KV memory (CPU: worker RSS; GPU:
    weights + activations + non-torch + CUDA graphs) consistent with the logged token count;
    `non_kv_bytes` its midpoint; `samples` how many starts were combined (`combine_calibrations`).
    """

    # Derived by calibrate() / combine_calibrations():
    backend: str | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    bytes_per_block: int | None = None
    num_blocks: int | None = None
    total_bytes: int | None = None
    requested_bytes: int | None = None
    kv_pool_low: int | None = None
    kv_pool_high: int | None = None
    non_kv_low: int | None = None
    non_kv_high: int | None = None
    non_kv_bytes: int | None = None
    samples: int = 0
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["notes"] = list(self.notes)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in data.items() if k in known}
        values["notes"] = tuple(values.get("notes") or ())
        return cls(**values)


def gib_interval(gib: float) -> tuple[int, int]:
    """The byte range a GiB figure rounded to 2 decimals (vLLM `format_gib`) can stand for."""
    return math.ceil((gib - 0.005) * GiB), math.floor((gib + 0.005) * GiB)


def calibrate(
    parsed: StartReport,
    model: ModelInfo,
    params: EngineParams,
    facts: MemoryFacts,
    *,
    backend: Backend,
) -> Calibration:
    """Turn a parsed start-up report into non-KV memory bounds for the next prediction.

    The logged token count gives num_blocks exactly (`blocks_from_logged_tokens`), so the KV memory vLLM
    had is known to within one block: [num_blocks × bytes_per_block, (num_blocks + 1) × bytes_per_block).
    The rounded GiB figure narrows that only when a block is larger than ~10 MB. On the
    `gpu_memory_utilization` path, non-KV = ceil(total × util) − KV memory (CPU: the worker's RSS;
    GPU: `requested_memory − available_kv_cache_memory`). `facts` must be those measured for that start
    (the total is read from them; without them the logged, rounded totals are used and the range widens).
    On the explicit `--kv-cache-memory-bytes` path nothing about non-KV memory is logged; the calibration
    then only checks the planner's block arithmetic against vLLM's (a mismatch becomes a note).
    """
    notes: list[str] = []
    if not isinstance(parsed, Calibration):
        parsed = Calibration(**asdict(parsed))
    # The defaults of the vLLM that started (its log's version line; unknown reads as ≤ 0.33).
    defaults = vllm_defaults(parsed.vllm_version, backend)
    block_size = params.block_size or defaults.block_size_for(uses_mla=model.uses_mla)
    try:
        layout = kv_layout(model, params.kv_cache_dtype, block_size)
    except KVEstimateUnavailable as exc:
        return replace(parsed, backend=backend, notes=(f"not calibrated: {exc}",))
    bpb = layout.bytes_per_block
    max_len = parsed.kv_max_model_len or params.max_model_len or model.max_model_len
    num_blocks, pool_low, pool_high = _kv_pool_from_log(parsed, max_len, layout, backend, notes)
    util = params.gpu_memory_utilization or defaults.gpu_memory_utilization
    explicit = params.kv_cache_memory_bytes
    if explicit is not None and num_blocks is not None and num_blocks != explicit // bpb:
        notes.append(
            f"vLLM made {num_blocks} blocks of {explicit} bytes, the planner {explicit // bpb} "
            f"({bpb} bytes per block): the KV layout model does not match this model"
        )
    total, _ = utilization_total(backend, facts)
    requested: int | None = None
    non_kv_low = non_kv_high = None
    if explicit is None and pool_low is not None and pool_high is not None:
        if total is not None:
            requested = math.ceil(total * util)
            non_kv_low, non_kv_high = requested - pool_high, requested - pool_low
        elif backend == "cpu" and parsed.cpu_requested_gib is not None:
            req_low, req_high = gib_interval(parsed.cpu_requested_gib)
            non_kv_low, non_kv_high = req_low - pool_high, req_high - pool_low
            notes.append("node MemTotal not measured: calibrated from the rounded GiB in the log")
    non_kv = None if non_kv_low is None or non_kv_high is None else (non_kv_low + non_kv_high) // 2
    return replace(
        parsed,
        backend=backend,
        gpu_memory_utilization=None if explicit is not None else util,
        kv_cache_memory_bytes=explicit,
        block_size=block_size,
        bytes_per_block=bpb,
        num_blocks=num_blocks,
        total_bytes=total,
        requested_bytes=requested,
        kv_pool_low=pool_low,
        kv_pool_high=pool_high,
        non_kv_low=non_kv_low,
        non_kv_high=non_kv_high,
        non_kv_bytes=non_kv,
        samples=1 if non_kv is not None else 0,
        notes=tuple(notes),
    )


def _kv_pool_from_log(
    parsed: StartReport, max_len: int | None, layout: KVLayout, backend: Backend, notes: list[str]
) -> tuple[int | None, int | None, int | None]:
    """(num_blocks, lowest, highest KV pool bytes) that vLLM's log allows; appends to `notes` where the
    log and the planner's block arithmetic disagree.

    The exact token count (or a refusal's estimate) fixes num_blocks and so the pool to one block; the
    logged, rounded GiB figure narrows that range or, without a count, is the range.
    """
    bpb, block_size = layout.bytes_per_block, layout.block_size
    num_blocks: int | None = None
    pool_low = pool_high = None
    if parsed.kv_cache_tokens is not None and max_len:
        try:
            num_blocks = blocks_from_logged_tokens(parsed.kv_cache_tokens, max_len, block_size)
            pool_low, pool_high = num_blocks * bpb, (num_blocks + 1) * bpb - 1
        except ValueError as exc:
            notes.append(f"token count does not match the planner's block arithmetic: {exc}")
    elif (
        parsed.estimated_max_model_len
        and parsed.refused_max_model_len
        and parsed.estimated_max_model_len < parsed.refused_max_model_len
    ):
        # A refused start: vLLM's estimate is (usable blocks) × block_size, usable = num_blocks − 1.
        num_blocks = parsed.estimated_max_model_len // block_size + 1
        pool_low, pool_high = num_blocks * bpb, (num_blocks + 1) * bpb - 1
        notes.append("calibrated from a refused start's estimated maximum model length")
    logged_kv_gib = parsed.available_kv_gib if backend == "cuda" else parsed.cpu_kv_gib
    if logged_kv_gib is not None:
        low, high = gib_interval(logged_kv_gib)
        if pool_low is None or pool_high is None:
            pool_low, pool_high = low, high
        elif max(pool_low, low) <= min(pool_high, high):
            pool_low, pool_high = max(pool_low, low), min(pool_high, high)
        else:
            notes.append(f"logged {logged_kv_gib} GiB disagrees with {num_blocks} blocks of {bpb} bytes")
    return num_blocks, pool_low, pool_high


def combine_calibrations(calibrations: Sequence[Calibration]) -> Calibration | None:
    """Merge several starts' calibrations of one configuration: the envelope of their non-KV ranges
    (it covers the start-to-start jitter seen so far) and the median of their midpoints as the point."""
    usable = [c for c in calibrations if c.non_kv_low is not None and c.non_kv_high is not None]
    if not usable:
        return calibrations[-1] if calibrations else None
    if len(usable) == 1:
        return usable[0]
    latest = usable[-1]
    lows = [c.non_kv_low for c in usable if c.non_kv_low is not None]
    highs = [c.non_kv_high for c in usable if c.non_kv_high is not None]
    mids = [c.non_kv_bytes for c in usable if c.non_kv_bytes is not None]
    return replace(
        latest,
        non_kv_low=min(lows),
        non_kv_high=max(highs),
        non_kv_bytes=int(statistics.median(mids)),
        samples=len(usable),
        notes=(*latest.notes, f"combined from {len(usable)} starts"),
    )


def calibration_key(model: ModelInfo, params: EngineParams, backend: Backend) -> str:
    """Store key: model identity, backend, and the parameters that change non-KV memory.

    Non-KV memory depends on the batch shape (max_num_seqs, max_num_batched_tokens → activation peak,
    sampler buffers, CUDA-graph sizes), chunked prefill (changes the batched-token default), CPU offload
    (weights leave the device), the serving dtype (the weights' size) and the block tables (max_num_seqs ×
    cdiv(max_model_len, block_size) int32 entries: 32 MiB at 1024 sequences of 128k tokens). Utilization
    and KV dtype only move the KV part, so starts at different utilizations share a key.
    """
    parts = [
        model.identity,
        backend,
        f"dtype={model.dtype}",
        f"len={params.max_model_len}",
        f"block={params.block_size}",
        f"seqs={params.max_num_seqs}",
        f"batched={params.max_num_batched_tokens}",
        f"chunked={params.enable_chunked_prefill}",
        f"offload={params.cpu_offload_gb}",
    ]
    return "|".join(str(p) for p in parts)


def pick_calibration(
    entries: Mapping[str, Sequence[Mapping[str, Any]]],
    model: ModelInfo,
    params: EngineParams,
    backend: Backend,
) -> Calibration | None:
    """From stored calibration records (key → records, oldest first): the combined calibration of this
    configuration, else the newest of the same model, backend and dtype (with a note saying so), else None."""
    key = calibration_key(model, params, backend)
    if entries.get(key):
        return combine_calibrations([Calibration.from_json(r) for r in entries[key]])
    prefix = f"{model.identity}|{backend}|dtype={model.dtype}|"
    others = [k for k in entries if k.startswith(prefix) and entries[k]]
    if not others:
        return None
    newest = max(others, key=lambda k: entries[k][-1].get("_stored_at", 0))
    cal = combine_calibrations([Calibration.from_json(r) for r in entries[newest]])
    if cal is None:
        return None
    return replace(cal, notes=(*cal.notes, f"from another configuration ({newest.split('|', 3)[3]})"))
