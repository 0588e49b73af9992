"""Before a start: find processes an earlier vLLM of this tunerd left behind, stop them, wait until gone.

A process counts as ours only when its environment carries this daemon's marker
(`TUNERD_INSTANCE=<instance id>`, inherited by vLLM's API server, `VLLM::EngineCore`, workers and
compiler helpers). The process group recorded in the state file narrows the search after a daemon
crash, but a reused process-group id never makes tunerd kill a stranger, and a vLLM that another
tunerd or a person started is left alone.

Non-blocking: `step(now)` is called every loop tick until it reports the way clear. The stop itself is
the engine's: SIGTERM, the grace, SIGKILL (`stopper.Escalation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunerd.engine.oscalls import SIGKILL, SIGTERM, OsCalls
from tunerd.engine.process import MARKER_ENV
from tunerd.engine.stopper import Escalation
from tunerd.procfs import processes as procfs


@dataclass
class StepResult:
    clear: bool
    reason: str | None = None
    journal: list[dict[str, Any]] = field(default_factory=list)  # records for the caller to write


class LeftoverReaper:
    """Stops leftover marked processes: SIGTERM, then SIGKILL after the graceful timeout."""

    def __init__(self, oscalls: OsCalls, marker: str, recorded_pgid: int | None = None) -> None:
        self.os = oscalls
        self.marker = marker
        self.recorded_pgid = recorded_pgid
        self._found: dict[int, str] = {}
        self._stop: Escalation | None = None

    def find(self) -> list[int]:
        """Live processes carrying our marker, wherever they are (the recorded group or not)."""
        return sorted(self.os.marked_pids(MARKER_ENV, self.marker))

    def step(self, now: float, graceful_s: float) -> StepResult:
        pids = self.find()
        if self._stop is None:
            if not pids:
                return StepResult(True)
            self._found = {pid: procfs.read_comm(pid, self.os.proc) for pid in pids}
            self._stop = Escalation(now, graceful_s)
            self._signal(pids, SIGTERM)
            record = {"event": "leftover.found", "pids": self._found, "recorded_pgid": self.recorded_pgid}
            return StepResult(False, f"stopping {len(pids)} leftover engine process(es)", [record])
        progress = self._stop.step(now, pids)
        if progress.send_kill:
            self._signal(pids, SIGKILL)
        if progress.survivors:
            stuck = list(progress.survivors)
            return StepResult(False, f"leftover engine process(es) {stuck} survive SIGKILL")
        if progress.done:
            record = {
                "event": "leftover.reaped",
                "pids": self._found,
                "seconds": round(progress.elapsed, 2),
                "sigkill": progress.killed,
            }
            self.recorded_pgid, self._found, self._stop = None, {}, None
            return StepResult(True, journal=[record])
        return StepResult(False, f"waiting for {len(pids)} leftover engine process(es) to exit")

    def _signal(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            self.os.signal_pid(pid, sig)
