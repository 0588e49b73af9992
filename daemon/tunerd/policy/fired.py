"""What to do with a fired rule (pure): act on a proposal, defer, mute the rule, or only alert.

`decide` is the decision half of the tuner's `_fired` (tune/tuner.py): the tuner gathers the facts,
asks this function once, journals what it decided (`rule.alert`, `rule.deferred`, `rule.exhausted`,
`trial.proposed`, a mute) and acts. In order, as the tuner always checked them:

1. an `alert` rule only alerts;
2. the gates (policy/gates.py: mode, pause, a change in flight, serving time, restart budget,
   maintenance window) defer it;
3. no before window (too few samples) defers it;
4. the proposal: none for a `revert` rule alerts (there is nothing to revert to); none for a step
   mutes the rule (nothing further to try);
5. a proposal that undoes a recently kept change mutes the rule (the flip-flop check);
6. a probe inside the before window defers it, holding the rule until the probe has left the window;
7. otherwise act (in dry-run: the proposal is only journaled).

The proposal is asked for through `propose`, called at most once and only past steps 1–3: asking has
effects on the tuning memory (the recall's known-bad values under this load go tabu first), which a
deferred rule must not have. Everything else is data; the maintenance window's answer is the caller's
(`config.MaintenanceWindow.opened_at`, through `gates.window_open`): the policy runs no cron parser.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from tunerd.config import TuningConfig
from tunerd.config.rules import Rule
from tunerd.policy.evidence import WindowStats
from tunerd.policy.gates import Budget, flip_flop, why_not_act_at
from tunerd.policy.rules import RuleState
from tunerd.policy.tunables import NoProposal, Proposal


@dataclass(frozen=True, slots=True)
class Act:
    """Run `proposal` as a trial (`dry_run`: journal it as `trial.proposed`, change nothing)."""

    proposal: Proposal
    before: WindowStats
    dry_run: bool
    kind: Literal["act"] = "act"


@dataclass(frozen=True, slots=True)
class Defer:
    """Not now, because `reason` (`rule.deferred`). `state`: the rule's new state when the deferral holds
    the rule (a probe in the before window), else None (the rule's state stays)."""

    reason: str
    state: RuleState | None = None
    kind: Literal["defer"] = "defer"


@dataclass(frozen=True, slots=True)
class Mute:
    """Mute the rule in the tuning memory for `reason`. `exhausted`: the proposer's reason when there is
    nothing further to try (journaled as `rule.exhausted`); None for a flip-flop."""

    reason: str
    exhausted: str | None = None
    kind: Literal["mute"] = "mute"


@dataclass(frozen=True, slots=True)
class Alert:
    """Only alert (`rule.alert`). `reason`: why no change was proposed (None for an `alert` rule)."""

    reason: str | None = None
    kind: Literal["alert"] = "alert"


Decision = Act | Defer | Mute | Alert


@dataclass(frozen=True, slots=True)
class Facts:
    """What the gates read when a rule fires. `change_in_flight`: a trial (or any change) holds the
    lifecycle's slot; `served_s`: seconds vLLM has served since its last start; `window_open`: no
    maintenance windows, or now lies in one; `kept`: the kept changes (wall time, param, old, new) the
    flip-flop check reads; `probe_quiet_s`: seconds since the last probe ended (0 while one runs, None
    before the first or with the probe off)."""

    paused: bool
    change_in_flight: bool
    budget: Budget
    served_s: float | None
    window_open: bool
    before: WindowStats | None
    kept: Sequence[tuple[float, str, object, object]] = ()
    probe_quiet_s: float | None = None


def decide(
    rule: Rule,
    state: RuleState,
    facts: Facts,
    propose: Callable[[WindowStats], Proposal | NoProposal],
    *,
    tuning: TuningConfig,
    now: float,
    now_wall: float,
) -> Decision:
    """What to do with `rule`, which just fired with `state`, at monotonic `now` and wall time `now_wall`
    (the flip-flop check's clock: kept changes carry wall times). See the module's docstring for the
    order; `propose(before)` is called at most once."""
    if rule.action.kind == "alert":
        return Alert()
    blocked = why_not_act_at(
        tuning=tuning,
        paused=facts.paused,
        trial_running=facts.change_in_flight,
        budget_left=facts.budget,
        served_s=facts.served_s,
        window_open=facts.window_open,
    )
    if blocked is not None:
        return Defer(blocked)
    before = facts.before
    if before is None:
        return Defer("not enough samples for a before window")
    proposal = propose(before)
    if isinstance(proposal, NoProposal):
        if rule.action.kind == "revert":
            return Alert(proposal.reason)
        if not proposal.exhausted:  # not yet (the door's cap still steers): fired again after its cooldown
            return Defer(proposal.reason)
        return Mute(f"nothing further to try: {proposal.reason}", exhausted=proposal.reason)
    flop = flip_flop(proposal.param, proposal.new, facts.kept, now_wall, tuning.tabu_s)
    if flop is not None:
        return Mute(flop)
    quiet = facts.probe_quiet_s
    if quiet is not None and quiet < tuning.window_s:
        # Held, not spent: the rule fires again once the probe has left the before window, not a
        # cooldown later (a probe rule fires right after its probe; its alert must not wait on this).
        return Defer(
            f"a probe ran {quiet:.0f} s ago: the before window ({tuning.window_s:g} s) must "
            "hold live traffic only",
            state=replace(state, cooldown_until=now + tuning.window_s - quiet),
        )
    return Act(proposal, before, dry_run=tuning.mode == "dry-run")
