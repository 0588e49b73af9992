"""The status document `/status` serves and `tunerd status` prints: built by the main loop, read-only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunerd import __version__

if TYPE_CHECKING:
    from tunerd.supervisor import Supervisor


def build_status(sup: Supervisor, now: float) -> dict[str, Any]:
    """A JSON-ready snapshot of the daemon, the engine and the signals."""
    from tunerd.supervisor import SIGNAL_UNITS

    life = sup.lifecycle
    assert life is not None
    run = life.engine.run
    pending = life.pending
    dstate = life.dstate
    return {
        "daemon": {
            "version": __version__,
            "pid": sup.pid,
            "uptime_s": round(now - sup.started_mono, 1),
            "config": sup.config_path,
            "journal": str(sup.config.paths.journal_path),
            "journal_error": sup.recorder.error,
        },
        "engine": {
            "state": life.engine.state.name,
            "status": life.status_line(),
            "pid": run.pid if run else None,
            "uptime_s": round(run.uptime(now), 1) if run and run.ready_mono else None,
            "params": sup.params_in_force().as_dict(),
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
        "last_journal": sup.recorder.last_record,
        "signals": {
            name: {"value": value, "unit": SIGNAL_UNITS.get(name, "")} for name, value in sup.signals.items()
        },
    }
