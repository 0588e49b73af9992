"""When the tuning memory's baseline is taken (tune/memory.py keeps it; rules that compare with it, such
as the 30 % throughput rule, read it): the probe's at the first start, once live traffic is no busier
than the periodic probe allows, and again after every kept change (live load before and after a change
is not comparable, the probe's is); the live window's once this run serves requests (an idle engine has
no live figures worth comparing with).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tunerd.config import Config
from tunerd.observe.probe import ProbeResult
from tunerd.records.recorder import Recorder
from tunerd.tune.memory import TuningMemory
from tunerd.tune.prober import Prober


class Baselines:
    """Takes the baseline into `memory`: `step` at every rules' evaluation of a settled run, `probe`
    after a kept change. Asks `prober` (None, or `[probe] enabled = false`: the live window's only)."""

    def __init__(
        self,
        memory: TuningMemory,
        prober: Prober | None,
        config: Callable[[], Config],
        *,
        recorder: Recorder,
    ) -> None:
        self.memory, self.prober, self.config, self.rec = memory, prober, config, recorder
        self._probed = False  # the first probe baseline was asked for in this daemon run
        self._waits = False  # ... and journaled as waiting for live traffic to ease

    def probe(self, why: str) -> None:
        """The probe's figures join the baseline, when it answers without errors."""
        if self.prober is None or not self.config().probe.enabled:
            return

        def done(result: ProbeResult | None, _why: str | None) -> None:
            if result is not None and not result.errors:
                self.memory.set_baseline(result.signals(), f"probe: {why}", merge=True)

        self.prober.request(f"baseline: {why}", done)

    def step(
        self, live: Mapping[str, float | None], window: Callable[[], Mapping[str, float | None]]
    ) -> None:
        """The first baseline: the probe's at once (it needs no live load), the live `window`'s once the
        `live` signals show requests served."""
        baseline = self.memory.baseline
        if "probe.throughput" not in baseline and not self._probed:
            self._first_probe(live)
        if "throughput.generation" in baseline:
            return
        if not live.get("requests.completed_rate"):  # settled: the live window is this run's
            return
        self.memory.set_baseline(window(), "first window of serving", merge=True)

    def _first_probe(self, live: Mapping[str, float | None]) -> None:
        """The first start's probe, when live traffic is no busier than the periodic probe allows
        (`probe.skip_when_running_above`): a probe competing with a heavy load measures its share of the
        engine, not the engine (journaled once; asked again at the next evaluation)."""
        if self.prober is None or not self.config().probe.enabled:
            return
        busy = live.get("requests.running")
        threshold = self.config().probe.skip_when_running_above
        if busy is not None and busy > threshold:
            if not self._waits:
                self._waits = True
                self.rec.record(
                    "probe.skipped",
                    trigger="baseline: the first start",
                    reason=f"{busy:g} requests running (probe.skip_when_running_above {threshold:g}): "
                    "the baseline probe waits for live traffic to ease",
                )
            return
        self._probed = True
        self.probe("the first start")
