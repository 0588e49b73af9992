"""What the planner knows about a model, as read from its directory (`tunerd.observe.model`).

`ModelInfo` (architecture, KV geometry, weights, quantization), the dtype sizes vLLM uses, and
`ModelInfoError` for a directory or config.json that cannot be read as a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Bytes per element of the dtype names used in config.json and by vLLM's --dtype / --kv-cache-dtype.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
}


class ModelInfoError(ValueError):
    """The model directory or one of its files cannot be read as a model."""


AttentionKind = Literal["full", "mla", "sliding_window", "hybrid", "none"]


@dataclass(frozen=True)
class QuantizationInfo:
    """The quantization a checkpoint declares (`quantization_config` / `compression_config`)."""

    method: str  # e.g. "awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes", "modelopt_fp4"
    bits: int | None = None
    group_size: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class WeightsInfo:
    """Weight sizes from the safetensors headers (or, without them, from the index file or the config).

    `checkpoint_bytes`: the tensors as stored. `loaded_bytes`: what vLLM holds after loading — for an
    unquantized checkpoint the floating-point tensors are cast to the serving dtype; quantized tensors stay as
    stored. `source` says where the figures came from; `exact` is False for anything but headers.
    """

    checkpoint_bytes: int
    loaded_bytes: int
    bytes_by_dtype: tuple[tuple[str, int], ...]
    num_parameters: int | None
    num_tensors: int
    files: tuple[str, ...]
    source: str
    exact: bool
    note: str = ""

    @property
    def by_dtype(self) -> dict[str, int]:
        return dict(self.bytes_by_dtype)


@dataclass(frozen=True)
class ModelInfo:
    """A model's architecture facts, as the planner uses them. Immutable; built by `model_info_from_config`.

    `num_kv_heads`/`head_dim` are what one attention layer stores per token (for MLA: 1 head of
    `kv_lora_rank + qk_rope_head_dim`, `kv_values_stored` False). `kv_unavailable_reason` is set when the
    KV cache is not one uniform full-attention spec; the planner then refuses to estimate KV figures.
    """

    path: str
    identity: str
    model_type: str
    architectures: tuple[str, ...]
    dtype: str  # serving dtype with --dtype auto (vLLM _resolve_auto_dtype: float32 → bfloat16)
    config_dtype: str | None
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_source: str
    hidden_size: int
    vocab_size: int | None
    max_model_len: int | None  # vLLM's derived maximum (config keys, tokenizer limit, RoPE factor)
    max_model_len_source: str
    attention: AttentionKind
    kv_values_stored: bool  # False for MLA (one latent vector, no separate V)
    sliding_window: int | None
    kv_unavailable_reason: str | None
    quantization: QuantizationInfo | None
    weights: WeightsInfo | None
    tie_word_embeddings: bool

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def uses_mla(self) -> bool:
        return self.attention == "mla"
