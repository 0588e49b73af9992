"""Disk full under the journal: no change is applied without a durable intent, supervision goes on with
the parameters in force, and the error is visible (reliability.md, after PostgreSQL's fsync policy)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Daemon, running_daemon, wait_until
from tests.integration.conftest import fake_sections
from tests.integration.test_safe_restarts import restart


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a journal on it can be made to hit ENOSPC on demand."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"disk-full scenario needs a tmpfs mount, which this machine refuses: {mounted.stderr.strip()}"
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 512):
            pass
    except OSError:  # ENOSPC: full
        pass
    finally:
        os.close(fd)
    return filler


def refused_changes(daemon: Daemon) -> int:
    """How many times the daemon logged that it refused a change it could not make durable."""
    return daemon.stderr_path.read_text().count('"change.refused"')


def test_full_disk_freezes_changes_but_not_supervision(workdir: Path, small_filesystem: Path) -> None:
    sections = fake_sections(workdir, paths={"journal": str(small_filesystem / "journal.jsonl")})
    with running_daemon(workdir, sections) as daemon:
        daemon.journal_path = small_filesystem / "journal.jsonl"
        daemon.wait_state("RUNNING")
        pid = daemon.status()["engine"]["pid"]
        filler = fill(small_filesystem)
        for _ in range(100):  # records still fit in the journal's last page: use it up with reloads
            if daemon.status()["daemon"]["journal_error"] is not None:
                break
            reloads = daemon.events().count("config.reloaded")
            daemon.signal(signal.SIGHUP)
            wait_until(
                lambda reloads=reloads: (
                    daemon.status()["daemon"]["journal_error"] is not None
                    or daemon.events().count("config.reloaded") > reloads
                ),
                30,
                "the reload to be journaled, or its record to fail",
            )
        assert daemon.status()["daemon"]["journal_error"] is not None

        errors = daemon.metric("tunerd_journal_write_errors_total")
        refusals = refused_changes(daemon)
        restart(daemon, max_num_seqs=4)  # a change: needs a durable intent, which cannot be written
        wait_until(lambda: refused_changes(daemon) > refusals, 30, "the daemon to refuse the change")
        engine = daemon.status()["engine"]
        assert (engine["state"], engine["pid"]) == ("RUNNING", pid), "no change without a durable intent"
        assert "max_num_seqs" not in engine["params"]
        assert errors is not None and daemon.metric("tunerd_journal_write_errors_total") > errors, (
            "the intent that could not be written is counted"
        )

        os.kill(pid, signal.SIGKILL)  # a crash: supervision goes on with the parameters in force
        wait_until(
            lambda: (
                daemon.status()["engine"]["pid"] not in (None, pid)
                and daemon.status()["engine"]["state"] == "RUNNING"
            ),
            30,
            "the restart after the crash",
        )
        assert "max_num_seqs" not in daemon.status()["engine"]["params"]

        filler.unlink()
        restart(daemon, max_num_seqs=4)  # space again: the change is durable and applied
        wait_until(
            lambda: (
                daemon.status()["engine"]["params"].get("max_num_seqs") == 4
                and daemon.status()["engine"]["state"] == "RUNNING"
            ),
            30,
            "the trial once the disk has room",
        )
        assert daemon.status()["daemon"]["journal_error"] is None
