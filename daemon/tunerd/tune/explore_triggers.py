"""When an exploration (tune/explorer.py) starts: on demand (`tunerd explore`), once per maintenance
window (`tuning.explore_in_windows`), or from the tuning memory — a daemon start, a new deployment —
which first puts the values it knows to be bad on the tabu list and then tries the best configuration
it knows against the one in force (a recall).

The tuner owns the gates (`why_not`: mode, pause, a trial in progress, the warm-up) and calls in here;
this module only decides which exploration, when.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from tunerd.config import Config
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.policy.gates import why_not_act, window_opened_at
from tunerd.records.recorder import Recorder
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.explorer import Explorer
from tunerd.tune.memory import TuningMemory
from tunerd.tune.recall import Recall


class ExploreTriggers:
    def __init__(
        self,
        explorer: Explorer,
        lifecycle: Lifecycle,
        memory: TuningMemory,
        recall: Recall | None,
        config: Callable[[], Config],
        *,
        recorder: Recorder,
        wallclock: Callable[[], datetime],
        why_not: Callable[[], str | None],
    ) -> None:
        self.explorer = explorer
        self.life = lifecycle
        self.memory = memory
        self.recall = recall
        self.config = config
        self.rec = recorder
        self.wallclock = wallclock
        self.why_not = why_not  # the tuner's gates: mode, pause, a trial in progress
        self._explored_window: float | None = None  # the maintenance window last explored in
        self._consulted = False  # the tuning memory, once per daemon run, when vLLM's identity is known
        self._recalled: EngineParams | None = None  # its best configuration, waiting to be tried

    def explore(self, params: list[str], reason: str) -> str | None:
        """Start an exploration of `params` (`tunerd explore`); None when it started, else why not."""
        return self.why_not() or self.explorer.begin(params, reason)

    def step(self, now: float, settled: bool) -> None:
        """Every tick: a recall waiting for the engine to settle, a maintenance window that opened."""
        if self.explorer.current is not None or self.why_not() is not None:
            return
        self._maybe_recall(now, settled)
        self._maybe_in_window()

    # -- the tuning memory -------------------------------------------------------------------------

    def on_identity(self) -> None:
        """vLLM's identity is known (after the lifecycle took it in). The first time in this daemon run:
        known-bad values join the tabu list, and the best known configuration waits to be tried."""
        if self.recall is None:
            return
        self.recall.on_identity()
        if self._consulted:
            return
        self._consulted = True
        tabu = self.memory.tabu()
        bad = [(p, v, why) for p, v, why in self.recall.bad_values() if (p, v) not in tabu]
        for param, value, why in bad:
            self.memory.add_tabu(param, value, f"tuning memory: {why}")
        best = self.recall.best_known(self.life.params)
        if best is not None and any(
            (k, getattr(best[0], k)) in self.memory.tabu() for k in self._changed(best[0])
        ):
            best = None  # tried here and lost within the tabu time: not again
        self._recalled = best[0] if best is not None else None
        self.rec.record(
            "memory.consulted",
            path=str(self.recall.experience.path),
            tabu=[{"param": p, "value": v, "why": why} for p, v, why in bad],
            best_known=self._changed(best[0]) if best is not None else None,
            best_objective=best[1] if best is not None else None,
        )

    def _changed(self, params: EngineParams) -> dict[str, Any]:
        return {k: v for k, v in params.as_dict().items() if getattr(self.life.params, k) != v}

    def _maybe_recall(self, now: float, settled: bool) -> None:
        """Try the tuning memory's best configuration once the engine serves settled, under the gates
        of any trial (budget, maintenance windows)."""
        recalled, run = self._recalled, self.life.engine.run
        if recalled is None or not settled or run is None or run.ready_mono is None:
            return
        if self.life.engine.state is not EngineState.RUNNING:
            return
        blocked = why_not_act(
            tuning=self.config().tuning,
            paused=False,
            trial_running=False,
            budget_left=self.memory.budget(),
            served_s=now - run.ready_mono,
            now=self.wallclock().astimezone(),
        )
        if blocked is not None:
            return  # it waits (a window, the budget): looked at again at the next tick
        self._recalled = None
        changed = self._changed(recalled)
        if not changed:
            return
        reason = "the tuning memory's best configuration for this model and box"
        why = self.explorer.begin(list(changed), reason, recall=recalled)
        if why is not None:
            self.rec.record("explore.deferred", params=list(changed), reason=why)

    # -- maintenance windows -------------------------------------------------------------------------

    def _maybe_in_window(self) -> None:
        """`tuning.explore_in_windows`: one exploration each time a maintenance window opens."""
        tuning = self.config().tuning
        if not tuning.explore_in_windows:
            return
        opened = window_opened_at(tuning.maintenance, self.wallclock().astimezone())
        if opened is None or opened == self._explored_window:
            return
        run = self.life.engine.run
        if run is None or run.ready_mono is None:
            return
        self._explored_window = opened
        why = self.explore(list(tuning.explore_in_windows), "a maintenance window opened")
        if why is not None:
            self.rec.record("explore.deferred", params=list(tuning.explore_in_windows), reason=why)
