"""The preflight's page-cache step (unified memory, a large page cache before a start).

`drop_page_cache`: off | advise | fadvise (the default: posix_fadvise(DONTNEED) on the model's own files,
which needs no privilege) | drop (sync + /proc/sys/vm/drop_caches, which the kernel lets only uid 0 do:
refused, it says why in the journal and drops the model's own cache instead).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests.harness import REPO, free_port
from tunerd.config import ConfigError, load_config
from tunerd.core.machine import GpuFacts
from tunerd.core.params import EngineParams
from tunerd.engine.leftovers import LeftoverReaper
from tunerd.engine.oscalls import OsCalls
from tunerd.supervise import preflight as preflight_module
from tunerd.supervise.preflight import Preflight, fadvise_model_files

KIB = 1024
PAGE = mmap.PAGESIZE


def make_model(root: Path) -> Path:
    """A model directory as Hugging Face leaves one: files, a subdirectory, a symlink to a blob."""
    model = root / "model"
    (model / "tokenizer").mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "blobs" / "weights").write_bytes(os.urandom(64 * PAGE))
    (model / "model.safetensors").symlink_to(root / "blobs" / "weights")
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (model / "tokenizer" / "tokenizer.json").write_bytes(os.urandom(8 * PAGE))
    os.sync()
    return model


def make_preflight(tmp_path: Path, mode: str | None, *, unified: bool = True) -> Preflight:
    """A preflight over a fake /proc: 64 GiB total, 32 GiB of page cache (above the 10 % advice ratio)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(
        "MemTotal: 67108864 kB\nMemFree: 1000 kB\nMemAvailable: 62914560 kB\n"
        "Buffers: 0 kB\nCached: 33554432 kB\nShmem: 0 kB\n"
    )
    model = make_model(tmp_path)
    setting = "" if mode is None else f'drop_page_cache = "{mode}"\n'
    config_path = tmp_path / "tunerd.toml"
    config_path.write_text(
        f'[engine]\nmodel = "{model}"\nport = {free_port()}\n[observe]\nmemory_proc = "{proc}"\n'
        f"[preflight]\n{setting}"
    )
    oscalls = OsCalls(proc=str(proc))
    return Preflight(
        load_config(config_path),
        EngineParams(),
        oscalls=oscalls,
        marker="test-marker",
        reaper=LeftoverReaper(oscalls, "test-marker"),
        gate=None,
        gpu=lambda: GpuFacts(unified_memory=unified, free_bytes=100 << 30),
        plan_check=None,
        started=0.0,
    )


def page_cache_records(preflight: Preflight) -> list[dict[str, Any]]:
    step = preflight.step(0.5)
    assert step.clear
    return [r for r in step.records if r["event"].startswith("preflight.page_cache")]


@pytest.fixture
def full_drop(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """Replaces the host-wide drop (never done for real here: as root it would empty this machine's
    cache); `answer[0]` is what it returns, each call is counted in `answer[1:]`."""
    answer: list[str | None] = ["Permission denied"]

    def drop() -> str | None:
        answer.append("called")
        return answer[0]

    monkeypatch.setattr(preflight_module, "drop_page_cache", drop)
    return answer


def test_the_default_is_fadvise_on_the_models_own_files(tmp_path: Path, full_drop: list[str | None]) -> None:
    preflight = make_preflight(tmp_path, None)
    assert preflight.config.preflight.drop_page_cache == "fadvise"
    [record] = page_cache_records(preflight)
    assert record["event"] == "preflight.page_cache_fadvised"
    assert record["model"] == str(tmp_path / "model")
    assert record["files"] == 3  # config.json, tokenizer/tokenizer.json, the weights through the symlink
    assert record["file_bytes"] == 72 * PAGE + len('{"architectures": ["Qwen3ForCausalLM"]}')
    assert record["errors"] == []
    assert record["page_cache_bytes"] == 33554432 * KIB
    assert full_drop[1:] == [], "no host-wide drop was attempted"


def test_a_refused_full_drop_says_why_and_drops_the_models_own_cache(
    tmp_path: Path, full_drop: list[str | None]
) -> None:
    preflight = make_preflight(tmp_path, "drop")
    with structlog.testing.capture_logs() as logged:
        kept, fadvised = page_cache_records(preflight)
    assert full_drop[1:] == ["called"]
    assert kept["event"] == "preflight.page_cache_kept"
    assert kept["error"] == "Permission denied"
    assert kept["uid"] == os.geteuid()
    assert "only uid 0" in kept["reason"] and "/proc/sys/vm/drop_caches" in kept["reason"]
    assert "fadvise" in kept["reason"]
    assert fadvised["event"] == "preflight.page_cache_fadvised" and fadvised["files"] == 3
    [warning] = [entry for entry in logged if entry["event"] == "preflight.page_cache_kept"]
    assert warning["log_level"] == "warning" and warning["reason"] == kept["reason"]


def test_a_full_drop_that_works_is_journaled_alone(tmp_path: Path, full_drop: list[str | None]) -> None:
    full_drop[0] = None
    [record] = page_cache_records(make_preflight(tmp_path, "drop"))
    assert record["event"] == "preflight.page_cache_dropped" and record["error"] is None


def test_advise_only_advises(tmp_path: Path, full_drop: list[str | None]) -> None:
    [record] = page_cache_records(make_preflight(tmp_path, "advise"))
    assert record["event"] == "preflight.page_cache_advice"
    assert "fadvise" in record["advice"] and "drop_caches" in record["advice"]
    assert full_drop[1:] == []


def test_off_does_nothing(tmp_path: Path, full_drop: list[str | None]) -> None:
    assert page_cache_records(make_preflight(tmp_path, "off")) == []


def test_without_unified_memory_the_page_cache_is_left_alone(
    tmp_path: Path, full_drop: list[str | None]
) -> None:
    assert page_cache_records(make_preflight(tmp_path, "drop", unified=False)) == []
    assert full_drop[1:] == []


@pytest.mark.parametrize(("value", "mode"), [("true", "drop"), ("false", "advise")])
def test_the_old_booleans_still_load(tmp_path: Path, value: str, mode: str) -> None:
    config = tmp_path / "tunerd.toml"
    config.write_text(f'[engine]\nmodel = "m"\n[preflight]\ndrop_page_cache = {value}\n')
    assert load_config(config).preflight.drop_page_cache == mode


def test_an_unknown_mode_is_an_error_naming_the_modes(tmp_path: Path) -> None:
    config = tmp_path / "tunerd.toml"
    config.write_text('[engine]\nmodel = "m"\n[preflight]\ndrop_page_cache = "yes"\n')
    with pytest.raises(ConfigError) as error:
        load_config(config)
    [problem] = error.value.problems
    assert "preflight.drop_page_cache" in problem
    assert all(f"'{mode}'" in problem for mode in ("off", "advise", "fadvise", "drop"))


def test_a_model_that_is_not_a_directory_is_named(tmp_path: Path) -> None:
    result = fadvise_model_files(str(tmp_path / "Qwen/Qwen3-0.6B"))
    assert result["files"] == 0 and "not a local directory" in result["errors"][0]


def test_an_unreadable_file_is_named_and_the_rest_advised(tmp_path: Path) -> None:
    model = make_model(tmp_path)
    (model / "dangling").symlink_to(tmp_path / "gone")
    result = fadvise_model_files(str(model))
    assert result["files"] == 3
    assert result["errors"] == [f"{model / 'dangling'}: No such file or directory"]


# -- the kernel's side: what fadvise drops, and who may drop everything -------------------------------


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore(2) over a shared mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    with open(path, "rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vector = (ctypes.c_ubyte * pages)()
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vector)
        finally:
            libc.munmap(address, size)


def filesystem_type(path: Path) -> str:
    best, kind = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point, fs = fields[4], fields[fields.index("-") + 1]
        if str(path).startswith(mount_point.rstrip("/") + "/") and len(mount_point) >= len(best):
            best, kind = mount_point, fs
    return kind


def test_fadvise_empties_the_page_cache_of_the_models_files(tmp_path: Path) -> None:
    if filesystem_type(tmp_path) in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{tmp_path} is on {filesystem_type(tmp_path)}: its pages are not page cache to drop")
    model = make_model(tmp_path)
    weights = tmp_path / "blobs" / "weights"
    weights.read_bytes()  # now cached
    assert resident_pages(weights) == 64
    result = fadvise_model_files(str(model))
    assert result["errors"] == []
    assert resident_pages(weights) == 0
    assert resident_pages(model / "tokenizer" / "tokenizer.json") == 0


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop privilege")
def test_the_kernel_refuses_a_full_drop_to_a_non_root_user_even_with_cap_sys_admin(tmp_path: Path) -> None:
    """Why `drop` needs uid 0 and not a capability: /proc/sys checks the uid against the file's mode."""
    if os.geteuid() != 0:
        users = []  # already unprivileged: try as we are
    else:
        for needed in (REPO, Path(sys.prefix)):  # the package and its dependencies, as uid 65534
            if not all(p.stat().st_mode & 0o001 for p in (needed, *needed.parents)):
                pytest.skip(f"uid 65534 cannot reach {needed} (a directory above it is not o+x)")
        users = ["--reuid=65534", "--regid=65534", "--clear-groups"]
        users += ["--inh-caps=+sys_admin", "--ambient-caps=+sys_admin"]
    script = (
        "import json, os; from tunerd.supervise.preflight import drop_page_cache;"
        "print(json.dumps([os.geteuid(), open('/proc/self/status').read(), drop_page_cache()]))"
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO / "daemon")}
    result = subprocess.run(
        ["setpriv", *users, sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    if os.geteuid() == 0 and "Operation not permitted" in result.stderr:
        pytest.skip(f"cannot drop to uid 65534 with CAP_SYS_ADMIN here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    uid, status, error = json.loads(result.stdout)
    assert uid != 0
    if os.geteuid() == 0:
        effective = next(line for line in status.splitlines() if line.startswith("CapEff:"))
        assert int(effective.split()[1], 16) & (1 << 21), "CAP_SYS_ADMIN (21) was effective"
    assert error in ("Permission denied", "Read-only file system")
