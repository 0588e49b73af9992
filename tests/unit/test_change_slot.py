"""The lifecycle's change slot (supervise/change.py) and the door's drain by composition
(supervise/drain.py), on a real Lifecycle over fake processes: a change's outcome comes back as
events posted on the loop's queue, never as a call into its owner."""

from __future__ import annotations

from pathlib import Path

from tests.unit.fakes import Rig, make_rig
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.supervise.change import ChangeEvent, Outcome
from tunerd.supervise.lifecycle import Lifecycle

NEW = EngineParams(max_model_len=1024)


def watched(tmp_path: Path) -> tuple[Rig, list[ChangeEvent]]:
    """A rig whose loop delivers a change's outcomes into the list returned with it."""
    rig = make_rig(tmp_path)
    seen: list[ChangeEvent] = []
    rig.on_change = seen.append
    return rig, seen


def outcomes(rig: Rig, seen: list[ChangeEvent]) -> list[ChangeEvent]:
    """What the loop delivered since the last look (posted by the lifecycle on its queue)."""
    rig.deliver()
    found, seen[:] = list(seen), []
    return found


def serve_again(rig: Rig) -> None:
    """Step until the next start serves (the planned stop settles, the new run starts and answers)."""
    rig.settle()
    rig.step_until(lambda: rig.state is EngineState.STARTING)
    rig.step()
    rig.health(True)


def test_a_change_that_serves_is_posted_with_its_id_owner_and_the_starts_plan(tmp_path: Path) -> None:
    rig, seen = watched(tmp_path)
    rig.serve()
    change = rig.lifecycle.request(NEW, "rule x: max_model_len", "trial", 7)
    assert change is not None
    assert rig.lifecycle.request(NEW, "a second one", "explore", 8) is None  # one change in flight
    (intent,) = rig.intents("trial")
    assert intent["trial"] == 7 and intent["params"] == {"max_model_len": 1024}
    serve_again(rig)
    (event,) = outcomes(rig, seen)
    assert (event.outcome, event.change_id, event.owner, event.ref) == (Outcome.SERVING, change, "trial", 7)
    assert event.run is not None and event.run.params == NEW and event.at == rig.now
    assert event.plan is not None  # the preflight's plan travels with the outcome
    assert rig.lifecycle.slot.in_flight  # until the owner decides
    assert rig.lifecycle.slot.end(change + 1, keep=True, reason="not mine") is False
    assert rig.lifecycle.slot.end(change, keep=True, reason="kept")
    assert rig.lifecycle.known_good == NEW and not rig.lifecycle.slot.in_flight


def test_a_failed_change_posts_failed_then_reverted_and_never_retries(tmp_path: Path) -> None:
    rig, seen = watched(tmp_path)
    rig.serve()
    change = rig.lifecycle.request(NEW, "rule x", "explore", 3)
    rig.settle()
    rig.step_until(lambda: rig.state is EngineState.STARTING)
    rig.os.exit(rig.run.pid, 1)  # the change's start fails
    rig.settle()
    (failed,) = outcomes(rig, seen)
    assert (failed.outcome, failed.change_id, failed.owner) == (Outcome.FAILED, change, "explore")
    assert failed.failure is not None
    assert [r["params"] for r in rig.intents("revert")] == [{}]  # back at once, no backoff retry
    rig.step_until(lambda: rig.state is EngineState.STARTING)
    rig.step()
    rig.health(True)
    (reverted,) = outcomes(rig, seen)
    assert (reverted.outcome, reverted.change_id) == (Outcome.REVERTED, change)
    assert reverted.run is not None and reverted.run.params == EngineParams()
    assert rig.lifecycle.slot.current is None


def test_an_operator_restart_aborts_the_change_in_flight(tmp_path: Path) -> None:
    rig, seen = watched(tmp_path)
    rig.serve()
    change = rig.lifecycle.request(NEW, "rule x", "trial", 1)
    assert rig.lifecycle.restart(EngineParams(), "operator restart")
    (aborted,) = outcomes(rig, seen)
    assert (aborted.outcome, aborted.change_id) == (Outcome.ABORTED, change)
    assert "superseded by restart" in aborted.reason
    assert rig.lifecycle.slot.current is None


class FakeDoor:
    def __init__(self) -> None:
        self.drains: list[str] = []

    def drain(self, reason: str) -> None:
        self.drains.append(reason)


def test_a_planned_stop_waits_for_the_door_given_at_construction(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    door = FakeDoor()
    life = Lifecycle(
        rig.config,
        oscalls=rig.os,
        recorder=rig.recorder,
        store=rig.store,
        dstate=rig.dstate,
        metrics=rig.metrics,
        on_status_change=lambda: None,
        background=rig.background.append,
        post=rig.posted.append,
        door=door,
        monotonic=rig.clock,
        wallclock=rig.lifecycle.starter.wallclock,
    )
    rig.lifecycle = life
    rig.serve()
    assert life.restart(NEW, "operator restart")
    rig.step(1.0)
    assert door.drains == ["operator restart"] and life.engine.state is EngineState.RUNNING
    life.stop_drain.drained()
    rig.step()
    assert life.engine.state is EngineState.STOPPING
