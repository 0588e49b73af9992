"""Facts about the engine that change only with an upgrade: vLLM's version, its flags, the driver, the model.

Each function does I/O and runs in a background thread; the main loop compares the results with what
the state file remembers (the upgrade guard) and decides. Nothing here raises: a fact that cannot be
read is None.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tunerd.observe.gpu import GpuCollector

HELP_TIMEOUT_S = 180.0  # `vllm serve --help` imports vLLM: 10-20 s on a small CPU


@dataclass(frozen=True)
class Capabilities:
    """What the installed vLLM's command line offers (from `--help`, once per command)."""

    command: tuple[str, ...]
    shutdown_timeout: bool
    error: str | None = None


@dataclass(frozen=True)
class EngineIdentity:
    """Versions and model identity seen at a start; compared across starts by the upgrade guard."""

    run_id: int
    facts: Mapping[str, Any]


def probe_capabilities(command: Sequence[str], env: Mapping[str, str]) -> Capabilities:
    """Run `command --help` (niced, bounded) and look for the flags tunerd can use."""
    try:
        done = subprocess.run(
            [*command, "--help"],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=HELP_TIMEOUT_S,
            preexec_fn=lambda: os.nice(10),  # never compete with a vLLM that is starting
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Capabilities(tuple(command), False, f"{type(exc).__name__}: {exc}")
    text = done.stdout + done.stderr
    return Capabilities(
        tuple(command), "--shutdown-timeout" in text, None if done.returncode == 0 else text[-200:]
    )


def probe_identity(run_id: int, base_url: str, model: str) -> EngineIdentity:
    """vLLM's /version, the driver and CUDA versions (NVML), and the model's identity."""
    facts: dict[str, Any] = {"vllm_version": _vllm_version(base_url), "model": model_identity(model)}
    gpu = GpuCollector()
    info = gpu.info()
    gpu.close()
    facts["driver_version"] = info.driver_version
    facts["cuda_version"] = info.cuda_driver_version
    return EngineIdentity(run_id, facts)


def _vllm_version(base_url: str) -> str | None:
    try:
        return str(httpx.get(f"{base_url}/version", timeout=5, trust_env=False).json().get("version"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def model_identity(model: str) -> dict[str, Any]:
    """A model directory's fingerprint: config.json's hash and the weight files' total size.

    Cheap (no weights read): a changed config or a re-downloaded checkpoint of another size shows; a
    repo id (not a directory) is identified by its name only.
    """
    path = Path(model)
    if not path.is_dir():
        return {"id": model}
    identity: dict[str, Any] = {"path": str(path)}
    try:
        identity["config_sha256"] = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        identity["config_sha256"] = None
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")]
    identity["weights_bytes"] = sum(p.stat().st_size for p in weights if p.is_file())
    return identity


def identity_changes(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> dict[str, Any]:
    """What differs between two identities ({} when nothing did, or there was none before)."""
    if not before:
        return {}
    return {
        key: {"before": before.get(key), "after": value}
        for key, value in after.items()
        if before.get(key) != value
    }
