"""What vLLM said about its memory while it started: the figures of its start-up log lines.

Gathered line by line by the engine's log reader (`tunerd.engine.logwatch.StartReportReader`, the one
grammar of vLLM's log lines); read by the planner's calibration. A field is None when its line was
absent; GiB figures are as logged (rounded to 2 decimals); the first occurrence of each line wins.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StartReport:
    """The start-up figures vLLM logged (vLLM 0.24 on GPU and 0.32 on CPU seen)."""

    device: str | None = None
    kv_cache_tokens: int | None = None
    kv_max_model_len: int | None = None
    max_concurrency: float | None = None
    available_kv_gib: float | None = None
    model_loading_gib: float | None = None
    cpu_kv_gib: float | None = None
    cpu_node_total_gib: float | None = None
    cpu_node: int | None = None
    cpu_requested_gib: float | None = None
    cpu_non_kv_gib: float | None = None
    cpu_kv_explicit: bool | None = None
    gpu_kv_explicit_gib: float | None = None
    refused_max_model_len: int | None = None
    estimated_max_model_len: int | None = None
    free_at_start_gib: float | None = None
    total_at_start_gib: float | None = None
    requested_at_start_gib: float | None = None
    vllm_version: str | None = None
