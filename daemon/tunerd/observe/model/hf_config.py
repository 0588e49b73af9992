"""Reading a Hugging Face `config.json` (already parsed) the way vLLM 0.32 does: the language-model
sub-config, the dtype names and the serving dtype. Pure; shared by `model_info` and `model_weights`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunerd.core.model import DTYPE_BYTES


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a (possibly multimodal) config, like vLLM's `hf_text_config`."""
    for key in ("text_config", "llm_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, Mapping) and sub.get("num_hidden_layers"):
            return sub
    return config


def first_key(cfg: Mapping[str, Any], keys: Sequence[str]) -> Any:
    """The value of the first of `keys` that `cfg` has (not None), else None."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def normalize_dtype(value: Any) -> str | None:
    """A config dtype ("torch.bfloat16", "half", "bf16" …) as a `DTYPE_BYTES` name; None stays None."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.").lower()
    return {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The dtype the config declares (`dtype`, else `torch_dtype`; top level first, then the text part)."""
    return normalize_dtype(
        first_key(config, ("dtype", "torch_dtype"))
        or first_key(text_config(config), ("dtype", "torch_dtype"))
    )


def resolve_serving_dtype(config_dtype: str | None, requested: str | None = None) -> str:
    """The dtype vLLM serves in: `requested` (its `--dtype`) when it names one, else what `--dtype auto`
    picks.

    vLLM `_resolve_auto_dtype`: a float32 (or missing, which vLLM reads as float32) config dtype is
    downcast to the platform's preferred dtype, bfloat16 on current GPUs and x86 CPUs.
    """
    requested = normalize_dtype(requested)
    if requested in DTYPE_BYTES:
        return requested
    if config_dtype in (None, "float32", "float64"):
        return "bfloat16"
    if config_dtype not in DTYPE_BYTES:
        return "bfloat16"
    return config_dtype
