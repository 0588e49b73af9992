"""The experiment machine (tune/experiment.py): every transition in its table is allowed, the rest raise;
the paths a trial and an exploration take are walks of the table; the exported numbers stay."""

from __future__ import annotations

from itertools import pairwise

import pytest

from tunerd.tune.experiment import TRANSITIONS, InvalidPhase, Phase, check

LEGAL = [(old, new) for old, targets in TRANSITIONS.items() for new in sorted(targets)]
ILLEGAL = [(old, new) for old in Phase for new in Phase if new not in TRANSITIONS[old]]


def test_every_phase_has_a_row_and_every_phase_but_none_is_reachable() -> None:
    assert set(TRANSITIONS) == set(Phase)
    reached = set().union(*TRANSITIONS.values())
    assert reached == set(Phase)


@pytest.mark.parametrize(("old", "new"), LEGAL, ids=[f"{o.name}->{n.name}" for o, n in LEGAL])
def test_every_listed_transition_is_allowed(old: Phase, new: Phase) -> None:
    assert check(old, new) is new


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{o.name}->{n.name}" for o, n in ILLEGAL])
def test_every_other_transition_raises(old: Phase, new: Phase) -> None:
    with pytest.raises(InvalidPhase, match=f"{old.name} -> {new.name}"):
        check(old, new)


def test_named_forbidden_transitions() -> None:
    """The ones a bug would make: a verdict with nothing measured, a trial that skips its warm-up, a
    change applied without a plan, the best point measured again."""
    for old, new in [
        (Phase.PLANNING, Phase.MEASURING),
        (Phase.APPLYING, Phase.MEASURING),
        (Phase.NONE, Phase.APPLYING),
        (Phase.FINISHING, Phase.WARMUP),
        (Phase.WARMUP, Phase.DECIDED),
    ]:
        with pytest.raises(InvalidPhase):
            check(old, new)


def walk(*phases: Phase) -> None:
    for old, new in pairwise(phases):
        check(old, new)


def test_the_paths_of_a_trial_and_an_exploration_are_walks_of_the_table() -> None:
    p = Phase
    walk(p.NONE, p.PLANNING, p.APPLYING, p.WARMUP, p.MEASURING, p.DECIDED, p.NONE)  # a trial kept
    walk(p.NONE, p.PLANNING, p.APPLYING, p.WARMUP, p.MEASURING, p.DECIDED, p.REVERTING, p.NONE)  # lost
    walk(p.NONE, p.PLANNING, p.APPLYING, p.REVERTING, p.NONE)  # its start failed
    walk(p.NONE, p.PLANNING, p.NONE)  # the planner refused it
    # an exploration: baseline, a refused point, a measured one, a failed one, the best
    walk(p.NONE, p.BASELINE, p.PLANNING, p.DECIDED, p.PLANNING, p.APPLYING, p.WARMUP, p.MEASURING, p.DECIDED)
    walk(p.DECIDED, p.PLANNING, p.APPLYING, p.REVERTING, p.PLANNING, p.APPLYING, p.WARMUP, p.MEASURING)
    walk(p.MEASURING, p.DECIDED, p.FINISHING, p.NONE)
    walk(
        p.NONE, p.BASELINE, p.APPLYING, p.WARMUP, p.MEASURING, p.DECIDED, p.REVERTING, p.NONE
    )  # a recall lost


def test_a_trials_exported_numbers_are_the_ones_dashboards_read() -> None:
    """`tunerd_trial_phase` (etc/prometheus/tunerd-alerts.yml, etc/grafana/tunerd.json): 0 none,
    1 planning, 2 restarting/applying, 3 warm-up, 4 evaluating/measuring, 5 reverting."""
    assert [int(p) for p in (Phase.NONE, Phase.PLANNING, Phase.APPLYING, Phase.WARMUP)] == [0, 1, 2, 3]
    assert [int(Phase.MEASURING), int(Phase.REVERTING)] == [4, 5]
