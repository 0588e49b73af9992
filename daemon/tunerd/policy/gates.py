"""What may stop a fired rule from acting (pure): the mode, a pause, the restart budget, the serving time
since the last restart, maintenance windows, tabu values and flip-flops.

The restart budget counts trial restarts only (a trial's start and its revert); crash recovery is never
counted and never blocked. Together with the per-rule cooldown and mute, tabu and the flip-flop check
make an oscillating signal provably stop causing restarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from tunerd.config import MaintenanceWindow, TuningConfig

HOUR_S, DAY_S = 3600.0, 86400.0


@dataclass(frozen=True, slots=True)
class Budget:
    """Trial restarts left now (None: unlimited)."""

    hour_left: int
    day_left: int

    @property
    def left(self) -> int:
        return min(self.hour_left, self.day_left)


def budget(restart_times: Iterable[float], now_wall: float, tuning: TuningConfig) -> Budget:
    """What is left of the per-hour and per-day budget, from the wall times of past trial restarts."""
    times = list(restart_times)
    hour = sum(1 for t in times if now_wall - t < HOUR_S)
    day = sum(1 for t in times if now_wall - t < DAY_S)
    return Budget(max(0, tuning.restarts_per_hour - hour), max(0, tuning.restarts_per_day - day))


def window_opened_at(windows: Sequence[MaintenanceWindow], now: datetime) -> float | None:
    """When the maintenance window that `now` (an aware datetime) lies in opened (epoch seconds), or None
    outside all of them."""
    for window in windows:
        opened = window.opened_at(now)
        if opened is not None:
            return opened.timestamp()
    return None


def window_open(windows: Sequence[MaintenanceWindow], now: datetime) -> bool:
    """Whether `now` (an aware datetime) lies in a maintenance window; no windows: always open."""
    return not windows or window_opened_at(windows, now) is not None


def why_not_act(
    *,
    tuning: TuningConfig,
    paused: bool,
    trial_running: bool,
    budget_left: Budget,
    served_s: float | None,
    now: datetime,
) -> str | None:
    """Why a fired rule must not act now (it is journaled as deferred), or None when it may. `now` (an
    aware datetime) only answers whether a maintenance window is open (`why_not_act_at` takes that answer)."""
    return why_not_act_at(
        tuning=tuning,
        paused=paused,
        trial_running=trial_running,
        budget_left=budget_left,
        served_s=served_s,
        window_open=window_open(tuning.maintenance, now),
    )


def why_not_act_at(
    *,
    tuning: TuningConfig,
    paused: bool,
    trial_running: bool,
    budget_left: Budget,
    served_s: float | None,
    window_open: bool,
) -> str | None:
    """`why_not_act` with the maintenance windows' answer computed by the caller (`window_open`: no
    windows, or `now` lies in one), so that the decision is a function of data alone."""
    if tuning.mode == "off":
        return "tuning.mode is off"
    if paused:
        return "tuning is paused (tunerd resume)"
    if trial_running:
        return "a trial is running"
    if served_s is None or served_s < tuning.min_serving_s:
        served = f"{served_s or 0:.0f} s"
        return (
            f"vLLM has served {served} since its last start (tuning.min_serving_s {tuning.min_serving_s:g})"
        )
    if budget_left.left <= 0:
        per = f"{tuning.restarts_per_hour}/h, {tuning.restarts_per_day}/day"
        return f"restart budget spent ({per} of trial restarts)"
    if not window_open:
        return "outside the maintenance windows"
    return None


def flip_flop(
    param: str, new: object, kept: Sequence[tuple[float, str, object, object]], now_wall: float, tabu_s: float
) -> str | None:
    """Whether setting `param` to `new` undoes a change kept within `tabu_s` (`kept`: (wall time, param,
    old, new) of kept trials): two rules pulling one parameter back and forth would restart forever."""
    for when, name, old, kept_new in reversed(kept):
        if name == param and old == new and kept_new != new and now_wall - when < tabu_s:
            return f"would undo the change {param} {old} → {kept_new} kept {now_wall - when:.0f} s ago"
    return None
