"""Operator commands across the handler thread and the loop: the capacity planner's check of a
`restart --set` runs in a worker job the loop submits, never on the socket's handler thread (issue 20:
the handler called `capacity.check`, mutating the planner's cache while worker jobs used it)."""

from __future__ import annotations

import os
import queue
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests.unit.fakes import FakeOsCalls, HeldJobs, make_config, write_meminfo
from tunerd.commands import Asked, Commands, ask
from tunerd.core.commands import Command
from tunerd.core.params import EngineParams
from tunerd.faces.systemd import Notifier
from tunerd.records.journal import read_records
from tunerd.records.state import DaemonState, StateStore
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervisor import Supervisor

SAFETY_S = 30.0  # a bound on waits that only a broken test reaches
REFUSAL = "max_model_len 100,000 needs 2 GiB of KV cache; 1 GiB fits"


class RecordingCheck:
    """A planner check that records the thread it ran on and refuses every parameter set."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def __call__(self, params: EngineParams) -> PlanOutcome:
        self.threads.append(threading.current_thread())
        return PlanOutcome(REFUSAL, {})


def make_supervisor(tmp_path: Path) -> Supervisor:
    proc = tmp_path / "proc"
    write_meminfo(proc, 60)
    socket_path = f"/tmp/tunerd-cmd-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    config = make_config(tmp_path, proc, {"paths": {"socket": socket_path}, "export": {"enabled": False}})
    caps = {"command": list(config.engine.command), "shutdown_timeout": False}
    StateStore(config.paths.state_file).save(DaemonState(capabilities=caps))
    supervisor = Supervisor(
        config, str(tmp_path / "tunerd.toml"), oscalls=FakeOsCalls(str(proc)), notifier=Notifier({})
    )
    supervisor.setup()
    return supervisor


def next_asked(supervisor: Supervisor, check: RecordingCheck) -> Asked:
    """The loop's side: the next `Asked` on the event queue (other events are left unhandled)."""
    while True:
        try:
            event = supervisor.events.get(timeout=SAFETY_S)
        except queue.Empty:
            pytest.fail(
                f"the handler posted no question (the planner ran on {[t.name for t in check.threads]})"
            )
        if isinstance(event, Asked):
            return event


def test_a_restart_the_planner_refuses_is_checked_off_the_handler_thread_and_refused(tmp_path: Path) -> None:
    supervisor = make_supervisor(tmp_path)
    try:
        assert supervisor.lifecycle is not None and supervisor.commands is not None
        check = RecordingCheck()
        supervisor.lifecycle.capacity.check = check  # type: ignore[method-assign]
        held = HeldJobs()
        supervisor.commands.submit = held
        answers: list[str | None] = []
        command = Command("restart", {"max_model_len": 100000})
        handler = threading.Thread(
            target=lambda: answers.append(supervisor._accept_command(command)), name="handler"
        )
        handler.start()

        asked = next_asked(supervisor, check)  # the loop takes the question up
        supervisor._handle(asked)
        assert check.threads == [] and len(held.queued) == 1  # submitted as a worker job, not yet run
        held.run_all()  # the worker
        supervisor._step(supervisor.monotonic())  # the loop answers
        handler.join(SAFETY_S)

        assert check.threads == [threading.current_thread()]
        assert handler not in check.threads
        assert answers == [f"the capacity planner refuses it (nothing was stopped): {REFUSAL}"]
        restarts = [
            r
            for r in read_records(supervisor.journal.path)
            if r["event"] == "intent" and r["action"] != "start"
        ]
        assert restarts == [] and supervisor.lifecycle.params.max_model_len is None
    finally:
        assert supervisor.operator is not None
        supervisor.operator.stop()
        supervisor.journal.close()


# -- the loop's half, with a fake lifecycle -------------------------------------------------------


class FakeLife:
    def __init__(self, check: RecordingCheck) -> None:
        self.params = EngineParams(max_model_len=512)
        self.capacity = SimpleNamespace(check=check)
        self.restarts: list[tuple[EngineParams, str]] = []

    def restart(self, params: EngineParams, reason: str, action: str = "restart") -> None:
        self.restarts.append((params, action))


def commands_over(life: FakeLife, held: HeldJobs) -> Commands:
    nothing = cast(Any, None)
    return Commands(cast(Any, life), nothing, nothing, lambda: None, recorder=nothing, submit=held)


def test_a_restart_the_planner_accepts_is_answered_then_carried_out_on_the_loop() -> None:
    check, held = RecordingCheck(), HeldJobs()
    check_accepts = PlanOutcome(None, {})
    life = FakeLife(check)
    life.capacity.check = lambda params: check_accepts
    commands = commands_over(life, held)
    asked = Asked(Command("restart", {"max_model_len": 1024}))
    commands.ask(asked)
    commands.step()
    assert not asked.answer.done() and life.restarts == []  # the planner has not answered yet
    held.run_all()
    commands.step()
    assert asked.answer.result(timeout=0) is None
    assert life.restarts == [(EngineParams(max_model_len=1024), "change")]


def test_a_restart_to_the_parameters_in_force_asks_no_planner() -> None:
    check, held = RecordingCheck(), HeldJobs()
    life = FakeLife(check)
    asked = Asked(Command("restart", {"max_model_len": 512}))
    commands_over(life, held).ask(asked)
    assert asked.answer.result(timeout=0) is None and held.queued == [] and check.threads == []
    assert life.restarts == [(EngineParams(max_model_len=512), "restart")]


def test_a_question_the_handler_gave_up_on_is_never_carried_out() -> None:
    check, held = RecordingCheck(), HeldJobs()
    life = FakeLife(check)
    life.capacity.check = lambda params: PlanOutcome(None, {})  # it would be accepted
    commands = commands_over(life, held)
    posted: list[Asked] = []
    why = ask(Command("restart", {"max_model_len": 1024}), posted.append, wait_s=0)  # nobody answers
    assert why is not None and "nothing was done" in why
    commands.ask(posted[0])
    held.run_all()
    commands.step()
    assert life.restarts == []  # the operator was told nothing was done: nothing is


def test_whoever_still_waits_at_exit_hears_that_nothing_was_done() -> None:
    check, held = RecordingCheck(), HeldJobs()
    commands = commands_over(FakeLife(check), held)
    asked = Asked(Command("restart", {"max_model_len": 1024}))
    commands.ask(asked)
    commands.close()
    assert asked.answer.result(timeout=0) == "tunerd is stopping (nothing was done)"
