"""The engine's life as an explicit state machine (after Supervisor's `states.py`).

This module imports nothing from the project, so every other module can use it without cycles.
"""

from __future__ import annotations

from enum import IntEnum


class EngineState(IntEnum):
    """Where the vLLM child is in its life. The integer value is exported as `tunerd_engine_state`."""

    STOPPED = 0  # no child; nothing scheduled
    STARTING = 10  # spawned, waiting for /health 200 within the start-up budget
    RUNNING = 20  # /health answered 200
    STOPPING = 30  # SIGTERM sent to the group, waiting for it to exit (SIGKILL at the deadline)
    BACKOFF = 40  # the last start or run failed; the next start waits for a delay
    FATAL = 100  # gave up: no start until an operator acts (resume or config reload)


# Which transitions are legal. Every change goes through one function that checks this table.
TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    # STOPPED → BACKOFF: a start refused before any process existed (preflight, planner) waits to retry.
    EngineState.STOPPED: frozenset({EngineState.STARTING, EngineState.BACKOFF, EngineState.FATAL}),
    EngineState.STARTING: frozenset({EngineState.RUNNING, EngineState.STOPPING, EngineState.BACKOFF}),
    EngineState.RUNNING: frozenset({EngineState.STOPPING, EngineState.BACKOFF}),
    EngineState.STOPPING: frozenset({EngineState.STOPPED, EngineState.BACKOFF, EngineState.FATAL}),
    EngineState.BACKOFF: frozenset({EngineState.STARTING, EngineState.STOPPED, EngineState.FATAL}),
    EngineState.FATAL: frozenset({EngineState.STOPPED, EngineState.STARTING}),
}


class InvalidTransition(RuntimeError):
    """Raised when code asks for a transition the table above does not allow (a bug, not a fault)."""


def check_transition(old: EngineState, new: EngineState) -> None:
    """Raise InvalidTransition unless `old -> new` is in TRANSITIONS."""
    if new not in TRANSITIONS[old]:
        raise InvalidTransition(f"engine state {old.name} -> {new.name} is not allowed")
