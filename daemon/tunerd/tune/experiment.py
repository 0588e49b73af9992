"""The phases of an experiment — a rule's trial (tune/tuner.py) or an exploration's point or recall
(tune/explorer.py) — as one state machine with a transition table, checked like the engine's
(core/states.py): every phase change goes through `check`.

    planning → applying (restart or live) → warm-up → measuring → decided → (reverting)

`NONE` is no experiment (a trial's or an exploration's end: kept, reverted, refused, aborted). Two
phases are the exploration's own, because only a search has them: `BASELINE`, the probe of the
configuration in force before any change (a measurement with nothing applied: it leads to the first
point's planning, to a recall's restart, or straight to the end), and `FINISHING`, the restart to the
search's best point (an applying that ends the exploration whatever becomes of it, so it has no warm-up
or verdict of its own). `DECIDED` is the moment the verdict is in (a point measured, refused or failed,
a trial judged), before the change is kept, reverted or the next point planned: it makes "what follows a
verdict" one row of the table.

The integer values of a trial's phases are exported as `tunerd_trial_phase` and keep the numbers they
had (0 none, 1 planning, 2 applying — "restarting" before a live knob's trial applied without one —,
3 warm-up, 4 measuring — "evaluating" before —, 5 reverting); `DECIDED` is set and left within one
step, so the gauge never holds 6. The exploration's phases are shown by name (`tunerd status`).
"""

from __future__ import annotations

from enum import IntEnum


class Phase(IntEnum):
    """Where an experiment is. A trial's value is exported as `tunerd_trial_phase`."""

    NONE = 0  # no experiment
    PLANNING = 1  # the planner is asked whether the change fits (a refusal costs no restart)
    APPLYING = 2  # intent journaled; vLLM restarting with the change (a live knob: set at once)
    WARMUP = 3  # serving; the first seconds are skipped (compile and cache warm-up)
    MEASURING = 4  # the after window (a trial), the probe of the point (an exploration)
    REVERTING = 5  # the change lost or its start failed: vLLM restarting with the parameters before
    DECIDED = 6  # the verdict is in: keep, revert, or the exploration's next point
    BASELINE = 7  # an exploration probes the configuration in force, before any change
    FINISHING = 8  # an exploration restarts with its best point


# Which changes are legal. Every phase assignment goes through `check`, which reads this table.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.NONE: frozenset({Phase.PLANNING, Phase.BASELINE}),
    # BASELINE → APPLYING: a recall restarts with the one configuration, nothing to plan; → FINISHING:
    # no point to measure (all known) and the best known is not in force.
    Phase.BASELINE: frozenset({Phase.PLANNING, Phase.APPLYING, Phase.FINISHING, Phase.NONE}),
    # PLANNING → DECIDED: the planner refused an exploration's point (a trial's refusal ends it: NONE).
    Phase.PLANNING: frozenset({Phase.APPLYING, Phase.DECIDED, Phase.NONE}),
    # → REVERTING: the start with the change failed (or its run crashed) and the lifecycle reverts at once.
    Phase.APPLYING: frozenset({Phase.WARMUP, Phase.REVERTING, Phase.NONE}),
    Phase.WARMUP: frozenset({Phase.MEASURING, Phase.REVERTING, Phase.NONE}),
    Phase.MEASURING: frozenset({Phase.DECIDED, Phase.REVERTING, Phase.NONE}),
    # → PLANNING | FINISHING: an exploration's next point, or its best; → NONE: kept (or reverted live).
    Phase.DECIDED: frozenset({Phase.PLANNING, Phase.FINISHING, Phase.REVERTING, Phase.NONE}),
    # An exploration goes on after a failed point's revert; a trial's revert ends it.
    Phase.REVERTING: frozenset({Phase.PLANNING, Phase.FINISHING, Phase.NONE}),
    Phase.FINISHING: frozenset({Phase.NONE}),
}


class InvalidPhase(RuntimeError):
    """Raised when code asks for a phase change the table above does not allow (a bug, not a fault)."""


def check(old: Phase, new: Phase) -> Phase:
    """`new`, unless `old -> new` is not in TRANSITIONS: then raise InvalidPhase."""
    if new not in TRANSITIONS[old]:
        raise InvalidPhase(f"experiment phase {old.name} -> {new.name} is not allowed")
    return new
