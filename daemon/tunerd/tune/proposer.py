"""A fired rule's action → the one change of its trial (the decisions are policy.tunables'): the step of
its parameter, else of the next in its `then` list; a revert of the last kept change while it is still in
force.

The door's cap (`door.max_in_flight`) is not tried: the door steers it live toward the targets
(door/limit.py) or the operator pins it, so a rule naming it moves its `then`. And while the steered cap
is still moving toward targets it misses (`restart_wait`: supervise/door_link.py), a rule's restart knob
waits — deferred, not muted —: restart knobs are tried once the cap meets the targets or cannot (issue 21).

Under KV pressure (a rule on `kv_cache.*` or `preemptions.*` stepping `max_num_seqs` down) the first step
is the KV cache's arithmetic (policy/first_step.py: how many requests of the window's size the cache
holds, rounded down to a CUDA-graph capture size); the rule's factor is the fallback when it has no input
or lands nowhere useful, and the proposal says which one proposed it (`proposed_by`, `arithmetic`). A
`max_num_seqs` at or below a concurrency the door's cap already lost under this load (`door_lost`:
supervise/door_link.py) is not tried — deferred, as the door's memory of it ages out (issue 22) —, nor
one at or above the cap the door steers now (`door_cap`): vLLM runs no more at once than the cap lets
through, so the restart would change nothing but cost a start (the H100's closed loop, docs/gpu.md's
seventh lease: the cap met the targets at 18, and a restart to 8 held 64 clients for 93 s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from tunerd.config import Config
from tunerd.config.rules import Rule, StepAction
from tunerd.core.params import LIVE_PARAMS, EngineParams, batch_defaults, default_block_size
from tunerd.policy.evidence import WindowStats
from tunerd.policy.first_step import (
    MODEL,
    FirstStep,
    KvShape,
    LostCap,
    NoFirstStep,
    kv_first_step,
    lost_to_door,
)
from tunerd.policy.tunables import REGISTRY, NoProposal, Proposal, bounds_of, propose
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
        door_lost: Callable[[], Sequence[LostCap]] | None = None,
        door_cap: Callable[[], int | None] | None = None,
    ) -> None:
        self.life = lifecycle
        self.memory = memory
        self._config = config
        self.restart_wait = restart_wait
        self.door_lost = door_lost  # the concurrencies the door's cap lost under this load (non-blocking)
        self.door_cap = door_cap  # the cap the door steers now, None: none (non-blocking)

    @property
    def config(self) -> Config:
        return self._config()

    def propose(
        self,
        rule: Rule,
        running: float | None = None,
        window: WindowStats | None = None,
        history: WindowStats | None = None,
    ) -> Proposal | NoProposal:
        """The rule's change: its parameter's step, else (at a bound, tabu) the next of `then`'s.
        `running`: requests vLLM ran at once in the before window (a concurrency limit above it does
        not bind, and steps down from it); `window`: the before window (its tokens per request size the
        KV model's first step under KV pressure); `history`: the serving run so far, whose tokens per
        request stand in when no request finished in the before window."""
        params = self.life.params
        if rule.action.kind == "revert":
            return self._revert(params)
        assert isinstance(rule.action, StepAction)
        reasons, deferred = [], False
        for name in (rule.action.param, *rule.action.then):
            if name in LIVE_PARAMS:
                reasons.append(f"{name}: {DOOR_OWN}")
                continue
            waits = self.restart_wait() if self.restart_wait is not None else None
            if waits is not None:
                return NoProposal(waits, exhausted=False)
            action = rule.action.model_copy(update={"param": name, "then": []})
            proposal = self._step(action, params, running)
            if name == "max_num_seqs" and action.direction == "down":
                proposal = self._kv_first(rule, params, (window, history), proposal)
                proposal = self._below_the_steered_cap(proposal)
            if isinstance(proposal, Proposal):
                return replace(proposal, notes=(*proposal.notes, *reasons))
            reasons.append(f"{name}: {proposal.reason}")
            deferred = deferred or not proposal.exhausted  # not yet (the door's memory ages out): not muted
        return NoProposal("; ".join(reasons), exhausted=not deferred)

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

    def _kv_first(
        self,
        rule: Rule,
        params: EngineParams,
        windows: tuple[WindowStats | None, WindowStats | None],
        step: Proposal | NoProposal,
    ) -> Proposal | NoProposal:
        """A down-step of max_num_seqs: under KV pressure the KV model's value first, the rule's `step` the
        fallback (its notes say why); either is refused at or below a concurrency the door's cap lost.
        `windows`: the before window and the serving run so far."""
        lost = tuple(self.door_lost()) if self.door_lost is not None else ()
        window, history = windows
        if kv_pressure(rule) and window is not None:
            model = self._model(params, window, history, lost)
            if isinstance(model, FirstStep):
                notes = ["the KV model proposed it (the rule's step is the fallback)"]
                if params.max_num_seqs is None:
                    notes.append("max_num_seqs is not set: below vLLM's default")
                return Proposal(
                    "max_num_seqs",
                    params.max_num_seqs,
                    model.value,
                    params.replace(max_num_seqs=model.value),
                    tuple(notes),
                    proposed_by=MODEL,
                    arithmetic=model.arithmetic,
                )
            why = f"kv model: {model.reason}" + (f" ({model.arithmetic})" if model.arithmetic else "")
            if isinstance(step, Proposal):
                step = replace(step, notes=(*step.notes, why))
        why_lost = lost_to_door(step.new, lost) if isinstance(step, Proposal) else None
        if why_lost is not None:
            return NoProposal(why_lost, exhausted=False)  # the door's memory ages out: deferred
        return step

    def _below_the_steered_cap(self, proposal: Proposal | NoProposal) -> Proposal | NoProposal:
        """A max_num_seqs at or above the cap the door steers now is deferred (the cap moves): vLLM runs
        no more at once than the cap lets through."""
        steered = self.door_cap() if self.door_cap is not None else None
        if not isinstance(proposal, Proposal) or steered is None or proposal.new < steered:
            return proposal
        return NoProposal(
            f"the door's steered cap runs {steered} at once already, no more than max_num_seqs="
            f"{proposal.new} would: a restart to it buys nothing the cap does not",
            exhausted=False,
        )

    def _model(
        self,
        params: EngineParams,
        window: WindowStats,
        history: WindowStats | None,
        lost: Sequence[LostCap],
    ) -> FirstStep | NoFirstStep:
        """The KV model's first step from the run in force and the before window (the run so far when no
        request finished in that window)."""
        sizes, sizes_from = window, None
        if (
            not window.generation_tokens_per_request
            and history is not None
            and history.generation_tokens_per_request
        ):
            sizes = history
            sizes_from = f"the run's last {history.seconds:.0f} s: none finished in the before window"
        run = self.life.engine.run
        machine = run.machine if run is not None else None
        backend = machine.backend if machine is not None else "cuda"
        gpu_total = machine.memory.gpu_total_bytes if machine is not None else None
        kv_tokens, source = None, ""
        if run is not None and run.kv_cache is not None:
            kv_tokens, source = run.kv_cache.tokens, "vLLM's log"
        elif run is not None and run.predicted_kv_tokens is not None:
            kv_tokens, source = run.predicted_kv_tokens, "the planner's prediction"
        version = run.report.report().vllm_version if run is not None else None
        shape = KvShape(
            kv_tokens=kv_tokens,
            kv_source=source,
            block_size=params.block_size or default_block_size(backend, version=version),
            prompt_tokens=sizes.prompt_tokens_per_request,
            output_tokens=sizes.generation_tokens_per_request,
            backend=backend,
            capture_sizes=run.capture_sizes if run is not None else None,
            sizes_from=sizes_from,
        )
        tuning = self.config.tuning
        unified = bool(machine is not None and machine.memory.unified)
        bounds = bounds_of(
            REGISTRY["max_num_seqs"],
            tuning.bounds,
            backend,
            unified,
            tuning.unified_max_gpu_memory_utilization,
        )
        current = params.max_num_seqs or batch_defaults(backend, gpu_total)[0]
        return kv_first_step(shape, current=current, bounds=bounds, tabu=self.memory.tabu(), lost=lost)

    def _revert(self, params: EngineParams) -> Proposal | NoProposal:
        """Undo the last kept change, if it is still in force."""
        if not self.memory.state.kept:
            return NoProposal("no kept change to revert")
        last = self.memory.state.kept[-1]
        if last.param in LIVE_PARAMS:  # kept by an older tunerd's trial
            return NoProposal(f"the last kept change ({last.param} → {last.new}): {DOOR_OWN}")
        if getattr(params, last.param) != last.new:
            return NoProposal(f"the last kept change ({last.param} → {last.new}) is no longer in force")
        return Proposal(
            last.param,
            last.new,
            last.old,
            params.replace(**{last.param: last.old}),
            ("revert",),
            proposed_by="rule revert",
        )


def kv_pressure(rule: Rule) -> bool:
    """Whether `rule` reads KV pressure: a term on the KV cache's usage or on preemptions."""
    return any(term.signal.split(".")[0] in ("kv_cache", "preemptions") for term in rule.terms)
