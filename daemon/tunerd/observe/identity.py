"""Facts about the engine that change only with an upgrade: vLLM's version, its flags, the driver, the model.

Each function does I/O and runs in a background thread; the main loop compares the results with what
the state file remembers (the upgrade guard) and decides. Nothing here raises: a fact that cannot be
read is None.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tunerd.observe.gpu import GpuCollector
from tunerd.observe.model.directory import model_fingerprint

HELP_TIMEOUT_S = 180.0  # `vllm serve --help` imports vLLM: 10-20 s on a small CPU


# Optional flags tunerd passes only where this vLLM's `--help` lists them (engine/launch.py):
# --enable-per-request-metrics (0.32+, PR #46768; refused with --disable-log-stats),
# --custom-histogram-buckets (0.32+), --enable-force-include-usage; --disable-log-stats is looked for too.
OPTIONAL_FLAGS = (
    "--shutdown-timeout",
    "--enable-per-request-metrics",
    "--custom-histogram-buckets",
    "--enable-force-include-usage",
)


@dataclass(frozen=True)
class Capabilities:
    """What the installed vLLM's command line offers (from `--help`, once per command): `flags` are
    those of OPTIONAL_FLAGS its help text names."""

    command: tuple[str, ...]
    shutdown_timeout: bool
    error: str | None = None
    flags: frozenset[str] = frozenset()


def flags_in_help(text: str) -> frozenset[str]:
    """The OPTIONAL_FLAGS that `--help` output `text` names (whole flags: `--x` is not found in `--x-y`)."""
    found = set()
    for flag in OPTIONAL_FLAGS:
        at = text.find(flag)
        while at >= 0:
            end = at + len(flag)
            if end == len(text) or not (text[end].isalnum() or text[end] in "-_"):
                found.add(flag)
                break
            at = text.find(flag, end)
    return frozenset(found)


@dataclass(frozen=True)
class EngineIdentity:
    """Versions and model identity seen at a start; compared across starts by the upgrade guard."""

    run_id: int
    facts: Mapping[str, Any]


def probe_capabilities(command: Sequence[str], env: Mapping[str, str]) -> Capabilities:
    """Run `command --help` (niced, bounded) and look for the flags tunerd can use.

    `nice` is in the argv rather than a `preexec_fn`: the daemon has threads, and code between fork and
    exec in a threaded process can deadlock (Python's subprocess docs). Niced so that it never competes
    with a vLLM that is starting.
    """
    nice = ["nice", "-n", "10"] if shutil.which("nice", path=env.get("PATH")) else []
    try:
        done = subprocess.run(
            [*nice, *command, "--help"],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=HELP_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Capabilities(tuple(command), False, f"{type(exc).__name__}: {exc}")
    text = done.stdout + done.stderr
    flags = flags_in_help(text)
    return Capabilities(
        tuple(command),
        "--shutdown-timeout" in flags,
        None if done.returncode == 0 else text[-200:],
        flags,
    )


def probe_identity(run_id: int, base_url: str, model: str) -> EngineIdentity:
    """vLLM's /version, the driver and CUDA versions (NVML), and the model's identity."""
    facts: dict[str, Any] = {"vllm_version": _vllm_version(base_url), "model": model_identity(model)}
    gpu = GpuCollector()
    info = gpu.info()
    gpu.close()
    facts["driver_version"] = info.driver_version
    facts["cuda_version"] = info.cuda_driver_version
    facts["gpu_name"] = info.devices[0].name if info.devices else None  # the tuning memory's hardware key
    return EngineIdentity(run_id, facts)


def _vllm_version(base_url: str) -> str | None:
    try:
        return str(httpx.get(f"{base_url}/version", timeout=5, trust_env=False).json().get("version"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def model_identity(model: str) -> dict[str, Any]:
    """The served model's identity: for a local directory the planner's fingerprint (config.json and
    the weight files' names and sizes: `observe.model.directory.model_fingerprint`); a repo id (not a
    directory) is identified by its name only."""
    path = Path(model)
    if not path.is_dir():
        return {"id": model}
    try:
        return {"path": str(path), "fingerprint": model_fingerprint(path)}
    except OSError:
        return {"path": str(path), "fingerprint": None}


def identity_changes(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> dict[str, Any]:
    """What differs between two identities ({} when nothing did, or there was none before)."""
    if not before:
        return {}
    return {
        key: {"before": before.get(key), "after": value}
        for key, value in after.items()
        if before.get(key) != value
    }
