"""Weight sizes and declared quantization of a checkpoint, from its config and safetensors headers (pure).

The loader (`tunerd.observe.model.directory`) reads the JSON headers of the safetensors files — 8-byte
little-endian header length, then the JSON header with each tensor's dtype and shape; the tensor data is
never read — and hands them to `weights_from_headers`. Without headers, `estimated_weights` derives the
size of a dense decoder from the config's dimensions, labelled as an estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tunerd.core.model import DTYPE_BYTES, ModelInfoError, QuantizationInfo, WeightsInfo
from tunerd.observe.model.hf_config import first_key, text_config

# Bits per element of every safetensors dtype (safetensors `Dtype`; F4/F6 are packed sub-byte types).
SAFETENSORS_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
# Floating-point dtypes vLLM casts to the serving dtype when it loads an unquantized checkpoint.
_CASTABLE_FLOAT = {"F16", "BF16", "F32", "F64"}


def parse_quantization(config: Mapping[str, Any]) -> QuantizationInfo | None:
    """The declared quantization, from `quantization_config` (or `compression_config`), top level first.

    Mirrors `_normalize_quantization_config`: `quant_method` lower-cased, `compressed_tensors` spelled
    `compressed-tensors`, ModelOpt's `quant_algo` mapped to `modelopt` / `modelopt_fp4`.
    """
    quant = None
    for cfg in (config, text_config(config)):
        quant = cfg.get("quantization_config") or cfg.get("compression_config")
        if isinstance(quant, Mapping):
            break
    if not isinstance(quant, Mapping):
        return None
    method = str(quant.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    algo = (
        quant.get("quantization", {}).get("quant_algo")
        if isinstance(quant.get("quantization"), Mapping)
        else None
    )
    algo = algo or quant.get("quant_algo")
    if not method and algo:
        method = "modelopt_fp4" if str(algo).upper() == "NVFP4" else "modelopt"
    bits = quant.get("bits", quant.get("w_bit", quant.get("num_bits")))
    group_size = quant.get("group_size", quant.get("q_group_size"))
    detail = ""
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        for group in groups.values() if isinstance(groups, Mapping) else []:
            weights = group.get("weights") or {}
            bits = bits or weights.get("num_bits")
            group_size = group_size or weights.get("group_size")
            if weights.get("type"):
                detail = f"weights {weights.get('type')}"
            break
        if quant.get("format"):
            detail = ", ".join(x for x in (str(quant["format"]), detail) if x)
    elif method == "bitsandbytes":
        bits = 4 if quant.get("load_in_4bit") else 8 if quant.get("load_in_8bit") else bits
    elif method == "fp8":
        bits = bits or 8
        if quant.get("weight_block_size"):
            detail = f"block {quant['weight_block_size']}"
    elif method in ("modelopt", "modelopt_fp4") or algo:
        detail = f"algo {algo}" if algo else ""
        bits = bits or (4 if method == "modelopt_fp4" or str(algo).upper() == "NVFP4" else 8)
    elif method == "mxfp4":
        bits = bits or 4
    return QuantizationInfo(
        method=method or "unknown",
        bits=int(bits) if isinstance(bits, int | float) else None,
        group_size=int(group_size) if isinstance(group_size, int | float) else None,
        detail=detail,
    )


def estimate_parameters(config: Mapping[str, Any]) -> tuple[int | None, str]:
    """Parameter count of a dense decoder from its dimensions, or (None, why not).

    Used only when no safetensors headers are available. Counts embeddings (and an untied LM head),
    Q/K/V/O projections (with biases for Qwen2-style `qkv_bias`/`attention_bias`), a gated MLP of
    `intermediate_size`, the two RMSNorms per layer (plus Qwen3's per-head q/k norms) and the final norm.
    """
    text = text_config(config)
    if any(text.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")):
        return None, "mixture-of-experts: not estimated from the config"
    try:
        hidden = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        vocab = int(text["vocab_size"])
        intermediate = int(text["intermediate_size"])
    except (KeyError, TypeError, ValueError):
        return None, "config lacks the dimensions for an estimate"
    kv_heads = int(first_key(text, ("num_key_value_heads", "num_kv_heads", "n_head_kv")) or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    model_type = str(text.get("model_type", ""))
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * q + 2 * hidden * kv + q * hidden
    if text.get("attention_bias") or text.get("qkv_bias") or model_type == "qwen2":
        attn += q + 2 * kv
    norms = 2 * hidden + (2 * head_dim if model_type in ("qwen3", "qwen3_moe") else 0)
    per_layer = attn + 3 * hidden * intermediate + norms
    embeddings = (
        vocab * hidden * (1 if text.get("tie_word_embeddings", config.get("tie_word_embeddings")) else 2)
    )
    return layers * per_layer + embeddings + hidden, "estimated from config dimensions (dense decoder)"


def tensor_bytes(entry: Mapping[str, Any]) -> tuple[int, int]:
    """(bytes, elements) of one safetensors header entry, from its dtype and shape."""
    dtype = entry.get("dtype")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        raise ModelInfoError(f"unknown safetensors dtype {dtype!r}")
    numel = math.prod(int(d) for d in entry.get("shape", []))
    return (numel * SAFETENSORS_DTYPE_BITS[dtype] + 7) // 8, numel


def weights_from_headers(
    headers: Mapping[str, Mapping[str, Any]], serving_dtype: str, quantized: bool
) -> WeightsInfo:
    """Sum the tensors of the given safetensors headers (file name → parsed header), dtype by dtype."""
    by_dtype: dict[str, int] = {}
    numel_by_dtype: dict[str, int] = {}
    count = 0
    for header in headers.values():
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            nbytes, numel = tensor_bytes(entry)
            by_dtype[entry["dtype"]] = by_dtype.get(entry["dtype"], 0) + nbytes
            numel_by_dtype[entry["dtype"]] = numel_by_dtype.get(entry["dtype"], 0) + numel
            count += 1
    checkpoint = sum(by_dtype.values())
    if quantized:
        loaded = checkpoint
    else:
        size = DTYPE_BYTES[serving_dtype]
        loaded = sum(numel_by_dtype[d] * size if d in _CASTABLE_FLOAT else by_dtype[d] for d in by_dtype)
    return WeightsInfo(
        checkpoint_bytes=checkpoint,
        loaded_bytes=loaded,
        bytes_by_dtype=tuple(sorted(by_dtype.items())),
        num_parameters=sum(numel_by_dtype.values()),
        num_tensors=count,
        files=tuple(sorted(headers)),
        source="safetensors headers",
        exact=True,
    )


def estimated_weights(
    config: Mapping[str, Any], serving_dtype: str, quant: QuantizationInfo | None
) -> WeightsInfo | None:
    """Weight bytes of a dense decoder from the config's dimensions (`estimate_parameters`), every weight
    at the quantized width when the config declares one, else the serving dtype; None for MoE models or
    configs without the dimensions."""
    params, how = estimate_parameters(config)
    if params is None:
        return None
    bits = quant.bits if quant and quant.bits else DTYPE_BYTES[serving_dtype] * 8
    nbytes = params * bits // 8
    return WeightsInfo(
        checkpoint_bytes=nbytes,
        loaded_bytes=nbytes,
        bytes_by_dtype=(),
        num_parameters=params,
        num_tensors=0,
        files=(),
        source=how,
        exact=False,
        note="no safetensors headers read"
        + ("; every weight counted at the quantized width, scales not counted" if quant else ""),
    )
