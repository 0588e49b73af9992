"""`[objective]` of tunerd.toml: what "better" means, in the one place it is configured (docs/objective.md).

`kind` names the objective: "goodput" (requests, or their tokens, per second that met the operator's
per-request targets — measured by the front door, core/slo.py), "throughput" (generated tokens per
second) or one latency percentile of vLLM's histograms ("ttft.p95", "itl.p95", "e2e.p95"). The targets
(`ttft_s`, `tpot_s`, `e2e_s`) say when a request is good; `attainment` is the share of good requests a
configuration must reach to be feasible; `count` whether goodput counts requests or output tokens.

The default kind is goodput — but goodput exists only with targets the operator sets and the door that
measures them. Without them the throughput objective stays in force (`in_force`), and `tunerd status`
says why. Writing `kind = "goodput"` explicitly without any target is refused (it could not mean anything).

`[tuning] objective` (the old key) is a deprecated alias: when `[objective] kind` is not written, it sets
the kind ("throughput.generation" is "throughput"); when both are written they must agree. After loading
it holds the configured kind's objective name ("slo.goodput" for goodput, the default kind): what trials
compare when it is in force (policy/verdict.py asks `in_force`, and compares throughput — saying why —
when goodput lacks its targets or the door). Config cannot
import the policy: `OBJECTIVE_NAMES` maps each kind to its `policy/objective.py` class name, and a unit
test holds the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tunerd.core.slo import Count, Targets

Kind = Literal["goodput", "throughput", "ttft.p95", "itl.p95", "e2e.p95"]
# kind → the name of its objective (policy/objective.py: `Objective.name`, a signal of docs/signals.md).
OBJECTIVE_NAMES: dict[str, str] = {
    "goodput": "slo.goodput",
    "throughput": "throughput.generation",
    "ttft.p95": "ttft.p95",
    "itl.p95": "itl.p95",
    "e2e.p95": "e2e.p95",
}
# `[tuning] objective` (deprecated) → kind.
ALIASES: dict[str, str] = {"throughput.generation": "throughput", "ttft.p95": "ttft.p95",
                           "itl.p95": "itl.p95", "e2e.p95": "e2e.p95", "slo.goodput": "goodput"}  # fmt: skip
# A window with fewer of the door's requests than this says nothing of attainment (`min_requests`).
MIN_REQUESTS = 20


class ObjectiveConfig(BaseModel):
    """`[objective]` (see the module doc). Frozen; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind = "goodput"
    # Per-request targets, in seconds (None: not judged): the client's time to first token (arrival at the
    # door → first byte; a non-streamed answer's is its end-to-end time), its time per output token after
    # the first, its end-to-end time.
    ttft_s: float | None = Field(default=None, gt=0)
    tpot_s: float | None = Field(default=None, gt=0)
    e2e_s: float | None = Field(default=None, gt=0)
    attainment: float = Field(default=0.95, gt=0, le=1)
    count: Count = "requests"
    # A trial's window with fewer of the door's requests than this is extended once, then inconclusive.
    min_requests: int = Field(default=MIN_REQUESTS, ge=1)

    @model_validator(mode="after")
    def _goodput_needs_a_target(self) -> ObjectiveConfig:
        if "kind" in self.model_fields_set and self.kind == "goodput" and not self.targets.any:
            raise ValueError(
                "kind: goodput needs at least one per-request target: set ttft_s, tpot_s or e2e_s "
                "(or leave kind out: throughput stays in force until targets are set)"
            )
        return self

    @property
    def targets(self) -> Targets:
        return Targets(self.ttft_s, self.tpot_s, self.e2e_s)


@dataclass(frozen=True)
class InForce:
    """The objective that applies: its kind, its `policy/objective.py` name, and why when it is not the
    configured one (`reason` "" when it is)."""

    kind: str
    name: str
    reason: str = ""


def in_force(objective: ObjectiveConfig, door_enabled: bool) -> InForce:
    """What applies under `objective` (pure): goodput needs targets and the door that measures them;
    without either, throughput — and the reason, for `tunerd status`."""
    kind = objective.kind
    if kind == "goodput":
        if not objective.targets.any:
            why = "goodput has no targets ([objective] ttft_s, tpot_s, e2e_s): throughput is in force"
            return InForce("throughput", OBJECTIVE_NAMES["throughput"], why)
        if not door_enabled:
            why = "goodput is measured per request by the front door, which is off: throughput is in force"
            return InForce("throughput", OBJECTIVE_NAMES["throughput"], why)
    return InForce(kind, OBJECTIVE_NAMES[kind])


def resolve_alias(data: dict) -> dict:
    """The raw config document with `[tuning] objective` (deprecated) carried into `[objective] kind`,
    and `[tuning] objective` set to the configured kind's objective (policy/verdict.py reads it; for
    goodput — the default kind — it asks `in_force` too, and falls back to throughput with its reason).
    Raises ValueError when both keys are written and disagree. Leaves a malformed document for
    validation."""
    tuning, objective = data.get("tuning", {}), data.get("objective", {})
    if not isinstance(tuning, dict) or not isinstance(objective, dict):
        return data
    old = tuning.get("objective")
    kind = objective.get("kind")
    if old is not None and isinstance(old, str) and old in ALIASES:
        if kind is None:
            objective = {**objective, "kind": ALIASES[old]}
        elif kind != ALIASES[old]:
            raise ValueError(
                f"{old!r} (deprecated: [objective] kind replaces it) disagrees with "
                f"objective.kind = {kind!r}: remove tuning.objective"
            )
        kind = objective["kind"]
    elif old is not None:
        return data  # not a name it knows: validation says so
    if kind is None:
        kind = ObjectiveConfig.model_fields["kind"].default
    trial = OBJECTIVE_NAMES.get(kind) if isinstance(kind, str) else None
    if trial is None:  # not a kind: validation says so
        trial = OBJECTIVE_NAMES["throughput"]
    return {**data, "objective": objective, "tuning": {**tuning, "objective": trial}}
