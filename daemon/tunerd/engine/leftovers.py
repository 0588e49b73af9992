"""Before a start: find processes an earlier vLLM of this tunerd left behind, stop them, wait until gone.

A process counts as ours only when its environment carries this daemon's marker
(`TUNERD_INSTANCE=<instance id>`, inherited by vLLM's API server, `VLLM::EngineCore`, workers and
compiler helpers). The process group recorded in the state file narrows the search after a daemon
crash, but a reused process-group id never makes tunerd kill a stranger, and a vLLM that another
tunerd or a person started is left alone.

Non-blocking: `step(now)` is called every loop tick until it reports the way clear.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunerd.engine.oscalls import SIGKILL, SIGTERM, OsCalls
from tunerd.engine.process import MARKER_ENV
from tunerd.procfs import processes as procfs


@dataclass
class StepResult:
    clear: bool
    reason: str | None = None
    journal: list[dict[str, Any]] = field(default_factory=list)  # records for the caller to write


class LeftoverReaper:
    """Stops leftover marked processes: SIGTERM, then SIGKILL after the graceful timeout."""

    STUCK_AFTER_KILL_S = 10.0

    def __init__(self, oscalls: OsCalls, marker: str, recorded_pgid: int | None = None) -> None:
        self.os = oscalls
        self.marker = marker
        self.recorded_pgid = recorded_pgid
        self._found: dict[int, str] | None = None
        self._since: float | None = None
        self._killed = False

    def find(self) -> list[int]:
        """Live processes carrying our marker, wherever they are (the recorded group or not)."""
        return sorted(self.os.marked_pids(MARKER_ENV, self.marker))

    def step(self, now: float, graceful_s: float) -> StepResult:
        pids = self.find()
        if self._since is None:
            if not pids:
                return StepResult(True)
            self._found = {pid: procfs.read_comm(pid, self.os.proc) for pid in pids}
            self._since = now
            for pid in pids:
                self.os.signal_pid(pid, SIGTERM)
            record = {"event": "leftover.found", "pids": self._found, "recorded_pgid": self.recorded_pgid}
            return StepResult(False, f"stopping {len(pids)} leftover engine process(es)", [record])
        elapsed = now - self._since
        if not pids:
            record = {
                "event": "leftover.reaped",
                "pids": self._found,
                "seconds": round(elapsed, 2),
                "sigkill": self._killed,
            }
            self._reset()
            return StepResult(True, journal=[record])
        if elapsed >= graceful_s and not self._killed:
            for pid in pids:
                self.os.signal_pid(pid, SIGKILL)
            self._killed = True
        if self._killed and elapsed >= graceful_s + self.STUCK_AFTER_KILL_S:
            return StepResult(False, f"leftover engine process(es) {pids} survive SIGKILL")
        return StepResult(False, f"waiting for {len(pids)} leftover engine process(es) to exit")

    def _reset(self) -> None:
        self.recorded_pgid = None
        self._found = None
        self._since = None
        self._killed = False
