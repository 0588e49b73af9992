"""What a tuning trial is, as the tuner (tune/tuner.py) keeps it: its rule, its change, its windows and
verdict, and the `Experiment` (tune/experiment.py) that runs its phases and its change; and the live
knobs a trial may turn without a restart."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from tunerd.config.rules import Rule
from tunerd.policy.evidence import Point, WindowStats
from tunerd.policy.tunables import Proposal, Value
from tunerd.policy.verdict import Verdict
from tunerd.tune.experiment import Experiment, Phase


class LiveKnobs(Protocol):
    """Parameters that change on the running daemon (policy.tunables.LIVE): the door's in-flight cap."""

    def value(self, name: str) -> Value | None: ...

    def set(self, name: str, value: Value | None, why: str) -> None: ...


@dataclass
class Trial:
    trial_id: int
    rule: Rule
    proposal: Proposal
    before: WindowStats
    before_values: dict[str, float | None]
    experiment: Experiment  # its phases and its change (tune/experiment.py)
    window_start: float | None = None
    extended: bool = False
    verdict: Verdict | None = None
    after: WindowStats | None = None

    @property
    def phase(self) -> Phase:
        return self.experiment.phase

    @property
    def phase_since(self) -> float:
        return self.experiment.since

    def describe(self) -> dict[str, Any]:
        p = self.proposal
        return {"trial": self.trial_id, "rule": self.rule.name, "param": p.param, "old": p.old, "new": p.new}


@dataclass
class RunSamples:
    """The per-poll samples of the serving run (a trial's windows never straddle a restart)."""

    run_id: int | None = None
    points: deque[Point] = field(default_factory=deque)
