"""The status document `/status` serves and `tunerd status` prints, built from what the loop hands over.

Read-only: the main loop calls `build_status` once per step with its own objects; the HTTP threads only
read the document it returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tunerd import __version__
from tunerd.control.lifecycle import Lifecycle
from tunerd.core.params import EngineParams


@dataclass(frozen=True)
class DaemonFacts:
    """What the status says about the daemon itself."""

    pid: int
    uptime_s: float
    config: str
    journal: str
    journal_error: str | None


def build_status(
    daemon: DaemonFacts,
    life: Lifecycle,
    params_in_force: EngineParams,
    signals: Mapping[str, float | None],
    units: Mapping[str, str],
    last_record: dict[str, Any] | None,
    now: float,
) -> dict[str, Any]:
    """A JSON-ready snapshot of the daemon, the engine and the signals."""
    run = life.engine.run
    pending = life.pending
    dstate = life.dstate
    return {
        "daemon": {
            "version": __version__,
            "pid": daemon.pid,
            "uptime_s": round(daemon.uptime_s, 1),
            "config": daemon.config,
            "journal": daemon.journal,
            "journal_error": daemon.journal_error,
        },
        "engine": {
            "state": life.engine.state.name,
            "status": life.status_line(),
            "pid": run.pid if run else None,
            "uptime_s": round(run.uptime(now), 1) if run and run.ready_mono else None,
            "params": params_in_force.as_dict(),
            "known_good": life.known_good.as_dict() if life.known_good else None,
            "known_good_verified": dstate.known_good_verified,
            "kv_cache_tokens": run.kv_cache.tokens if run and run.kv_cache else None,
            "log": str(run.log_path) if run else None,
            "consecutive_failures": life.failures,
            "fatal_reason": life.fatal_reason,
            "waiting_reason": life.waiting_reason,
            "next_start_in_s": round(max(0.0, pending.not_before - now), 1) if pending else None,
            "restarts": dict(life.restarts),
            "notes": dict(life.notes),
            "identity": dstate.identity,
            "memory_baseline": dstate.baseline,
        },
        "last_journal": last_record,
        "signals": {name: {"value": value, "unit": units.get(name, "")} for name, value in signals.items()},
    }
