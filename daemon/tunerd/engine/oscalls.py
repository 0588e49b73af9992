"""Every OS call the supervisor makes on processes, behind one small facade (after Supervisor).

Tests replace `OsCalls` with a recording fake; the daemon uses the real one. Nothing here decides
anything: it spawns, signals, reaps and lists, and reports what the kernel said.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
from collections.abc import Mapping, Sequence

from tunerd.core.exits import ExitStatus
from tunerd.procfs import processes as procfs

PR_SET_CHILD_SUBREAPER = 36


class OsCalls:
    """The real facade. `proc` is injectable so listing functions can read a fake /proc tree."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log_path: str) -> int:
        """Start `argv` in a new session (so its own process group), output appended to `log_path`.

        Returns the pid, which is also the process-group id. `argv[0]` is looked up on the child's
        PATH. Raises OSError when it cannot start (FileNotFoundError: no such program).

        posix_spawn rather than subprocess.Popen: the exit status is collected by `reap_group`
        (waitid on the engine's process group), and Popen's own bookkeeping would compete for it.
        """
        program = resolve_program(argv[0], env.get("PATH"))
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
        return os.posix_spawn(program, list(argv), dict(env), file_actions=actions, setsid=True)

    def signal_group(self, pgid: int, sig: int) -> bool:
        """Send `sig` to every process of the group. False when the group no longer exists."""
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False
        return True

    def signal_pid(self, pid: int, sig: int) -> bool:
        """Send `sig` to one process. False when it no longer exists (or is not ours to signal)."""
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def reap_group(self, pgid: int) -> list[tuple[int, ExitStatus]]:
        """Collect, without blocking, every exited child of ours in process group `pgid`.

        Only that group: a global `waitpid(-1)` would steal the exit status of any other child of the
        daemon (the `--help` probe's subprocess, a worker job's), as gunicorn's arbiter warns. With the
        subreaper flag set, vLLM's processes orphaned by their parent (the worker outlives the API
        server by ~2 s, fixture engine_killed_run2) are our children too and keep the engine's group,
        so they are reaped here instead of lingering as zombies.
        """
        reaped: list[tuple[int, ExitStatus]] = []
        while True:
            try:
                result = os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                return reaped
            if result is None or result.si_pid == 0:
                return reaped
            reaped.append((result.si_pid, ExitStatus.from_waitid(result.si_code, result.si_status)))

    def group_pids(self, pgid: int) -> list[int]:
        """Live processes of the process group (zombies left out)."""
        return procfs.pids_in_group(pgid, self.proc, include_zombies=False)

    def marked_pids(self, key: str, value: str) -> list[int]:
        """Live processes whose environment holds KEY=value (tunerd's marker, inherited by vLLM's tree)."""
        return procfs.pids_with_env(key, value, self.proc)

    @staticmethod
    def become_subreaper() -> bool:
        """Ask Linux to re-parent orphaned descendants to us. False where unsupported."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError):
            return False


def resolve_program(name: str, path: str | None) -> str:
    """The executable `name` names: as given when it has a slash, else found on `path` (or ours)."""
    if os.sep in name:
        return name
    found = shutil.which(name, path=path) or shutil.which(name)
    if found is None:
        raise FileNotFoundError(errno.ENOENT, f"program {name!r} not found on PATH", name)
    return found


SIGTERM = signal.SIGTERM
SIGKILL = signal.SIGKILL
