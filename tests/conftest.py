"""Fixtures every tier shares."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from tests.harness import REPO


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 of vllm-facts.md (2 layers, 2 KV heads, head_dim 32: 512 bytes of KV cache per
    token), written once per session by `scripts/make-tiny-model.py`. Tests only read it."""
    target = tmp_path_factory.mktemp("models") / "qwen3-tiny"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make-tiny-model.py"), str(target)],
        check=True,
        capture_output=True,
    )
    return target


# -- parallel runs (pytest-xdist) and the figures tests print --------------------------------------------

# Tests that must share one worker: each tier's session fixtures are one real thing (the engine tier's vLLM
# daemons and their order, tests/engine/conftest._engine_order; the system tier's one nspawn container),
# and two copies of them on a 2-core box would only fight. Under `-n 2` (scripts/test.sh) each of these
# tiers runs on one worker, in collection order, beside the rest of the suite spread over both.
# (A scheduler by path, not xdist's `xdist_group` marks: pytest 9.2 derives `nodeid` from `_id`, so
# xdist 3.8's loadgroup, which renames `_nodeid`, no longer groups anything.)
# The first prefix that matches names a test's group: the planner's own starts (4 partial vLLM starts that
# need no other test) and the goodput story (one daemon of its own) run beside the rest of the engine tier,
# not after it.
WORKER_GROUPS = (
    "tests/engine/test_planner_vs_vllm.py",
    "tests/engine/test_real_vllm_goodput.py",  # a daemon of its own, self-calibrated: runs beside the tier
    "tests/engine/",
    "tests/system/",
)


class TierScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with one scope per group of WORKER_GROUPS and one per test elsewhere. Scopes
    go out largest first (by test count: the system tier, the engine tier, the planner's starts), and a
    worker gets more only when it has 2 tests or fewer left, so the two tiers start at once on the two
    workers."""

    def _split_scope(self, nodeid: str) -> str:
        return next((group for group in WORKER_GROUPS if nodeid.startswith(group)), nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> TierScheduling | None:
    """Under `-n N` (xdist's default `--dist load`), schedule by tier; another `--dist` is left as asked."""
    return TierScheduling(config, log) if config.getvalue("dist") == "load" else None


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`figures(text)`: keep what a test measured (a spread, a table) for the run's summary. It travels
    with the test's report, so it is shown under parallel workers too, where a test's own print is not."""
    return lambda text: request.node.user_properties.append(("figures", text))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    kept = [
        (report.nodeid, text)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, text in getattr(report, "user_properties", ())
        if name == "figures"
    ]
    if kept:
        terminalreporter.section("figures measured in this run")
        for nodeid, text in kept:
            terminalreporter.write_line(f"{nodeid}:\n{text.strip()}\n")
