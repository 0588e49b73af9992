"""vLLM's output logs stay bounded (issue 20): a size cap per run with rotated copies, a limit on the
runs kept, and every line still read once — the line that says why vLLM died included."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.harness import free_port
from tests.unit.fakes import FIXED_WALL, EngineScript, FakeOsCalls, make_rig
from tunerd.config import Config
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.engine.logfiles import BoundedLogFollower, LogCap, collapse_range, prune_runs
from tunerd.engine.logwatch import classify_line
from tunerd.engine.process import Engine, TreeGone

CAP = 64 * 1024
ACCESS = 'INFO:     127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK'
FATAL = "(EngineCore_DP0 pid=2712) ERROR EngineCore encountered a fatal error."


class Writer:
    """vLLM's side: its own O_APPEND descriptor on the log, as `OsCalls.spawn` opens it."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self.count = 0

    def lines(self, n: int) -> list[str]:
        out = [f"{ACCESS} #{self.count + i}" for i in range(n)]
        os.write(self.fd, "".join(line + "\n" for line in out).encode())
        self.count += n
        return out

    def raw(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> None:
        os.close(self.fd)


def collapse_works(directory: Path) -> bool:
    """Whether this filesystem cuts a file's head in place (ext4, XFS); tmpfs and btrfs do not."""
    probe = directory / "probe"
    probe.write_bytes(b"x" * 3 * os.statvfs(directory).f_bsize)
    fd = os.open(probe, os.O_RDWR)
    try:
        collapse_range(fd, os.statvfs(directory).f_bsize)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def unsupported(_fd: int, _length: int) -> None:
    raise OSError(errno.EOPNOTSUPP, "Operation not supported")


@pytest.fixture(params=["collapse", "copytruncate"])
def follower(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[BoundedLogFollower, Writer]]:
    """A follower bounding a log at CAP, one copy kept, by either method (both are used in the field)."""
    path = tmp_path / "engine-1.log"
    if request.param == "collapse":
        if not collapse_works(tmp_path):
            pytest.skip("this filesystem has no FALLOC_FL_COLLAPSE_RANGE")
        bounded = BoundedLogFollower(path, LogCap(CAP, backups=1))
    else:
        bounded = BoundedLogFollower(path, LogCap(CAP, backups=1), collapse=unsupported)
    writer = Writer(path)
    yield bounded, writer
    writer.close()


def test_a_writer_crossing_the_cap_is_rotated_and_every_line_is_read_once_in_order(
    follower: tuple[BoundedLogFollower, Writer],
) -> None:
    bounded, writer = follower
    written: list[str] = []
    read: list[str] = []
    for _ in range(40):  # 40 x 200 lines x ~75 bytes: ~600 KB, ten times the cap
        written += writer.lines(200)
        read += bounded.read_lines()
        assert os.path.getsize(bounded.path) <= CAP + 200 * 80  # the cap plus one tick's output
    assert read == written
    assert bounded.rotations >= 5
    copy = Path(bounded.rotated_path(1))
    assert copy.exists() and not Path(bounded.rotated_path(2)).exists()  # one copy kept
    assert os.path.getsize(copy) <= CAP + 200 * 80 + os.statvfs(copy.parent).f_bsize
    # The copy and the live file are the newest output, contiguous: the copy ends where the file begins.
    both = (copy.read_bytes() + Path(bounded.path).read_bytes()).decode()
    assert both.endswith("".join(line + "\n" for line in written[-800:]))  # ~60 KB: no gap, no repeat


def test_the_fatal_line_written_as_the_cap_is_crossed_is_classified_and_kept(
    follower: tuple[BoundedLogFollower, Writer],
) -> None:
    """vLLM's last words: the line crossing the cap and an unterminated last line, read at its exit."""
    bounded, writer = follower
    writer.lines(CAP // 70)
    assert bounded.read_lines()
    writer.raw(f"{FATAL}\n{ACCESS} (half")  # crosses the cap; the second line never ends
    tail = bounded.read_rest()
    assert tail[-2:] == [FATAL, f"{ACCESS} (half"]
    assert bounded.rotations == 1
    assert classify_line(tail[-2]) == EngineFailure(FailureKind.ENGINE_DEAD, FATAL)
    kept = Path(bounded.rotated_path(1)).read_text() + Path(bounded.path).read_text()
    assert FATAL + "\n" in kept  # whichever file it ended up in, the operator finds it


def test_lines_written_while_the_log_rotates_are_read_not_truncated_away(tmp_path: Path) -> None:
    """copytruncate: vLLM's fatal line lands after the follower's read, before the truncate."""
    path = tmp_path / "engine-1.log"
    writer = Writer(path)

    def vllm_dies_meanwhile(_fd: int, length: int) -> None:
        writer.raw(FATAL + "\n")
        unsupported(_fd, length)

    bounded = BoundedLogFollower(path, LogCap(CAP), collapse=vllm_dies_meanwhile)
    written = writer.lines(CAP // 60)
    assert bounded.read_lines() == [*written, FATAL]
    writer.close()
    assert Path(bounded.rotated_path(1)).read_text().endswith(FATAL + "\n")


def test_copies_shift_and_the_oldest_falls_off(tmp_path: Path) -> None:
    path = tmp_path / "engine-1.log"
    bounded = BoundedLogFollower(path, LogCap(CAP, backups=2), collapse=unsupported)
    writer = Writer(path)
    firsts = []
    for _ in range(4):
        firsts.append(writer.lines(CAP // 60)[0])
        bounded.read_lines()
    writer.close()
    assert bounded.rotations == 4
    assert Path(bounded.rotated_path(1)).read_text().startswith(firsts[3] + "\n")
    assert Path(bounded.rotated_path(2)).read_text().startswith(firsts[2] + "\n")
    assert not Path(bounded.rotated_path(3)).exists()
    assert not Path(f"{path}.rotating").exists()


def test_no_copies_kept_means_the_head_is_only_dropped(tmp_path: Path) -> None:
    path = tmp_path / "engine-1.log"
    bounded = BoundedLogFollower(path, LogCap(CAP, backups=0), collapse=unsupported)
    writer = Writer(path)
    written = writer.lines(CAP // 60)
    assert bounded.read_lines() == written
    writer.close()
    assert bounded.rotations == 1 and os.path.getsize(path) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-1.log"]


def test_a_filesystem_without_collapse_falls_back_to_copytruncate_once_and_for_all(tmp_path: Path) -> None:
    calls: list[int] = []

    def refuse(_fd: int, length: int) -> None:
        calls.append(length)
        unsupported(_fd, length)

    path = tmp_path / "engine-1.log"
    bounded = BoundedLogFollower(path, LogCap(CAP), collapse=refuse)
    writer = Writer(path)
    written: list[str] = []
    read: list[str] = []
    for _ in range(3):
        written += writer.lines(CAP // 60)
        read += bounded.read_lines()
    writer.close()
    assert read == written
    assert len(calls) == 1 and not bounded.collapse_supported
    assert bounded.rotations == 3


def test_the_engine_classifies_the_fatal_line_past_rotations_and_its_tail_is_the_logs_end(
    tmp_path: Path,
) -> None:
    """The failure journal's "last lines of the log" (run.tail) still end with vLLM's last words."""
    fake_os = FakeOsCalls(str(tmp_path / "proc"))
    engine = Engine(
        oscalls=fake_os,
        marker="m",
        log_dir=tmp_path / "logs",
        logs_kept=2,
        on_transition=lambda *_: None,
        log_cap=LogCap(CAP, backups=1),
    )
    run = engine.spawn(["vllm", "serve"], {"PATH": "/bin"}, EngineParams(), 100.0, FIXED_WALL)
    for i in range(10):
        fake_os.write_log(run.pid, *[f"{ACCESS} #{i}.{n}" for n in range(CAP // 100)])
        assert not [e for e in engine.poll(100.0 + i) if isinstance(e, EngineFailure)]
    fake_os.write_log(run.pid, FATAL, "(APIServer pid=1) INFO:     Shutting down")
    fake_os.exit(run.pid, 0)
    events = engine.poll(111.0)
    assert EngineFailure(FailureKind.ENGINE_DEAD, FATAL) in events
    assert run.tail[-2:] == [FATAL, "(APIServer pid=1) INFO:     Shutting down"]
    assert isinstance(run.follower, BoundedLogFollower) and run.follower.rotations >= 4
    assert run.log_path.stat().st_size <= 2 * CAP


# -- the runs kept -------------------------------------------------------------------------------------


def make_run(log_dir: Path, name: str, mtime: float, copies: int = 0) -> list[Path]:
    paths = [log_dir / name] + [log_dir / f"{name}.{n}" for n in range(1, copies + 1)]
    for path in paths:
        path.write_text("x\n")
        os.utime(path, (mtime, mtime))
    return paths


def test_prune_keeps_the_newest_runs_with_their_copies_and_drops_orphan_copies(tmp_path: Path) -> None:
    old = make_run(tmp_path, "engine-20260101T000000-1-1.log", 1000.0, copies=2)
    mid = make_run(tmp_path, "engine-20260101T000100-1-2.log", 2000.0, copies=1)
    new = make_run(tmp_path, "engine-20260101T000200-1-3.log", 3000.0)
    orphan = tmp_path / "engine-20251231T000000-9-9.log.rotating"
    orphan.write_text("cut\n")
    (tmp_path / "engine.log").symlink_to(new[0].name)
    removed = prune_runs(tmp_path, keep=2)
    assert sorted(removed) == sorted([*old, orphan])
    assert all(p.exists() for p in [*mid, *new])
    assert (tmp_path / "engine.log").exists()


def test_each_start_keeps_logs_kept_runs_including_their_rotated_copies(tmp_path: Path) -> None:
    fake_os = FakeOsCalls(str(tmp_path / "proc"))
    fake_os.default = EngineScript(lines=[ACCESS] * (CAP // 60))  # each run crosses the cap at once
    log_dir = tmp_path / "logs"
    engine = Engine(
        oscalls=fake_os,
        marker="m",
        log_dir=log_dir,
        logs_kept=2,
        on_transition=lambda *_: None,
        log_cap=LogCap(CAP, backups=1),
    )
    runs = []
    for i in range(4):
        now = 100.0 + i
        run = engine.spawn(["vllm", "serve"], {"PATH": "/bin"}, EngineParams(), now, FIXED_WALL)
        engine.poll(now)  # reads, and rotates: the run's output crossed the cap
        engine.begin_stop(now, "test", grace_s=5.0)
        assert any(isinstance(event, TreeGone) for event in engine.poll(now))
        engine.settle(EngineState.STOPPED)
        for path in log_dir.glob(f"{run.log_path.name}*"):
            os.utime(path, (1000.0 + i, 1000.0 + i))  # start order, whatever the clock's granularity
        runs.append(run)
    names = sorted(p.name for p in log_dir.iterdir() if p.name != "engine.log")
    assert names == sorted(
        [
            runs[2].log_path.name,
            runs[2].log_path.name + ".1",
            runs[3].log_path.name,
            runs[3].log_path.name + ".1",
        ]
    )


def test_behind_the_door_the_start_passes_the_access_log_flag_and_the_configured_cap(tmp_path: Path) -> None:
    door = {"enabled": True, "port": free_port()}
    rig = make_rig(
        tmp_path, {"door": door, "paths": {"engine_log_max_bytes": 1 << 20, "engine_log_backups": 3}}
    )
    run = rig.start()
    assert "--disable-uvicorn-access-log" in rig.os.spawns[-1].argv
    assert isinstance(run.follower, BoundedLogFollower) and run.follower.cap == LogCap(1 << 20, 3)


def test_a_reload_changes_the_cap_and_the_runs_kept_for_the_next_start(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.lifecycle.config = rig.config.model_copy(
        update={
            "paths": rig.config.paths.model_copy(
                update={"engine_log_max_bytes": 1 << 20, "engine_logs_kept": 4}
            )
        }
    )
    run = rig.start()
    assert "--disable-uvicorn-access-log" not in rig.os.spawns[-1].argv  # no door: vLLM's log is the record
    assert isinstance(run.follower, BoundedLogFollower) and run.follower.cap == LogCap(1 << 20, 1)
    assert rig.lifecycle.engine.logs_kept == 4


# -- the configuration -----------------------------------------------------------------------------------


def config(**paths: object) -> Config:
    return Config.model_validate({"engine": {"model": "/m"}, "paths": paths})


def test_defaults_bound_each_run_to_about_32_mib() -> None:
    paths = config().paths
    assert (paths.engine_log_max_bytes, paths.engine_log_backups, paths.engine_logs_kept) == (16 << 20, 1, 10)


@pytest.mark.parametrize(
    ("key", "value"),
    [("engine_log_max_bytes", 4096), ("engine_log_backups", -1), ("engine_log_backups", 100)],
)
def test_a_cap_that_makes_no_sense_is_refused(key: str, value: int) -> None:
    with pytest.raises(ValidationError, match=key):
        config(**{key: value})
