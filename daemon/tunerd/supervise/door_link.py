"""The front door kept in step with the engine's lifecycle, from the main loop.

The door (tunerd/door) runs in its own thread; the loop tells it, at every step, what vLLM is now —
`serving` (ready, its URL), `draining` (a planned stop waits for the requests in flight), `down`
(starting, stopping, backoff, a crash), `fatal` (with why) — and the max_model_len of each new run. What
the door reports back arrives as events: a drain ended (the lifecycle may stop vLLM now), held requests
released, the door failed; each is journaled here.

The door's in-flight cap is the one knob that needs no restart: `set_max_in_flight` (the operator's
`tunerd door --max-in-flight N`, the tuner's trials) changes it on the running door and remembers it in
the state file, so a daemon restart keeps what was decided.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import structlog

from tunerd.core.states import EngineState
from tunerd.door import Door, DoorDrained, DoorFailed, DoorReleased, UpstreamState
from tunerd.records.recorder import Recorder
from tunerd.supervise.lifecycle import ACTIVE, Lifecycle

log = structlog.get_logger("tunerd")

DOOR_EVENTS = (DoorDrained, DoorReleased, DoorFailed)


class Upstream:
    """What the door is told of vLLM (only what changed). Made before the lifecycle, which holds it as
    its door's drain (`supervise/drain.DoorDrain`): a planned stop tells the door "draining"."""

    def __init__(self, door: Door) -> None:
        self.door = door
        self._upstream: tuple[str | None, UpstreamState, str] | None = None

    def drain(self, reason: str) -> None:
        self.set(None, "draining", reason)

    def set(self, url: str | None, state: UpstreamState, reason: str) -> None:
        upstream = (url, state, reason)
        if upstream != self._upstream:
            self._upstream = upstream
            self.door.set_upstream(url, state, reason)


class DoorLink:
    def __init__(self, upstream: Upstream, lifecycle: Lifecycle, *, recorder: Recorder) -> None:
        self.door = upstream.door
        self.upstream = upstream
        self.life = lifecycle
        self.rec = recorder
        self._run_id: int | None = None
        door = self.door
        self.max_in_flight = lifecycle.config.door.max_in_flight
        saved = lifecycle.dstate.door_max_in_flight
        if saved is not None:  # what a trial or the operator set survives a daemon restart
            self.max_in_flight = saved
            door.set_max_in_flight(saved)
        self.set_model_dir(lifecycle.config.engine.model)

    def set_max_in_flight(self, cap: int | None, why: str) -> None:
        """Change the door's cap now (no restart); journaled and kept in the state file."""
        before, self.max_in_flight = self.max_in_flight, cap
        self.door.set_max_in_flight(cap)
        self.life.dstate.door_max_in_flight = cap
        self.life.save_state()
        self.rec.record("door.max_in_flight", old=before, new=cap, why=why)

    # -- the tuner's live knob (tune/tuner.py: LiveKnobs) ----------------------------------------

    def value(self, name: str) -> int | None:
        assert name == "door.max_in_flight", name
        return self.max_in_flight

    def set(self, name: str, value: object, why: str) -> None:
        assert name == "door.max_in_flight" and (value is None or isinstance(value, int)), (name, value)
        self.set_max_in_flight(value, why)

    def set_model_dir(self, model: str) -> None:
        if Path(model).is_dir():  # a repo id has no local tokenizer: prompt lengths are left to vLLM
            self.door.set_model_dir(model)

    # -- every loop step ---------------------------------------------------------------------------

    def step(self) -> None:
        """Tell the door what vLLM is now (only what changed)."""
        life = self.life
        run, state = life.engine.run, life.engine.state
        if life.stop_drain.draining is not None:
            return  # "draining" holds until the stop begins
        if state is EngineState.RUNNING and run is not None and run.ready_mono is not None:
            self.upstream.set(run.base_url, "serving", "")
        elif state is EngineState.FATAL:
            self.upstream.set(None, "fatal", f"vLLM is FATAL: {life.fatal_reason or 'see tunerd status'}")
        else:
            self.upstream.set(None, "down", f"vLLM is {state.name}")
        if run is not None and state in ACTIVE and run.run_id != self._run_id:
            self._run_id = run.run_id
            self.door.set_max_model_len(run.params.max_model_len)

    # -- what the door reports ------------------------------------------------------------------------

    def on_event(self, event: object) -> None:
        if isinstance(event, DoorDrained):
            self.rec.record("door.drained", **asdict(event))
            log.info("door.drained", **asdict(event))
            self.life.stop_drain.drained()
        elif isinstance(event, DoorReleased):
            self.rec.record("door.released", **asdict(event))
        elif isinstance(event, DoorFailed):
            self.rec.record("door.failed", error=event.error)
            log.error("door.failed", error=event.error)

    def status(self) -> dict[str, object]:
        """The door's part of the status document."""
        drain, limits = self.door.drain_state(), self.door.limits_state()
        host, port = self.door.address
        return {"address": f"{host}:{port}", **asdict(drain), **asdict(limits)}
