"""The front door kept in step with the engine's lifecycle, from the main loop.

The door (tunerd/door) runs in its own thread; the loop tells it, at every step, what vLLM is now —
`serving` (ready, its URL), `draining` (a planned stop waits for the requests in flight), `down`
(starting, stopping, backoff, a crash), `fatal` (with why) — and the max_model_len of each new run. What
the door reports back arrives as events: a drain ended (the lifecycle may stop vLLM now), held requests
released, the door failed; each is journaled here.

The door's in-flight cap is the door's own (door/limit.py): under a goodput objective it is steered on
the door's thread toward the targets; the loop only sets what it steers by — the targets and attainment
(`[objective]`, at start and reload) and the bounds (`[door] min_in_flight`, the max_num_seqs of each
run) — and journals what the door reports (`door.limit`, rate-limited there). The operator may pin a
value (`tunerd door --max-in-flight N`, or `[door] max_in_flight`) and unpin it (`tunerd door --steer`);
a pin is remembered in the state file, so a daemon restart keeps it. A rule's trial no longer moves the
cap; while the steered cap is still moving toward the targets, rules' restart knobs wait
(`restart_wait`, read by tune/proposer.py).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import structlog

from tunerd.config import Config
from tunerd.config.objective import in_force
from tunerd.core.params import batch_defaults
from tunerd.core.states import EngineState
from tunerd.door import Door, DoorDrained, DoorFailed, DoorLimit, DoorReleased, UpstreamState
from tunerd.policy.first_step import LostCap
from tunerd.records.recorder import Recorder
from tunerd.supervise.lifecycle import ACTIVE, Lifecycle

log = structlog.get_logger("tunerd")

DOOR_EVENTS = (DoorDrained, DoorReleased, DoorFailed, DoorLimit)
# [door] keys a reload applies to the running door (the rest need a daemon restart).
DOOR_LIVE_KEYS = ("max_in_flight", "min_in_flight")


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
        config = lifecycle.config
        # A pin: `[door] max_in_flight` (the door starts with it), or the operator's, from the state file.
        self.max_in_flight = config.door.max_in_flight
        self.pinned = config.door.max_in_flight is not None
        dstate = lifecycle.dstate
        if dstate.door_pinned or dstate.door_max_in_flight is not None:  # survives a daemon restart
            self.max_in_flight, self.pinned = dstate.door_max_in_flight, True
            door.set_max_in_flight(self.max_in_flight)
        self.max_num_seqs: int | None = None  # of the run in force (None: not known yet)
        self.apply_config(config)
        self.set_model_dir(config.engine.model)

    def apply_config(self, config: Config) -> None:
        """What the cap is steered by, from the config (at start, at every reload): the goodput
        objective's targets when goodput is in force (else none: the cap is not steered), and the bounds;
        and the queue's order (`[door] order`: on time first needs the goodput objective's TTFT target)."""
        objective = config.objective
        goodput = in_force(objective, door_enabled=True).kind == "goodput"
        self.door.set_targets(objective.targets if goodput else None, objective.attainment)
        self.door.set_limit_bounds(config.door.min_in_flight, self.max_num_seqs)
        on_time_first = goodput and config.door.order == "on_time_first"
        self.door.set_late_after(objective.targets.ttft_s if on_time_first else None)

    def set_max_in_flight(self, cap: int | None, why: str) -> None:
        """Pin the door's cap at `cap` now (no restart; None: no cap); journaled and kept in the state
        file. The value already pinned changes nothing and journals nothing."""
        if self.pinned and cap == self.max_in_flight:
            return
        before = self.door.limit_state().limit if not self.pinned else self.max_in_flight
        self.max_in_flight, self.pinned = cap, True
        self.door.set_max_in_flight(cap)
        self._save()
        self.rec.record("door.max_in_flight", old=before, new=cap, why=why, mode="pinned")

    def steer(self, why: str) -> None:
        """Unpin: the door's controller steers the cap again (from the value in force). Already steered:
        nothing is journaled."""
        if not self.pinned:
            return
        before, self.max_in_flight, self.pinned = self.max_in_flight, None, False
        self.door.steer()
        self._save()
        self.rec.record("door.max_in_flight", old=before, new=None, why=why, mode="steered")

    def try_cap(self, cap: int, why: str) -> None:
        """Set the door's cap at `cap` for a measurement (the concurrency curve, tune/curve.py): neither
        pinned nor saved — what the operator set stays in force and in the state file, and `restore`
        (or a daemon restart, after a crash) puts it back."""
        before = self.door.limit_state().limit
        self.door.set_max_in_flight(cap)
        self.rec.record("door.max_in_flight", old=before, new=cap, why=why, mode="measuring")

    def restore(self, why: str) -> None:
        """After `try_cap`: the cap the operator set (pinned, or steered) is in force again."""
        before = self.door.limit_state().limit
        if self.pinned:
            self.door.set_max_in_flight(self.max_in_flight)
        else:
            self.door.steer()
        mode = "pinned" if self.pinned else "steered"
        self.rec.record("door.max_in_flight", old=before, new=self.max_in_flight, why=why, mode=mode)

    def _save(self) -> None:
        dstate = self.life.dstate
        dstate.door_max_in_flight, dstate.door_pinned = self.max_in_flight, self.pinned
        self.life.save_state()

    def restart_wait(self) -> str | None:
        """Why a rule's restart knob waits (None: it need not): the steered cap is still moving toward the
        targets it misses. Once they are met, or the cap cannot meet them (at a bound, or boxed in between
        a cap that missed upstream and one that missed by the door's wait), restart knobs are tried."""
        state = self.door.limit_state()
        if not state.steering:
            return None
        return (
            f"the door's cap ({state.limit}) is still steering toward the targets ({state.verdict} misses): "
            "restart knobs wait until it meets them or cannot"
        )

    def steered_cap(self) -> int | None:
        """The cap the door's controller steers now (None: pinned, not steered, or no cap): no more than
        it run in vLLM at once, whatever max_num_seqs is. A snapshot of the door's thread: never blocks."""
        state = self.door.limit_state()
        return state.limit if state.mode == "steered" else None

    def lost_caps(self) -> tuple[LostCap, ...]:
        """The concurrency the steered cap lost under the load in force (read by tune/proposer.py: a
        max_num_seqs at or below it is not tried): door/limit.py's `too_low`, the largest cap whose requests
        missed the targets only by the door's wait (remembered for its `memory_s`), and one below its
        `keeps_up`, the cap that answers as fast as requests arrive (for `SCORES_KEPT` of them); both
        forgotten at a restart. None while the cap is pinned or not steered. A snapshot of the door's
        thread: never blocks."""
        state = self.door.limit_state()
        if state.mode != "steered":
            return ()
        lost = []
        if state.too_low is not None:
            lost.append(LostCap(state.too_low, "its requests missed the targets only by the door's wait"))
        if state.keeps_up is not None and state.keeps_up > 1:
            lost.append(LostCap(state.keeps_up - 1, "it answered fewer requests than arrived"))
        return tuple(lost)

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
            # The steered cap's upper bound: vLLM runs no more than max_num_seqs at once (unset: its
            # default for this machine; unknown machine: none known, door/limit.CEILING).
            seqs = run.params.max_num_seqs
            if seqs is None and run.machine is not None:
                seqs = batch_defaults(run.machine.backend, run.machine.memory.gpu_total_bytes)[0]
            if seqs != self.max_num_seqs:
                self.max_num_seqs = seqs
                self.door.set_limit_bounds(life.config.door.min_in_flight, seqs)

    # -- what the door reports ------------------------------------------------------------------------

    def on_event(self, event: object) -> None:
        if isinstance(event, DoorDrained):
            self.rec.record("door.drained", **asdict(event))
            log.info("door.drained", **asdict(event))
            self.life.stop_drain.drained()
        elif isinstance(event, DoorReleased):
            self.rec.record("door.released", **asdict(event))
        elif isinstance(event, DoorLimit):
            self.rec.record("door.limit", **asdict(event))
        elif isinstance(event, DoorFailed):
            self.rec.record("door.failed", error=event.error)
            log.error("door.failed", error=event.error)

    def status(self) -> dict[str, object]:
        """The door's part of the status document."""
        drain, limits = self.door.drain_state(), self.door.limits_state()
        host, port = self.door.address
        limit = asdict(self.door.limit_state())
        limit["max_num_seqs"] = self.max_num_seqs
        last_at = limit.pop("last_at")
        limit["last_age_s"] = None if last_at is None else round(self.life.monotonic() - last_at, 1)
        return {"address": f"{host}:{port}", **asdict(drain), **asdict(limits), "limit": limit}
