"""Decode how a child process ended (after gunicorn's arbiter: WIFEXITED / WTERMSIG)."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How the engine's main process ended: exactly one of `code` and `signal` is set."""

    code: int | None
    signal: int | None

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        """Build from the raw status word `os.waitpid` returns."""
        import os

        if os.WIFSIGNALED(status):
            return cls(code=None, signal=os.WTERMSIG(status))
        return cls(code=os.waitstatus_to_exitcode(status), signal=None)

    @classmethod
    def from_waitid(cls, code: int, status: int) -> ExitStatus:
        """Build from `os.waitid`'s `si_code` (CLD_EXITED, CLD_KILLED, CLD_DUMPED) and `si_status`."""
        import os

        if code == os.CLD_EXITED:
            return cls(code=status, signal=None)
        return cls(code=None, signal=status)

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    @property
    def likely_oom_kill(self) -> bool:
        """A SIGKILL tunerd did not send is most often the kernel's OOM killer."""
        return self.signal == signal.SIGKILL

    def describe(self, *, killed_by_us: bool = False) -> str:
        """One line for logs and the journal, e.g. 'killed by SIGKILL (likely OOM kill)'."""
        if self.signal is None:
            return f"exited with code {self.code}"
        text = f"killed by {self.signal_name}"
        if self.likely_oom_kill and not killed_by_us:
            text += " (likely OOM kill)"
        return text

    def as_dict(self) -> dict[str, object]:
        return {"code": self.code, "signal": self.signal_name}
