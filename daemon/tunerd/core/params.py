"""The engine parameters tunerd manages: typed vLLM flags, their argv form and backend constraints.

`EngineParams` holds only the flags a tuner may move. Everything else an operator wants on the command
line goes to `engine.extra_args` in the config and is passed through untouched. A field left at None is
not passed, so vLLM's own default applies.
"""

from __future__ import annotations

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


def default_block_size(backend: Backend, *, uses_mla: bool = False) -> int:
    """vLLM's block size when `--block-size` is not passed (`check_and_update_config` in vLLM's
    platforms/cpu.py and cuda.py, read in 0.32.0): CPU 128 (MLA 16), CUDA 16 (MLA 64)."""
    if backend == "cpu":
        return 16 if uses_mla else 128
    return 64 if uses_mla else 16


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
