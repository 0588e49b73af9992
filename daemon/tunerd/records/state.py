"""Durable daemon state: instance id, last-known-good parameters, the engine process last started.

One JSON file, replaced atomically (write, fsync, rename, fsync dir) on every change, so a crash
leaves the previous or the new state and never a mix. The journal says what happened; this file
says what is true now.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunerd.records.durable import atomic_write


class EngineRecord(BaseModel):
    """The vLLM process tree tunerd started last; cleared once it is known to be gone."""

    model_config = ConfigDict(extra="ignore")

    pid: int
    pgid: int
    started: str
    log: str | None = None


class TabuEntry(BaseModel):
    """A parameter value no trial may propose until `until` (wall time, seconds since the epoch)."""

    model_config = ConfigDict(extra="ignore")

    param: str
    value: Any
    until: float
    why: str


class KeptChange(BaseModel):
    """A change a trial kept: when (wall time), which parameter, from and to."""

    model_config = ConfigDict(extra="ignore")

    at: float
    param: str
    old: Any
    new: Any
    trial: int
    rule: str


class TuningState(BaseModel):
    """What the tuner must remember across daemon restarts: a pause, tabu values, the restart budget
    spent, the changes kept (for `revert` and the flip-flop check), the baseline, losing rules."""

    model_config = ConfigDict(extra="ignore")

    paused: bool = False
    next_trial: int = 1
    tabu: list[TabuEntry] = Field(default_factory=list)
    restarts: list[float] = Field(default_factory=list)  # wall times of trial restarts (the budget)
    kept: list[KeptChange] = Field(default_factory=list)
    baseline: dict[str, float] = Field(default_factory=dict)
    baseline_at: float | None = None
    baseline_why: str | None = None
    losses: dict[str, int] = Field(default_factory=dict)
    muted: dict[str, tuple[float, str]] = Field(default_factory=dict)  # rule → (until, why)


class DaemonState(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # Marks every process tunerd starts (TUNERD_INSTANCE=<id> in its environment) so leftovers of this
    # daemon can be told apart from a vLLM someone else started on the same machine.
    instance_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:16])
    # The [engine.params] of the config the last-known-good set was derived from: when the operator
    # edits them, their edit wins over tuned values.
    base_params: dict[str, Any] | None = None
    last_known_good: dict[str, Any] | None = None
    # False after an upgrade (vLLM, driver, model) until a start with the last-known-good set succeeds.
    known_good_verified: bool = True
    engine: EngineRecord | None = None
    # Free memory before the first start (the memory-return gate's baseline); reset by resume/reload.
    baseline: dict[str, int | None] | None = None
    # vLLM version, driver/CUDA versions and model identity at the last successful start.
    identity: dict[str, Any] | None = None
    # What `<command> --help` showed, per command (checked once; vLLM imports take 10-20 s), and the flags
    # this command's vLLM turned out not to know (`dropped_flags`).
    capabilities: dict[str, Any] | None = None
    tuning: TuningState = Field(default_factory=TuningState)
    # The front door's in-flight cap set on the running daemon (a kept trial, `tunerd door`); None:
    # [door] max_in_flight of the config.
    door_max_in_flight: int | None = None
    # The operator pinned the cap (`tunerd door --max-in-flight`, None included: no cap) rather than leave
    # it to the door's controller; `tunerd door --steer` unpins. An older file's value counts as a pin.
    door_pinned: bool = False


class StateStore:
    """Loads and saves `DaemonState` at one path."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> tuple[DaemonState, str | None]:
        """The saved state, or a fresh one. Second item: a warning when the file was unreadable.

        An unreadable file is renamed to `<path>.corrupt` (kept for the operator), never silently lost.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return DaemonState(), None
        try:
            return DaemonState.model_validate(json.loads(raw)), None
        except (ValueError, ValidationError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            os.replace(self.path, aside)
            return DaemonState(), f"state file {self.path} unreadable ({exc}); moved to {aside}"

    def save(self, state: DaemonState) -> None:
        """Atomically replace the state file. Raises OSError."""
        atomic_write(self.path, state.model_dump_json(indent=2).encode() + b"\n")
