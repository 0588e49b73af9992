"""A fired rule's action → the one change of its trial (the decisions are policy.tunables'): the step of
its parameter, else of the next in its `then` list; a live knob's (no restart) with the value in force on
the running daemon; a revert of the last kept change while it is still in force.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tunerd.config import Config
from tunerd.config.rules import Rule, StepAction
from tunerd.core.params import EngineParams
from tunerd.policy.tunables import LIVE, NoProposal, Proposal, propose, propose_live
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.memory import TuningMemory
from tunerd.tune.trials import LiveKnobs


class Proposer:
    def __init__(
        self,
        lifecycle: Lifecycle,
        memory: TuningMemory,
        knobs: LiveKnobs | None,
        config: Callable[[], Config],
    ) -> None:
        self.life = lifecycle
        self.memory = memory
        self.knobs = knobs
        self._config = config

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
        if action.param in LIVE:
            if self.knobs is None:
                return NoProposal("the front door is off ([door] enabled)")
            current = self.knobs.value(action.param)
            return propose_live(
                action, params, current, backend=backend, bounds=tuning.bounds, tabu=self.memory.tabu(),
                gpu_total_bytes=gpu_total, running=running,
            )  # fmt: skip
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
        if last.param in LIVE:
            in_force = self.knobs.value(last.param) if self.knobs is not None else None
            if in_force != last.new:
                return NoProposal(f"the last kept change ({last.param} → {last.new}) is no longer in force")
            return Proposal(last.param, last.new, last.old, params, ("revert",), live=True)
        if getattr(params, last.param) != last.new:
            return NoProposal(f"the last kept change ({last.param} → {last.new}) is no longer in force")
        return Proposal(last.param, last.new, last.old, params.replace(**{last.param: last.old}), ("revert",))
