"""A fired rule's action → the one change of its trial (the decisions are policy.tunables'): the step of
its parameter, else of the next in its `then` list; a revert of the last kept change while it is still in
force.

The door's cap (`door.max_in_flight`) is not tried: the door steers it live toward the targets
(door/limit.py) or the operator pins it, so a rule naming it moves its `then`. And while the steered cap
is still moving toward targets it misses (`restart_wait`: supervise/door_link.py), a rule's restart knob
waits — deferred, not muted —: restart knobs are tried once the cap meets the targets or cannot (issue 21).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tunerd.config import Config
from tunerd.config.rules import Rule, StepAction
from tunerd.core.params import LIVE_PARAMS, EngineParams
from tunerd.policy.tunables import NoProposal, Proposal, propose
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.memory import TuningMemory

DOOR_OWN = (
    "the door's own cap: steered live toward the [objective] targets or pinned by the operator "
    "(tunerd door), not tried by rules"
)


class Proposer:
    def __init__(
        self,
        lifecycle: Lifecycle,
        memory: TuningMemory,
        config: Callable[[], Config],
        restart_wait: Callable[[], str | None] | None = None,
    ) -> None:
        self.life = lifecycle
        self.memory = memory
        self._config = config
        self.restart_wait = restart_wait

    @property
    def config(self) -> Config:
        return self._config()

    def propose(self, rule: Rule, running: float | None = None) -> Proposal | NoProposal:
        """The rule's change: its parameter's step, else (at a bound, tabu) the next of `then`'s.
        `running`: requests vLLM ran at once in the before window (a concurrency limit above it does
        not bind, and steps down from it)."""
        params = self.life.params
        if rule.action.kind == "revert":
            return self._revert(params)
        assert isinstance(rule.action, StepAction)
        reasons = []
        for name in (rule.action.param, *rule.action.then):
            if name in LIVE_PARAMS:
                reasons.append(f"{name}: {DOOR_OWN}")
                continue
            waits = self.restart_wait() if self.restart_wait is not None else None
            if waits is not None:
                return NoProposal(waits, exhausted=False)
            action = rule.action.model_copy(update={"param": name, "then": []})
            proposal = self._step(action, params, running)
            if isinstance(proposal, Proposal):
                return replace(proposal, notes=(*proposal.notes, *reasons))
            reasons.append(f"{name}: {proposal.reason}")
        return NoProposal("; ".join(reasons))

    def _step(self, action: StepAction, params: EngineParams, running: float | None) -> Proposal | NoProposal:
        tuning = self.config.tuning
        run = self.life.engine.run
        machine = run.machine if run is not None else None
        backend = machine.backend if machine is not None else "cuda"
        gpu_total = machine.memory.gpu_total_bytes if machine is not None else None
        return propose(
            action,
            params,
            backend=backend,
            unified=bool(machine is not None and machine.memory.unified),
            bounds=tuning.bounds,
            unified_cap=tuning.unified_max_gpu_memory_utilization,
            tabu=self.memory.tabu(),
            gpu_total_bytes=gpu_total,
            running=running,
        )

    def _revert(self, params: EngineParams) -> Proposal | NoProposal:
        """Undo the last kept change, if it is still in force."""
        if not self.memory.state.kept:
            return NoProposal("no kept change to revert")
        last = self.memory.state.kept[-1]
        if last.param in LIVE_PARAMS:  # kept by an older tunerd's trial
            return NoProposal(f"the last kept change ({last.param} → {last.new}): {DOOR_OWN}")
        if getattr(params, last.param) != last.new:
            return NoProposal(f"the last kept change ({last.param} → {last.new}) is no longer in force")
        return Proposal(last.param, last.new, last.old, params.replace(**{last.param: last.old}), ("revert",))
