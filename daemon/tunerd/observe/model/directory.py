"""Read a local model directory into a `ModelInfo`: config.json, tokenizer_config.json and the JSON headers
of the safetensors files (the I/O edge of `tunerd.observe.model.info`; nothing here loads weights).

A safetensors file starts with an 8-byte little-endian header length, then the JSON header with each
tensor's dtype and shape; only those bytes are read. Sharded checkpoints are found through
`model.safetensors.index.json`; when some shards are missing, its `metadata.total_size` stands in.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

from tunerd.core.model import ModelInfo, ModelInfoError, QuantizationInfo, WeightsInfo
from tunerd.observe.model.hf_config import config_dtype, resolve_serving_dtype
from tunerd.observe.model.info import model_identity, model_info_from_config
from tunerd.observe.model.weights import parse_quantization, weights_from_headers

# The safetensors format caps the header at 100 MB; anything larger is not a safetensors file.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of one safetensors file; reads 8 + header-length bytes, never the tensor data.

    Raises `ModelInfoError` (a `ValueError`) for a file that is not safetensors, OSError if unreadable.
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ModelInfoError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES:
            raise ModelInfoError(f"{path}: header length {length} is not plausible")
        raw = f.read(length)
    if len(raw) != length:
        raise ModelInfoError(f"{path}: header truncated ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ModelInfoError(f"{path}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelInfoError(f"{path}: header is not a JSON object")
    return header


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's content, None if it does not exist; `ModelInfoError` if unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise ModelInfoError(f"{path}: {exc}") from exc


def _read_config(root: Path) -> tuple[dict[str, Any], bytes]:
    """(parsed config.json, its bytes). `ModelInfoError` with a one-line reason when it can't be read."""
    config_path = root / "config.json"
    try:
        config_bytes = config_path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        raise ModelInfoError(f"{root}: no config.json (is this a model directory?)") from None
    except OSError as exc:
        raise ModelInfoError(f"{config_path}: {exc.strerror or exc}") from exc
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelInfoError(f"{config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelInfoError(f"{config_path}: not a JSON object")
    return config, config_bytes


def _weight_files(model_dir: Path) -> tuple[list[str], dict[str, Any] | None]:
    """The safetensors files vLLM would load, and the index file's content if there is one.

    With `model.safetensors.index.json` only the files its `weight_map` names count (vLLM filters by the
    index too, so stray files such as Mistral's `consolidated.safetensors` are skipped).
    """
    index = _read_json(model_dir / "model.safetensors.index.json")
    if index is not None:
        weight_map = index.get("weight_map") or {}
        return sorted(set(weight_map.values())), index
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if len(files) > 1:
        files = [f for f in files if not f.startswith("consolidated")] or files
    return files, None


def _read_weights(
    root: Path,
    files: list[str],
    index: dict[str, Any] | None,
    serving_dtype: str,
    quant: QuantizationInfo | None,
) -> WeightsInfo | None:
    """Weights from the headers when every file is present; else the index's total size; else None."""
    present = [name for name in files if (root / name).is_file()]
    missing = len(files) - len(present)
    if present and not missing:
        try:
            headers = {name: read_safetensors_header(root / name) for name in files}
        except OSError as exc:
            raise ModelInfoError(f"{exc.filename or root}: {exc.strerror or exc}") from exc
        weights = weights_from_headers(headers, serving_dtype, quantized=quant is not None)
        if index is not None:
            weights = replace(weights, source=f"safetensors headers of {len(files)} shards (index file)")
        return weights
    if index is not None and isinstance((index.get("metadata") or {}).get("total_size"), int):
        total = int(index["metadata"]["total_size"])
        return WeightsInfo(
            checkpoint_bytes=total,
            loaded_bytes=total,
            bytes_by_dtype=(),
            num_parameters=None,
            num_tensors=len(index.get("weight_map") or {}),
            files=tuple(files),
            source="index file metadata.total_size",
            exact=False,
            note=f"{missing} of {len(files)} shards missing; no per-dtype figures",
        )
    return None


def load_model_info(model_dir: str | Path, *, dtype: str | None = None) -> ModelInfo:
    """Read a local model directory into a `ModelInfo` (config.json + safetensors headers only), served
    in `dtype` (vLLM's `--dtype`; None or "auto": the dtype vLLM picks from the config).

    Raises `ModelInfoError` with a one-line reason (naming the path) when the directory, its config or a
    weight header can't be read. Without readable weights the size is estimated from the config.
    """
    root = Path(model_dir)
    config, config_bytes = _read_config(root)
    tokenizer_config = _read_json(root / "tokenizer_config.json")
    quant = parse_quantization(config)
    serving = resolve_serving_dtype(config_dtype(config), dtype)
    files, index = _weight_files(root)
    weights = _read_weights(root, files, index, serving, quant)
    return model_info_from_config(
        config,
        path=str(root),
        tokenizer_config=tokenizer_config,
        weights=weights,
        identity=model_identity(config_bytes, _file_sizes(root, files)),
        dtype=dtype,
    )


def model_fingerprint(model_dir: str | Path) -> str:
    """The model's identity (`ModelInfo.identity`): config.json's bytes and the weight files' names and
    sizes, hashed; no weights are read. Raises OSError when config.json can't be read."""
    root = Path(model_dir)
    files, _ = _weight_files(root)
    return model_identity((root / "config.json").read_bytes(), _file_sizes(root, files))


def _file_sizes(root: Path, files: list[str]) -> dict[str, int]:
    return {name: (root / name).stat().st_size for name in files if (root / name).is_file()}
