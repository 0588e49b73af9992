"""Rule evaluation (pure): signals, the rule's state and `now` in; the new state and whether it fired out.

- A term is `signal op threshold`; a relative threshold is `factor × baseline[signal]`.
- Missing data never fires a rule: a term without a value (no sample, no baseline) makes the condition
  unknown, and unknown restarts the `for` clock (a gap in the data is not a condition that held).
- Hysteresis: a term that holds keeps holding until its value is `hysteresis` (a share of the threshold)
  past the threshold, so a value hovering at it does not flap.
- A histogram percentile (`ttft.p95`, `itl.p95`, ...: a signal with bucket edges, `quantile_bucket_of`)
  is only known to lie in its bucket `(lo, hi]`, so its term is decided by the whole bucket: `> t` holds
  when lo ≥ t and does not when hi ≤ t; in between it is *undecidable at this bucket* and, like missing
  data, decides nothing (issue 21: `ttft.p95 > 2.0` fired on 2.02 s interpolated in the 1.0–2.5 s bucket
  while no client waited over 1.26 s; that trial cost two restarts). A threshold at a bucket edge is
  always decidable. Exact figures (the door's `door.ttft.p95`) compare by value.
- A rule fires when its condition has held for `for_s` without a gap, outside its cooldown and mute;
  firing starts the cooldown and the `for` clock afresh (new evidence is needed to fire again).
- A rule that fired is resolved once its condition has been false for `for_s` without a gap (unknown
  restarts that clock too), as an alert resolves: the journal's end of the story when a kept change
  eased the condition and no trial follows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from tunerd.config.rules import Rule, Term
from tunerd.core.signal_window import quantile_bucket_of

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}


@dataclass(frozen=True, slots=True)
class TermValue:
    """One term at one evaluation: the signal's value, the threshold it was held against, the verdict;
    for a histogram percentile, the bucket `(lo, hi]` its value falls in (hi inf: the +Inf bucket)."""

    term: str
    value: float | None
    threshold: float | None
    holds: bool | None  # None: unknown (no value, a relative term without a baseline, or undecidable)
    bucket: tuple[float, float] | None = None

    @property
    def undecidable(self) -> bool:
        """Known value, known threshold, but the threshold lies inside the value's bucket."""
        return self.holds is None and self.bucket is not None and self.threshold is not None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "term": self.term,
            "value": self.value,
            "threshold": self.threshold,
            "holds": self.holds,
        }
        if self.bucket is not None:  # the +Inf bucket's upper edge is None: JSON has no inf
            lo, hi = self.bucket
            out["bucket"] = [lo, hi if hi != float("inf") else None]
            if self.undecidable:
                out["undecidable"] = True
        return out


@dataclass(frozen=True, slots=True)
class RuleState:
    """What the evaluation remembers of one rule between polls (monotonic times)."""

    holding_since: float | None = None  # the condition has held without a gap since then
    holding: tuple[bool, ...] = ()  # per term: held at the last evaluation (hysteresis)
    last_fired: float | None = None
    cooldown_until: float = float("-inf")
    muted_until: float = float("-inf")  # the tuning memory's mute (tune/memory.py keeps why, and losses)
    firing: bool = False  # fired and not yet resolved
    clear_since: float | None = None  # while firing: the condition has been false without a gap since then
    last: tuple[TermValue, ...] = field(default_factory=tuple)  # the last evaluation, for `tunerd rules`

    def fresh(self) -> RuleState:
        """The state for a new engine run: the condition must hold (or clear) anew; cooldown, mute and
        whether it is firing stay."""
        return replace(self, holding_since=None, holding=(), last=(), clear_since=None)


@dataclass(frozen=True, slots=True)
class Evaluation:
    state: RuleState
    holds: bool | None  # the condition now (None: unknown)
    fired: bool
    terms: tuple[TermValue, ...]
    resolved: bool = False  # a firing rule's condition has been false for `for_s` (once per firing)


def term_value(
    term: Term,
    signals: Mapping[str, float | None],
    baseline: Mapping[str, float],
    was_holding: bool,
    hysteresis: float,
) -> TermValue:
    """Evaluate one term; a held term releases only `hysteresis × |threshold|` past the threshold. A
    histogram percentile is decided by its whole bucket (`bucket_holds`): unknown when undecidable."""
    value = signals.get(term.signal)
    threshold: float | None = term.threshold
    if term.relative:
        base = baseline.get(term.signal)
        threshold = None if base is None else term.threshold * base
    bucket = quantile_bucket_of(signals, term.signal)
    if value is None or threshold is None:
        return TermValue(str(term), value, threshold, None, bucket)
    margin = abs(threshold) * hysteresis if was_holding else 0.0
    if term.op in (">", ">="):
        against = threshold - margin
    elif term.op in ("<", "<="):
        against = threshold + margin
    else:
        against = threshold
    holds = _OPS[term.op](value, against) if bucket is None else bucket_holds(term.op, bucket, against)
    return TermValue(str(term), value, threshold, holds, bucket)


def bucket_holds(op: str, bucket: tuple[float, float], threshold: float) -> bool | None:
    """Whether `value op threshold` holds for every value in the bucket `(lo, hi]` (True), for none
    (False), or for some only (None: undecidable at this bucket). Pure."""
    lo, hi = bucket
    if op == ">":
        return True if lo >= threshold else False if hi <= threshold else None
    if op == ">=":
        return True if lo >= threshold else False if hi < threshold else None
    if op == "<":
        return True if hi < threshold else False if lo >= threshold else None
    if op == "<=":
        return True if hi <= threshold else False if lo >= threshold else None
    outside = threshold <= lo or threshold > hi  # `==` / `!=`: decided only when t is outside the bucket
    if op == "==":
        return False if outside else None
    return True if outside else None


def condition(rule: Rule, terms: tuple[TermValue, ...]) -> bool | None:
    """`all` / `any` over the terms; unknown if any term is unknown (missing data decides nothing)."""
    verdicts = [t.holds for t in terms]
    if any(v is None for v in verdicts):
        return None
    return all(verdicts) if rule.combine == "all" else any(verdicts)


def evaluate(
    rule: Rule,
    state: RuleState,
    signals: Mapping[str, float | None],
    baseline: Mapping[str, float],
    now: float,
) -> Evaluation:
    """One evaluation of `rule` at monotonic `now`. Fires at most once per cooldown, never while muted."""
    held = state.holding if len(state.holding) == len(rule.terms) else (False,) * len(rule.terms)
    terms = tuple(
        term_value(term, signals, baseline, was, rule.hysteresis)
        for term, was in zip(rule.terms, held, strict=True)
    )
    holds = condition(rule, terms)
    holding = tuple(bool(t.holds) for t in terms)
    if not holds:  # False or unknown: the `for` clock starts again
        new = replace(state, holding_since=None, holding=holding if holds is False else (), last=terms)
        if not state.firing:
            return Evaluation(new, holds, False, terms)
        if holds is None:  # no evidence that it cleared
            return Evaluation(replace(new, clear_since=None), holds, False, terms)
        clear = state.clear_since if state.clear_since is not None else now
        if now - clear < rule.for_s:
            return Evaluation(replace(new, clear_since=clear), holds, False, terms)
        return Evaluation(replace(new, firing=False, clear_since=None), holds, False, terms, resolved=True)
    since = state.holding_since if state.holding_since is not None else now
    new = replace(state, holding_since=since, holding=holding, last=terms, clear_since=None)
    ready = now - since >= rule.for_s and now >= new.cooldown_until and now >= new.muted_until
    if not ready:
        return Evaluation(new, holds, False, terms)
    fired = replace(new, holding_since=now, last_fired=now, cooldown_until=now + rule.cooldown_s, firing=True)
    return Evaluation(fired, holds, True, terms)


def eased(rule: Rule, before: tuple[TermValue, ...], after: tuple[TermValue, ...], tolerance: float) -> bool:
    """Whether the triggering condition eased: it no longer holds, or at least one term that held moved
    away from holding by more than `tolerance` (a share of its value before; preemptions 2/s → 1/s eased
    `preemptions.rate > 0` though it still holds). A term that did not hold before cannot ease it. A
    histogram percentile moved only when its bucket after lies wholly on the easing side of its bucket
    before: a move within one bucket is interpolation, not evidence."""
    if condition(rule, after) is False:
        return True
    for term, b, a in zip(rule.terms, before, after, strict=True):
        if b.value is None or a.value is None or not b.holds:
            continue
        change = abs(b.value) * tolerance
        if term.op in (">", ">=") and a.value < b.value - change and _below(a.bucket, b.bucket):
            return True
        if term.op in ("<", "<=") and a.value > b.value + change and _below(b.bucket, a.bucket):
            return True
    return False


def _below(low: tuple[float, float] | None, high: tuple[float, float] | None) -> bool:
    """Bucket `low` lies wholly at or below bucket `high` (True where either is not a bucket: exact)."""
    return low is None or high is None or low[1] <= high[0]
