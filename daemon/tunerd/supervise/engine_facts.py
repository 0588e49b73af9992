"""What the state file remembers about the engine between starts: versions and model identity (the
upgrade guard), and what the engine command offers (`--help`, flags it turned out not to know).

Composed into the lifecycle; the facts arrive from worker jobs (observe/identity.py) as events.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from tunerd.core.params import EngineParams
from tunerd.engine.process import EngineRun
from tunerd.observe.identity import Capabilities, EngineIdentity, identity_changes, probe_identity
from tunerd.records.recorder import Recorder
from tunerd.records.state import DaemonState

log = structlog.get_logger("tunerd")


class EngineFacts:
    def __init__(
        self, recorder: Recorder, dstate: DaemonState, save_state: Callable[[], None], notes: dict[str, str]
    ) -> None:
        self.rec = recorder
        self.dstate = dstate
        self.save_state = save_state
        self.notes = notes  # shared with the lifecycle: shown in status

    def on_identity(
        self, identity: EngineIdentity, run: EngineRun | None, known_good: EngineParams | None
    ) -> None:
        """The upgrade guard: journal versions and model identity; flag last-known-good as unverified
        after a change, until a start with it succeeds."""
        facts = dict(identity.facts)
        changes = identity_changes(self.dstate.identity, facts)
        self.rec.record("engine.identity", **facts)
        if changes:
            self.rec.record("engine.upgraded", changes=changes)
            log.warning("engine.upgraded", changes=changes)
            self.notes["upgrade"] = "vLLM, driver or model changed: " + ", ".join(sorted(changes))
            if run is None or run.params != known_good:
                self.dstate.known_good_verified = False
        if run is not None and run.run_id == identity.run_id and run.params == known_good:
            self.dstate.known_good_verified = True
            self.notes.pop("upgrade", None)
        self.dstate.identity = facts
        self.save_state()

    def on_capabilities(self, caps: Capabilities) -> None:
        before = self.dstate.capabilities or {}
        same = before.get("command") == list(caps.command)
        self.dstate.capabilities = {
            "command": list(caps.command),
            "shutdown_timeout": caps.shutdown_timeout,
            "flags": sorted(caps.flags),  # the optional flags its --help names (observe/identity.py)
            "dropped_flags": before.get("dropped_flags", []) if same else [],  # learnt from a failed start
        }
        self.save_state()
        self.rec.record(
            "engine.capabilities",
            shutdown_timeout=caps.shutdown_timeout,
            error=caps.error,
            flags=sorted(caps.flags),
        )

    def needs_capabilities(self, command: list[str]) -> bool:
        """Whether this engine command has not been asked what it offers yet."""
        caps = self.dstate.capabilities or {}
        return caps.get("command") != list(command)

    def drop_flags(self, command: list[str], flags: tuple[str, ...]) -> None:
        """Leave flags this vLLM does not know out of every later command line (kept per command)."""
        caps = dict(self.dstate.capabilities or {"command": list(command)})
        caps["dropped_flags"] = sorted(set(caps.get("dropped_flags") or ()) | set(flags))
        self.dstate.capabilities = caps
        self.save_state()
        self.rec.record("engine.flags_dropped", flags=list(flags), command=list(command))
        log.warning("engine.flags_dropped", flags=list(flags), hint="this vLLM does not know them")


def identity_job(run: EngineRun) -> EngineIdentity:
    """Run in a worker: the identity of the vLLM that just became ready."""
    model = run.argv[run.argv.index("--model") + 1] if "--model" in run.argv else ""
    return probe_identity(run.run_id, run.base_url, model)
