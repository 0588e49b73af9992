"""vLLM's output logs, bounded: a size cap per run with rotated files, and a limit on the runs kept.

vLLM writes its log file itself (`O_APPEND`, `OsCalls.spawn`), so its output survives a crash of tunerd
and a stall of tunerd's loop never blocks vLLM's writes. The price: tunerd cannot reopen vLLM's file
descriptor, so it bounds the file from outside, after `BoundedLogFollower` has read what was written.
Unbounded, the file grows with every request vLLM's uvicorn logs: on the H200 one log reached 3.0 MB in
about 8 minutes (64,896 access-log lines, issue 20).

When the live log has grown past `max_bytes`, its head (the part already read and classified) moves to
`<log>.1` (older copies shift to `.2` … up to `backups`; the oldest falls off):

- where the filesystem has `fallocate(FALLOC_FL_COLLAPSE_RANGE)` (ext4, XFS: the usual /var/lib), the
  head is cut out of the file in one call that appends cannot interleave with, so nothing vLLM writes
  is lost, and only bytes the follower has read are cut (the line that says why vLLM died is read,
  classified and kept in the run's tail whichever file it ends up in); the cut is block-aligned, so
  `.1` may end, and the live file begin, in the middle of a line;
- elsewhere (tmpfs, btrfs, NFS) it falls back to logrotate's `copytruncate`: the rest is read, the file
  truncated at once, and the bytes vLLM appends in the microseconds between that read and the truncate
  are lost — rare enough (one rotation per `max_bytes`) to accept where the kernel offers nothing better.

So one run's logs hold about `(1 + backups) x max_bytes` (plus what vLLM writes in one loop tick), and the
engine-log directory `engine_logs_kept` runs of them (`prune_runs`). The copy is in-kernel
(`copy_file_range`) and happens once per `max_bytes` on the loop's thread, like the follower's reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tunerd.engine.logwatch import LogFollower

FALLOC_FL_COLLAPSE_RANGE = 0x08
# What fallocate answers where a filesystem (or a kernel) lacks collapse-range.
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.ENOTTY}
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class LogCap:
    """The bound of one run's log: the live file is rotated past `max_bytes`; `backups` copies kept."""

    max_bytes: int
    backups: int = 1


def collapse_range(fd: int, length: int) -> None:
    """Remove bytes [0, length) of the file (length a multiple of its block size, below its size).

    Raises OSError with the kernel's errno (EOPNOTSUPP where the filesystem cannot).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = libc.fallocate
    fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if fallocate(fd, FALLOC_FL_COLLAPSE_RANGE, 0, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class BoundedLogFollower(LogFollower):
    """A `LogFollower` that also keeps the file it follows under `cap` (see the module's docstring).

    Every byte vLLM writes is returned as a line by `read_lines`/`read_rest` exactly once, rotation or
    not: the head is only cut once read, and the copytruncate fallback reads the rest before truncating.
    `collapse` is injectable so tests can take the fallback on any filesystem.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        cap: LogCap,
        *,
        collapse: Callable[[int, int], None] = collapse_range,
    ) -> None:
        super().__init__(path)
        self.cap = cap
        self.rotations = 0
        self.collapse_supported = True  # until the filesystem says otherwise
        self._collapse = collapse

    def read_lines(self) -> list[str]:
        lines = super().read_lines()
        if self._offset > self.cap.max_bytes:
            lines += self._rotate()
        return lines

    def rotated_path(self, n: int) -> str:
        return f"{self.path}.{n}"

    def _rotate(self) -> list[str]:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return []
        try:
            if self.collapse_supported and self._rotate_by_collapse(fd):
                return []
            return self._rotate_by_truncate(fd)
        finally:
            os.close(fd)

    def _rotate_by_collapse(self, fd: int) -> bool:
        """Cut the read, block-aligned head out of the file. False when this filesystem cannot."""
        block = os.fstatvfs(fd).f_bsize
        head = self._offset - self._offset % block
        if head <= 0 or head >= os.fstat(fd).st_size:
            return True  # nothing whole to cut yet (collapse must leave a byte): next time
        tmp = self._copy_head(fd, head)
        try:
            self._collapse(fd, head)
        except OSError as exc:
            if tmp is not None:
                os.unlink(tmp)
            if exc.errno not in _UNSUPPORTED:
                raise
            self.collapse_supported = False
            return False
        self._offset -= head
        self._install(tmp)
        return True

    def _rotate_by_truncate(self, fd: int) -> list[str]:
        """copytruncate: copy what was read, read the rest, truncate at once; return the rest's lines."""
        tmp = self._copy_head(fd, self._offset)
        rest = self._read_new()
        os.ftruncate(fd, 0)  # vLLM's O_APPEND writes continue at the new end, 0
        if tmp is not None and rest:
            with open(tmp, "ab") as f:
                f.write(rest)
        self._offset = 0
        self._install(tmp)
        return self._split(rest)

    def _copy_head(self, fd: int, length: int) -> str | None:
        """Bytes [0, length) into `<log>.rotating` (None when no copies are kept)."""
        if self.cap.backups == 0:
            return None
        tmp = f"{self.path}.rotating"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            _copy(fd, out, length)
        finally:
            os.close(out)
        return tmp

    def _install(self, tmp: str | None) -> None:
        """`.1` … shift up one (the last falls off); the new copy becomes `.1`."""
        self.rotations += 1
        if tmp is None:
            return
        for n in range(self.cap.backups - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.rotated_path(n), self.rotated_path(n + 1))
        os.replace(tmp, self.rotated_path(1))


def _copy(src: int, dst: int, length: int) -> None:
    """Bytes [0, length) of `src` to `dst`: in the kernel where it can, else through a buffer."""
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src, dst, length - done, done)
            if n == 0:
                return
            done += n
    except OSError:  # EXDEV, ENOSYS, EINVAL on some filesystems: do it by hand from where it stopped
        while done < length:
            chunk = os.pread(src, min(_COPY_CHUNK, length - done), done)
            if not chunk:
                return
            os.write(dst, chunk)
            done += len(chunk)


def prune_runs(log_dir: Path, keep: int) -> list[Path]:
    """Delete the logs of all but the `keep` newest runs, each with its rotated copies; returns them.

    A run is `engine-*.log` (newest by mtime); its copies are `<log>.<n>`. Copies whose run is gone
    (an interrupted rotation's `.rotating`, a run deleted by hand) go too.
    """
    runs = sorted(log_dir.glob("engine-*.log"), key=_mtime)
    removed: list[Path] = []
    for run in runs[: max(0, len(runs) - keep)]:
        for path in (run, *log_dir.glob(f"{run.name}.*")):
            path.unlink(missing_ok=True)
            removed.append(path)
    for copy in log_dir.glob("engine-*.log.*"):
        if not (log_dir / copy.name[: copy.name.index(".log.") + 4]).exists():
            copy.unlink(missing_ok=True)
            removed.append(copy)
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
