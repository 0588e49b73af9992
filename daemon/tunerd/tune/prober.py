"""When the benchmark probe runs, and what its result does: a health check, a baseline, an objective.

The probe itself is a sensor (observe/probe.py, a worker job). This machine decides, on the loop's
thread, whether a probe may run now — never while vLLM restarts for a trial, never twice at once, and a
periodic one not while live traffic is busier than `probe.skip_when_running_above` (journaled as
skipped, with why) — and hands the result on: `probe.*` signals for the rules, a journal record, the
callbacks of whoever asked for it (the tuner's baseline, an exploration point), and a wedge to the
forward-progress guard when no token came back from a vLLM whose `/health` answers 200.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from tunerd.config import Config
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.observe.probe import ProbeResult, run_probe
from tunerd.records.recorder import Recorder
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.recall import Recall

DEFAULT_VOCAB = (
    1000  # token ids below it exist in every tokenizer tunerd meets; used when the config is unread
)
Callback = Callable[[ProbeResult | None, str | None], None]  # (result, or None and why it did not run)


@dataclass
class _Running:
    run_id: int
    reason: str
    future: Future[ProbeResult]
    params: EngineParams
    callbacks: list[Callback] = field(default_factory=list)
    triggers: list[str] = field(default_factory=list)  # who asked, in order (one probe serves them all)
    remember: bool = True  # into the tuning memory as a probe (an exploration records its own points)


class Prober:
    def __init__(
        self,
        config: Config,
        lifecycle: Lifecycle,
        *,
        recorder: Recorder,
        submit: Callable[[Callable[[], ProbeResult]], Future[ProbeResult]],
        vocab: Callable[[], int | None],
        monotonic: Callable[[], float],
        recall: Recall | None = None,
        run: Callable[..., ProbeResult] = run_probe,
    ) -> None:
        self.config = config
        self.life = lifecycle
        self.rec = recorder
        self.submit = submit
        self.vocab = vocab
        self.monotonic = monotonic
        self.recall = recall
        self.run = run  # observe.probe.run_probe; a stand-in in the in-process tests
        self.running: _Running | None = None
        self.last: ProbeResult | None = None
        self.last_at: float | None = None
        self.ended_at: float | None = None  # when the last probe ended, whatever its outcome
        self._seeds = int.from_bytes(os.urandom(4), "big")  # a new seed every probe: cache-cold

    def due(self, reason: str, *, busy: float | None) -> None:
        """A periodic probe is due. `busy`: requests running now. It does not run during a trial or an
        exploration (their evidence must be theirs alone), nor while live traffic is busier than the
        threshold. Skipped probes are journaled with why."""
        why = self._why_not()
        if self.life.slot.in_flight:
            why = "a trial or an exploration is running"
        threshold = self.config.probe.skip_when_running_above
        if why is None and busy is not None and busy > threshold:
            why = (
                f"{busy:g} requests running (probe.skip_when_running_above {threshold:g}): live traffic first"
            )
        if why is not None:
            self.rec.record("probe.skipped", reason=why, trigger=reason)
            return
        self._start(reason, [], remember=True)

    def request(self, reason: str, callback: Callback, *, remember: bool = True) -> None:
        """Run one probe as soon as possible for `callback` (live traffic does not skip it); a probe
        already running serves it too. When none can run, the callback hears why at once. `remember`:
        its result goes into the tuning memory as a probe."""
        if self.running is not None:
            self.running.callbacks.append(callback)
            self.running.triggers.append(reason)
            self.running.remember &= remember
            return
        why = self._why_not()
        if why is not None:
            callback(None, why)
            return
        self._start(reason, [callback], remember=remember)

    def _why_not(self) -> str | None:
        if not self.config.probe.enabled:
            return "probe.enabled is false"
        if self.running is not None:
            return "a probe is running"
        if self.life.engine.state is not EngineState.RUNNING or self.life.engine.run is None:
            return f"vLLM is {self.life.engine.state.name}"
        return None

    def _start(self, reason: str, callbacks: list[Callback], *, remember: bool) -> None:
        run = self.life.engine.run
        assert run is not None
        self._seeds += 1
        seed, cfg, model = self._seeds, self.config.probe, self.config.engine.model
        vocab_of, run_id, base_url, measure = self.vocab, run.run_id, run.base_url, self.run
        targets = self.config.objective.targets  # each probe request judged against them: probe.attainment

        def probe() -> ProbeResult:  # in a worker: the vocabulary comes from reading the model's config
            vocab = vocab_of() or DEFAULT_VOCAB
            return measure(run_id, base_url, model, cfg, seed=seed, vocab=vocab, targets=targets)

        future = self.submit(probe)
        self.running = _Running(run_id, reason, future, run.params, callbacks, [reason], remember)

    def step(self, now: float) -> None:
        """Hand a finished probe's result on (every loop tick)."""
        running = self.running
        if running is None or not running.future.done():
            return
        self.running, self.ended_at = None, now
        try:
            result = running.future.result()
        except Exception as exc:  # the sensor never raises; a bug in it must not take the loop down
            for callback in running.callbacks:
                callback(None, f"the probe failed: {type(exc).__name__}: {exc}")
            return
        self.last, self.last_at = result, now
        self.rec.record("probe.result", trigger=running.reason, triggers=running.triggers, **result.as_dict())
        if self.recall is not None and running.remember:
            self.recall.probe(result, running.params)
        self._check_wedge(result, now)
        for callback in running.callbacks:
            callback(result, None)

    def _check_wedge(self, result: ProbeResult, now: float) -> None:
        """No token from a vLLM that still serves /health 200 (vLLM #39863): a wedge, restarted like one."""
        run = self.life.engine.run
        if not result.no_tokens or run is None or run.run_id != result.run_id:
            return
        if self.life.engine.state is not EngineState.RUNNING or run.health_failures:
            return  # not serving, or /health already failing: the health check handles it
        detail = (
            f"the probe got no token from {result.requests} requests in {result.seconds:.0f} s while "
            "/health answered 200"
        )
        self.rec.record("guard.wedged", reason=detail, pid=run.pid, probe=result.as_dict())
        self.life.fail(EngineFailure(FailureKind.WEDGED, detail), now)

    def quiet_for(self, now: float) -> float | None:
        """Seconds since the last probe ended: 0 while one runs, None before the first. A trial's
        before window must not reach back into a probe: its requests are not the live load (a
        first-start probe inside one made a real trial inconclusive, its prompt sizes 2x the load's)."""
        if self.running is not None:
            return 0.0
        return None if self.ended_at is None else now - self.ended_at

    def signals(self, now: float) -> dict[str, float | None]:
        """The `probe.*` signals: the last probe's figures (None before the first), and its age."""
        if self.last is None or self.last_at is None:
            return {}
        return {**self.last.signals(), "probe.age_s": now - self.last_at}
