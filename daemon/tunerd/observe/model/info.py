"""What the planner needs to know about a model, from its `config.json` alone (pure; no weights loaded).

`model_info_from_config()` turns already-read dicts into a `ModelInfo`, so unit tests feed it published
`config.json` files without weights. Reading a model directory (config.json, tokenizer_config.json, the
safetensors headers, a sharded checkpoint's `model.safetensors.index.json`) is the loader's job:
`tunerd.observe.model.directory.load_model_info`. Weight sizes and quantization: `model_weights`.

The architecture fields mirror how vLLM 0.32 derives them
(`vllm/transformers_utils/model_arch_config_convertor.py`, `ModelArchConfigConvertorBase`):
KV heads from `n_head_kv`/`num_kv_heads`/`num_key_value_heads`/`multi_query_group_num`/
`num_attention_groups`, else the attention heads (no grouped-query attention); head size from `head_dim`
(when > 0), else `hidden_size_per_head`, else `hidden_size // num_attention_heads`; for DeepSeek-style MLA
`kv_lora_rank + qk_rope_head_dim`. Architectures whose KV cache is not one uniform full-attention spec
(sliding-window, hybrid Mamba/linear attention, sparse-indexer MLA) get `kv_unavailable_reason` set: the
planner then says "estimate not available" instead of guessing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tunerd.core.model import AttentionKind, ModelInfo, WeightsInfo
from tunerd.observe.model.hf_config import config_dtype, first_key, resolve_serving_dtype, text_config
from tunerd.observe.model.weights import estimated_weights, parse_quantization

# vLLM's MLA model types whose KV cache is exactly one latent vector per token per layer
# (MLAAttentionSpec: 1 head, head_size kv_lora_rank + qk_rope_head_dim, no separate V). Other MLA types
# (deepseek_v32/v4 with a sparse indexer cache, hybrids) are reported as not estimable.
_PLAIN_MLA_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2"}

# Model types with Mamba / linear-attention / hybrid layers: their KV cache (state) is not per token.
_HYBRID_TYPES = {
    "mamba",
    "mamba2",
    "falcon_mamba",
    "jamba",
    "zamba",
    "zamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "lfm2_moe",
    "minimax_text_01",
    "minimax_m1",
    "plamo2",
    "kimi_linear",
    "bailing_hybrid",
    "rwkv",
    "recurrent_gemma",
}

# config.json keys vLLM tries, in order, for the model's maximum length (the smallest one wins).
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose `factor` is already folded into max_position_embeddings (vLLM _get_and_verify_max_len).
_ROPE_PRESCALED = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}


def derive_max_model_len(
    config: Mapping[str, Any], tokenizer_config: Mapping[str, Any] | None = None
) -> tuple[int | None, str]:
    """vLLM's derived maximum model length and the key it came from (`_get_and_verify_max_len`).

    The smallest of the known length keys; `model_max_length` in the config overrides; the tokenizer's
    `model_max_length` can only lower it; a RoPE scaling `factor` multiplies it unless the RoPE type already
    folds it in (yarn, llama3, longrope, …) or the model is Gemma 3. None when no key is present (vLLM then
    assumes 2048 and warns).
    """
    text = text_config(config)
    derived: float = math.inf
    key_used = ""
    for key in _MAX_LEN_KEYS:
        value = text.get(key)
        if isinstance(value, int | float) and value < derived:
            derived, key_used = value, key
    if isinstance(text.get("model_max_length"), int | float) and text["model_max_length"]:
        derived, key_used = text["model_max_length"], "model_max_length"
    if tokenizer_config and isinstance(tokenizer_config.get("model_max_length"), int | float):
        tok_limit = tokenizer_config["model_max_length"]
        if tok_limit < derived:
            derived, key_used = tok_limit, "tokenizer_config.model_max_length"
    if derived == math.inf:
        return None, "none (vLLM assumes 2048)"
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    model_type = str(text.get("model_type", config.get("model_type", "")))
    if isinstance(rope, Mapping) and "gemma3" not in model_type:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if rope_type not in _ROPE_PRESCALED and rope_type != "default" and isinstance(factor, int | float):
            derived *= factor
            key_used += f" × rope factor {factor}"
    return int(derived), key_used


def _attention_kind(text: Mapping[str, Any], model_type: str) -> tuple[AttentionKind, int | None, str | None]:
    """(kind, sliding window, reason the KV estimate is unavailable or None)."""
    layer_types = text.get("layer_types")
    if model_type in _HYBRID_TYPES or any(
        text.get(k) is not None
        for k in (
            "layers_block_type",
            "hybrid_override_pattern",
            "attn_layer_period",
            "full_attention_interval",
        )
    ):
        return (
            "hybrid",
            None,
            (
                f"{model_type or 'this model'} mixes attention with Mamba/linear-attention layers; their "
                "state is not a per-token KV cache"
            ),
        )
    if isinstance(layer_types, Sequence) and not isinstance(layer_types, str):
        kinds = set(layer_types)
        if kinds - {"full_attention", "sliding_attention", "chunked_attention"}:
            return "hybrid", None, f"layer types {sorted(kinds)} include non-attention layers"
        if kinds & {"sliding_attention", "chunked_attention"}:
            window = text.get("sliding_window") or text.get("attention_chunk_size")
            return (
                "sliding_window",
                window,
                (
                    f"sliding-window / chunked layers (window {window}): vLLM sizes them with the hybrid KV "
                    "cache manager, whose per-request block count depends on the batch size"
                ),
            )
    kv_lora_rank = text.get("kv_lora_rank")
    if kv_lora_rank:
        if model_type in _PLAIN_MLA_TYPES and not text.get("index_topk") and not text.get("compress_ratios"):
            return "mla", None, None
        return "mla", None, f"MLA variant {model_type!r} has extra (indexer / compressed) caches"
    window = text.get("sliding_window")
    use_window = text.get("use_sliding_window", True)
    if window and use_window is not False:
        return (
            "sliding_window",
            int(window),
            (
                f"sliding-window attention (window {window}): vLLM's per-request block count then depends on "
                "the batch size (SlidingWindowSpec)"
            ),
        )
    if text.get("attention_chunk_size"):
        return "sliding_window", None, "chunked local attention layers (ChunkedLocalAttentionSpec)"
    return "full", None, None


def model_identity(config_bytes: bytes, files: Mapping[str, int]) -> str:
    """A short stable id: SHA-256 of config.json's bytes and the weight files' names and sizes."""
    digest = hashlib.sha256(config_bytes)
    for name in sorted(files):
        digest.update(f"\0{name}\0{files[name]}".encode())
    return digest.hexdigest()[:16]


def _kv_geometry(
    text: Mapping[str, Any], attention: AttentionKind, heads: int, hidden: int
) -> tuple[int, int, str, bool]:
    """(KV heads, head size, where the head size came from, whether V is stored) of one attention layer."""
    if attention == "mla":
        # MLAAttentionSpec: one latent vector per token and layer, no separate V (head_size_v = 0).
        head_dim = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
        return 1, head_dim, "kv_lora_rank + qk_rope_head_dim (MLA latent)", False
    kv_heads = int(
        first_key(text, ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num"))
        or first_key(text, ("num_attention_groups",))
        or heads
    )
    if isinstance(text.get("head_dim"), int) and text["head_dim"] > 0:
        return kv_heads, int(text["head_dim"]), "head_dim", True
    if text.get("hidden_size_per_head"):
        return kv_heads, int(text["hidden_size_per_head"]), "hidden_size_per_head", True
    if heads:
        return kv_heads, hidden // heads, "hidden_size // num_attention_heads", True
    return kv_heads, 0, "unknown", True


def model_info_from_config(
    config: Mapping[str, Any],
    *,
    path: str = "",
    tokenizer_config: Mapping[str, Any] | None = None,
    weights: WeightsInfo | None = None,
    identity: str | None = None,
    dtype: str | None = None,
) -> ModelInfo:
    """Build a `ModelInfo` from a parsed `config.json` (pure), served in `dtype` (vLLM's `--dtype`; None
    or "auto": vLLM's choice). Without `weights`, the weight bytes are estimated from the dimensions
    where that is possible (dense models), else left None."""
    text = text_config(config)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    declared_dtype = config_dtype(config)
    serving = resolve_serving_dtype(declared_dtype, dtype)
    layers = int(text.get("num_hidden_layers") or text.get("n_layer") or text.get("num_layers") or 0)
    heads = int(first_key(text, ("num_attention_heads", "n_head")) or 0)
    hidden = int(first_key(text, ("hidden_size", "n_embd", "d_model")) or 0)
    attention, window, unavailable = _attention_kind(text, model_type)
    kv_heads, head_dim, head_dim_source, kv_values_stored = _kv_geometry(text, attention, heads, hidden)
    if not layers or not kv_heads or not head_dim:
        attention = "none" if attention == "full" else attention
        unavailable = unavailable or "config.json lacks layers / attention heads / head size"
    quant = parse_quantization(config)
    if weights is None:
        weights = estimated_weights(config, serving, quant)
    max_len, max_len_source = derive_max_model_len(config, tokenizer_config)
    return ModelInfo(
        path=path,
        identity=identity or model_identity(json.dumps(config, sort_keys=True).encode(), {}),
        model_type=model_type,
        architectures=tuple(config.get("architectures") or ()),
        dtype=serving,
        config_dtype=declared_dtype,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        head_dim_source=head_dim_source,
        hidden_size=hidden,
        vocab_size=text.get("vocab_size"),
        max_model_len=max_len,
        max_model_len_source=max_len_source,
        attention=attention,
        kv_values_stored=kv_values_stored,
        sliding_window=window,
        kv_unavailable_reason=unavailable,
        quantization=quant,
        weights=weights,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
    )
