"""Fixtures every tier shares."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

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
# daemons and their ordering, conftest._engine_order; the system tier's one nspawn container), and two
# copies of them on a 2-core box would only fight. `--dist loadgroup` (scripts/test.sh) runs each group on
# one worker, in collection order, beside the rest of the suite on the other.
XDIST_GROUPS = {"engine": REPO / "tests" / "engine", "system": REPO / "tests" / "system"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        for group, root in XDIST_GROUPS.items():
            if path.is_relative_to(root):
                item.add_marker(pytest.mark.xdist_group(group))


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
