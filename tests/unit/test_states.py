"""The engine state machine: every transition in TRANSITIONS is legal, the rest raise."""

from __future__ import annotations

import pytest

from tunerd.core.states import (
    TRANSITIONS,
    EngineState,
    InvalidTransition,
    check_transition,
)

LEGAL = [(old, new) for old, targets in TRANSITIONS.items() for new in sorted(targets)]
ILLEGAL = [(old, new) for old in EngineState for new in EngineState if new not in TRANSITIONS.get(old, ())]


def test_every_state_has_a_row_in_the_transition_table() -> None:
    assert set(TRANSITIONS) == set(EngineState)


@pytest.mark.parametrize(("old", "new"), LEGAL, ids=[f"{o.name}->{n.name}" for o, n in LEGAL])
def test_every_listed_transition_is_allowed(old: EngineState, new: EngineState) -> None:
    check_transition(old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (EngineState.STOPPED, EngineState.RUNNING),
        (EngineState.RUNNING, EngineState.STARTING),
        (EngineState.FATAL, EngineState.RUNNING),
        (EngineState.STOPPED, EngineState.STOPPING),
        (EngineState.BACKOFF, EngineState.RUNNING),
        (EngineState.STOPPING, EngineState.RUNNING),
    ],
    ids=lambda s: s.name,
)
def test_named_illegal_transitions_raise_invalid_transition(old: EngineState, new: EngineState) -> None:
    with pytest.raises(InvalidTransition, match=f"{old.name} -> {new.name}"):
        check_transition(old, new)


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{o.name}->{n.name}" for o, n in ILLEGAL])
def test_every_transition_outside_the_table_raises(old: EngineState, new: EngineState) -> None:
    with pytest.raises(InvalidTransition):
        check_transition(old, new)


def test_a_state_cannot_transition_to_itself() -> None:
    for state in EngineState:
        with pytest.raises(InvalidTransition):
            check_transition(state, state)


def test_fatal_is_left_only_by_an_operator_stop_or_start() -> None:
    assert TRANSITIONS[EngineState.FATAL] == {EngineState.STOPPED, EngineState.STARTING}


def test_state_values_are_the_exported_metric_numbers() -> None:
    assert [int(s) for s in EngineState] == [0, 10, 20, 30, 40, 100]
