"""The tuning memory shared by a fleet of boxes (`[memory] url`): what this box sends, what it takes.

Sending: the local experience file (records/experience.py) is the write-ahead. Every `sync_interval_s`
the loop hands the entries measured here and not yet sent (a copy: the job never touches the file) to a
worker job (records/fleet_store.py: psycopg, idempotent on the entry's id), which also fetches the other
boxes' entries every `refresh_s` into `snapshot`. With the database down the job fails, the loop
journals `memory.fleet_unreachable` once (with the reason) and tunes alone; the next exchange that works
sends everything unsent and journals `memory.fleet_back`. Nothing waits for the database: the loop
only looks whether the job is done.

Taking (pure, on the snapshot; `fleet_bad_values`, `fleet_first`): before a trial, under the trial's
key (model, hardware, vLLM version, workload), the values whose latest outcome elsewhere was a revert
or a failure join the tabu list, and — for a parameter this box has not tried under that key — the best
value another box kept, when it lies in the direction the rule steps, is proposed instead of the rule's
own step. It is a trial like any other: verified here, kept or reverted. Both are journaled
(`memory.from_fleet`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog

from tunerd.config import Config
from tunerd.config.memory import redact
from tunerd.policy.objective import direction_of
from tunerd.policy.tunables import Proposal
from tunerd.records.experience import BAD_DECISIONS, Entry, Experience, ExperienceKey
from tunerd.records.fleet_store import Exchange, FleetError, FleetStore
from tunerd.records.recorder import Recorder
from tunerd.tune.memory import TuningMemory

log = structlog.get_logger("tunerd")

TRIAL_KINDS = ("trial", "explore")
HOST_ENV = "TUNERD_FLEET_HOST"  # the box's name in the fleet when [memory] host is not set (the chart: node)


class Store(Protocol):
    """What the fleet needs of the database (records.fleet_store.FleetStore; a fake in the unit tests)."""

    def exchange(self, entries: Sequence[Entry], *, fetch: bool) -> Exchange: ...


@dataclass(frozen=True)
class FleetValue:
    """A value the fleet knows: `param` = `value`, measured by `host`, and why it counts."""

    param: str
    value: Any
    host: str
    why: str
    objective: float | None = None
    objective_name: str | None = None


# -- the decisions (pure) ---------------------------------------------------------------------------


def _outcomes(snapshot: Iterable[Entry], key: ExperienceKey) -> dict[tuple[str, str], Entry]:
    """The latest verified trial or exploration entry of each (param, value) under `key`."""
    latest: dict[tuple[str, str], Entry] = {}
    for entry in sorted(snapshot, key=lambda e: e.at):
        param = entry.figures.get("param")
        if entry.key != key or entry.kind not in TRIAL_KINDS or not entry.verified:
            continue
        if not isinstance(param, str) or param not in entry.params:
            continue
        latest[(param, repr(entry.params[param]))] = entry
    return latest


def fleet_bad_values(snapshot: Iterable[Entry], key: ExperienceKey) -> list[FleetValue]:
    """The values whose latest outcome under `key` elsewhere was bad (decision in BAD_DECISIONS): a
    value another box reverted, then kept, is not listed."""
    bad = []
    for (param, _), entry in _outcomes(snapshot, key).items():
        if entry.decision in BAD_DECISIONS:
            reason = entry.figures.get("reason")
            why = f"{entry.host}: {entry.kind} {entry.decision}" + (f": {reason}" if reason else "")
            bad.append(FleetValue(param, entry.params[param], entry.host or "?", why))
    return bad


def fleet_first(
    snapshot: Iterable[Entry],
    key: ExperienceKey,
    proposal: Proposal,
    *,
    local: Iterable[Entry],
    tabu: Iterable[tuple[str, Any]],
    objective: str,
    bounds: tuple[float, float] | None = None,
) -> FleetValue | None:
    """The value of `proposal.param` to try instead of the rule's step: the best one another box kept
    under `key` — by `objective` where kept values of it are known (its direction), else the latest
    kept — that lies on the side of `proposal.old` the rule steps to, within `bounds`, is not `tabu`,
    and whose latest outcome elsewhere is not bad. None when this box already tried the parameter
    under `key` (`local`: its own entries; its own figures come first) or nothing qualifies."""
    param, old, new = proposal.param, proposal.old, proposal.new
    if any(e.key == key and e.kind in TRIAL_KINDS and e.figures.get("param") == param for e in local):
        return None
    if not isinstance(old, int | float) or not isinstance(new, int | float) or new == old:
        return None
    forbidden = {repr(v) for p, v in tabu if p == param}
    step_up = new > old
    kept = []
    for (name, _), entry in _outcomes(snapshot, key).items():
        value = entry.params[name]
        if name != param or entry.kind != "trial" or entry.decision != "keep":
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or value == old:
            continue
        if (value > old) != step_up or repr(value) in forbidden:
            continue
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            continue
        kept.append(entry)
    if not kept:
        return None
    ranked = [e for e in kept if e.objective_name == objective and e.objective is not None]
    direction = direction_of(objective)
    if ranked and direction is not None:
        sign = 1.0 if direction == "higher" else -1.0
        best = max(ranked, key=lambda e: (sign * e.objective, e.at))  # type: ignore[operator]
    else:
        best = max(kept, key=lambda e: e.at)
    reason = best.figures.get("reason")
    why = f"{best.host}: kept {param} {best.figures.get('old')} → {best.params[param]}" + (
        f" ({reason})" if reason else ""
    )
    return FleetValue(param, best.params[param], best.host or "?", why, best.objective, best.objective_name)


def with_value(proposal: Proposal, value: Any, note: str) -> Proposal | None:
    """`proposal` with its new value `value`; None when the configuration would not validate."""
    try:
        params = proposal.params.replace(**{proposal.param: value})
    except ValueError:
        return None
    return replace(proposal, new=value, params=params, notes=(*proposal.notes, note))


# -- the exchange (the loop's side) -------------------------------------------------------------------


class Fleet:
    """The loop's side of the shared memory: starts exchanges, takes their results, holds the snapshot."""

    def __init__(
        self,
        config: Callable[[], Config],
        experience: Experience,
        store: Store,
        *,
        host: str,
        recorder: Recorder,
        submit: Callable[[Callable[[], Exchange]], Future[Exchange]],
    ) -> None:
        self.config = config
        self.experience = experience
        self.store = store
        self.host = host
        self.rec = recorder
        self.submit = submit
        self.snapshot: tuple[Entry, ...] = ()
        self.unreachable: str | None = None  # why, while the database cannot be used
        self.schema: int | None = None
        self._sent: set[str] = set()
        self._job: Future[Exchange] | None = None
        self._fetching = False
        self._next_sync = float("-inf")
        self._next_fetch = float("-inf")
        self._hosts: tuple[str, ...] | None = None  # of the last snapshot journaled

    @property
    def url(self) -> str | None:
        return redact(self.config().memory.url)

    def unsent(self) -> tuple[Entry, ...]:
        """The entries measured here (not imported, not the fleet's) not yet sent."""
        return tuple(
            e
            for e in self.experience.entries()
            if e.host is None and e.origin is None and e.entry_id() not in self._sent
        )

    def step(self, now: float) -> None:
        """Every tick: take a finished exchange's result; start the next one when due."""
        if self._job is not None:
            if not self._job.done():
                return
            job, self._job = self._job, None
            self._take(job, now)
        if now < self._next_sync:
            return
        memory = self.config().memory
        self._next_sync = now + memory.sync_interval_s
        self._fetching = fetch = now >= self._next_fetch
        unsent, store = self.unsent(), self.store
        self._job = self.submit(lambda: store.exchange(unsent, fetch=fetch))

    def _take(self, job: Future[Exchange], now: float) -> None:
        try:
            result = job.result()
        except Exception as exc:  # FleetError, or a bug of the store: tune alone, say so once
            reason = str(exc) if isinstance(exc, FleetError) else f"{type(exc).__name__}: {exc}"
            if self.unreachable is None:
                self.rec.record("memory.fleet_unreachable", url=self.url, reason=reason, mode="tuning alone")
                log.warning("memory.fleet_unreachable", url=self.url, reason=reason)
            self.unreachable = reason
            return
        if self.unreachable is not None:
            self.rec.record("memory.fleet_back", url=self.url, after=self.unreachable, sent=len(result.sent))
            self.unreachable = None
        if self.schema is None or result.schema != self.schema:
            self._schema(result.schema)
        self._sent.update(result.sent)
        if result.sent:
            self.rec.record("memory.fleet_sent", entries=len(result.sent))
        if result.snapshot is not None:
            self.snapshot = result.snapshot
            self._next_fetch = now + self.config().memory.refresh_s
            hosts = tuple(sorted({e.host or "?" for e in result.snapshot}))
            if hosts != self._hosts:
                self._hosts = hosts
                self.rec.record("memory.fleet_snapshot", entries=len(result.snapshot), hosts=list(hosts))

    def _schema(self, version: int) -> None:
        from tunerd.records.fleet_store import SCHEMA_VERSION

        self.schema = version
        if version > SCHEMA_VERSION:  # a newer tunerd migrated: additive, this one goes on
            self.rec.record(
                "memory.fleet_schema_newer",
                schema=version,
                known=SCHEMA_VERSION,
                detail="a newer tunerd migrated the database; this one reads and writes the columns it knows",
            )

    # -- taking ---------------------------------------------------------------------------------------

    def bad_values(self, key: ExperienceKey | None) -> list[FleetValue]:
        return fleet_bad_values(self.snapshot, key) if key is not None and self.snapshot else []

    def first(
        self, key: ExperienceKey | None, proposal: Proposal, tabu: Iterable[tuple[str, Any]]
    ) -> FleetValue | None:
        """The fleet's value to try first instead of `proposal`'s, or None (`fleet_first`)."""
        if key is None or not self.snapshot:
            return None
        config = self.config()
        bounds = config.tuning.bounds.get(proposal.param)
        return fleet_first(
            self.snapshot,
            key,
            proposal,
            local=self.experience.entries(key),
            tabu=tabu,
            objective=config.tuning.objective,
            bounds=bounds,
        )

    def take_bad_values(self, key: ExperienceKey | None, memory: TuningMemory) -> None:
        """The values that lost on other boxes under `key` (a trial's) join `memory`'s tabu list
        (journaled, `memory.from_fleet`)."""
        taken = []
        for bad in self.bad_values(key):
            if (bad.param, bad.value) not in memory.tabu():
                memory.add_tabu(bad.param, bad.value, f"fleet: {bad.why}")
                taken.append({"param": bad.param, "value": bad.value, "host": bad.host, "why": bad.why})
        if taken:
            self.rec.record("memory.from_fleet", taken="tabu", values=taken, key=str(key))

    def take_first(
        self, key: ExperienceKey | None, proposal: Proposal, tabu: Iterable[tuple[str, Any]]
    ) -> Proposal:
        """`proposal` with the best value another box kept for its parameter, to try first (verified
        here like any trial; journaled, `memory.from_fleet`), or `proposal` itself when there is none."""
        found = self.first(key, proposal, tabu)
        if found is None:
            return proposal
        changed = with_value(proposal, found.value, f"fleet: {found.why}")
        if changed is None:
            return proposal
        self.rec.record(
            "memory.from_fleet",
            taken="first proposal",
            param=proposal.param,
            old=proposal.old,
            new=found.value,
            instead_of=proposal.new,
            host=found.host,
            objective=found.objective,
            objective_name=found.objective_name,
            key=str(key),
        )
        return replace(changed, proposed_by="fleet", arithmetic=None)


def fleet_for(
    config: Callable[[], Config],
    experience: Experience,
    *,
    recorder: Recorder,
    submit: Callable[[Callable[[], Exchange]], Future[Exchange]],
) -> Fleet | None:
    """The fleet of `[memory] url`, None when none is configured."""
    memory = config().memory
    if memory.url is None:
        return None
    # In a pod the host name is the pod's, new at every restart: the chart names the node instead.
    host = memory.host or os.environ.get(HOST_ENV) or socket.gethostname()
    store = FleetStore(memory, host)
    return Fleet(config, experience, store, host=host, recorder=recorder, submit=submit)
