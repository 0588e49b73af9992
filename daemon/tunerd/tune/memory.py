"""The tuner's memory in the state file (`records.state.TuningState`): tabu values, muted rules, the
restart budget spent, the changes kept, the baseline. It survives a daemon restart, so an oscillation
cannot restart afresh with the daemon, and a known-bad value stays known-bad.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import structlog

from tunerd.config import TuningConfig
from tunerd.policy.gates import DAY_S, Budget, budget
from tunerd.records.recorder import Recorder
from tunerd.records.state import KeptChange, TabuEntry, TuningState

log = structlog.get_logger("tunerd")

# The figures a baseline keeps (what `factor * baseline` terms may compare with).
BASELINE_SIGNALS = (
    "throughput.generation",
    "throughput.prompt",
    "requests.completed_rate",
    "requests.running_avg",
    "kv_cache.usage_avg",
    "preemptions.rate",
    "ttft.p95",
    "itl.p95",
    "e2e.p95",
    "probe.throughput",
    "probe.ttft_p95",
    "probe.itl_p95",
)


class TuningMemory:
    """Reads and writes the `TuningState` of the state file (saved at every change), wall times."""

    def __init__(
        self,
        state: TuningState,
        tuning: Callable[[], TuningConfig],
        *,
        recorder: Recorder,
        save_state: Callable[[], None],
        wallclock: Callable[[], datetime],
    ) -> None:
        self.state = state
        self.tuning = tuning
        self.rec = recorder
        self.save = save_state
        self.wallclock = wallclock

    def wall(self) -> float:
        return self.wallclock().timestamp()

    # -- tabu and mutes ----------------------------------------------------------------------------

    def tabu(self) -> dict[tuple[str, Any], str]:
        """(param, value) → why, for the values no trial may propose now."""
        wall = self.wall()
        self.state.tabu = [entry for entry in self.state.tabu if entry.until > wall]
        return {(entry.param, entry.value): entry.why for entry in self.state.tabu}

    def add_tabu(self, param: str, value: Any, why: str) -> None:
        until = self.wall() + self.tuning().tabu_s
        self.state.tabu = [e for e in self.state.tabu if (e.param, e.value) != (param, value)]
        self.state.tabu.append(TabuEntry(param=param, value=value, until=until, why=why))
        self.save()

    def mute(self, rule: str, why: str) -> None:
        seconds = self.tuning().mute_s
        self.state.muted[rule] = (self.wall() + seconds, why)
        self.save()
        self.rec.record("rule.muted", rule=rule, reason=why, for_s=seconds)
        log.warning("rule.muted", rule=rule, reason=why)

    def muted(self, rule: str) -> tuple[float, str] | None:
        """(seconds left, why) while `rule` is muted, else None."""
        mute = self.state.muted.get(rule)
        wall = self.wall()
        return (mute[0] - wall, mute[1]) if mute is not None and mute[0] > wall else None

    def lost(self, rule: str) -> int:
        """One more trial of `rule` lost; returns how many in a row."""
        losses = self.state.losses.get(rule, 0) + 1
        self.state.losses[rule] = losses
        self.save()
        return losses

    # -- budget and kept changes -------------------------------------------------------------------

    def count_restart(self) -> None:
        wall = self.wall()
        self.state.restarts = [t for t in self.state.restarts if wall - t < DAY_S] + [wall]
        self.save()

    def budget(self) -> Budget:
        return budget(self.state.restarts, self.wall(), self.tuning())

    def kept(self, trial: int, rule: str, param: str, old: Any, new: Any) -> None:
        self.state.kept.append(
            KeptChange(at=self.wall(), param=param, old=old, new=new, trial=trial, rule=rule)
        )
        del self.state.kept[:-20]
        self.state.losses[rule] = 0
        self.save()

    def kept_changes(self) -> list[tuple[float, str, Any, Any]]:
        return [(k.at, k.param, k.old, k.new) for k in self.state.kept]

    # -- baseline ----------------------------------------------------------------------------------

    @property
    def baseline(self) -> dict[str, float]:
        return self.state.baseline

    def set_baseline(self, values: Mapping[str, float | None], why: str, *, merge: bool = False) -> None:
        """The baseline from `values` (those of BASELINE_SIGNALS); `merge` adds to the one recorded (the
        probe's figures arrive after the window's)."""
        figures = {k: float(v) for k in BASELINE_SIGNALS if (v := values.get(k)) is not None}
        self.state.baseline = {**self.state.baseline, **figures} if merge else figures
        self.state.baseline_at = self.wall()
        self.state.baseline_why = why if not merge else f"{self.state.baseline_why}; {why}"
        self.save()
        self.rec.record("baseline.recorded", why=why, signals=figures if merge else self.state.baseline)

    # -- pause ---------------------------------------------------------------------------------------

    def set_paused(self, paused: bool) -> bool:
        """Persisted across a daemon restart; False when it already was so."""
        if self.state.paused == paused:
            return False
        self.state.paused = paused
        self.save()
        self.rec.record("tuning.paused" if paused else "tuning.resumed")
        return True

    def next_trial(self) -> int:
        number = self.state.next_trial
        self.state.next_trial += 1
        self.save()
        return number
