"""The engine's life, driven by the main loop: start through the preflight, watch, fail, back off, roll
back, give up (FATAL) — with the guards that run all the time (host memory, forward progress) and the
upgrade guard.

Owned by the supervisor's loop thread; no threads, no sleeps, no blocking I/O beyond the journal and
the state file. Decisions come from `policy/` (pure); process work from `engine/`; the start from
`starting`; the change in flight (a trial's, an exploration's) is the `change.ChangeSlot`'s, whose
outcomes are posted on the loop's queue (`post`); the front door's drain before a planned stop is
`drain.Drain`'s, over the door's side given at construction; what the state file remembers of the engine
is `engine_facts`'.

One desired start, reconciled each step: `pending` (a `PendingStart`: parameters, intent, not before)
is set by every reason to run vLLM — the daemon's start, an operator restart or a reload (`restart`,
`resume`), a change and its revert (the slot), the failure policy's recovery (backoff, correction,
rollback) — one replacing the other (journaled as aborted, "superseded by …"); `step` converges on it: a
start once no process runs and its time has come. What runs is stopped by the reason itself (a planned
stop, drained first; a failure's stop), not by the reconciliation: the order of a restart's journal
(intent, drain, stop, start) stays what it was.

Over 400 lines on purpose: this is the one state machine of the engine's life, and its transitions (a
failure → stop with the right grace → back off, correct, roll back or FATAL) read best in one place.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any

import structlog

from tunerd.config import Config
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.machine import MemoryReading
from tunerd.core.params import EngineParams
from tunerd.core.states import EngineState
from tunerd.engine.logfiles import LogCap
from tunerd.engine.logwatch import KvCacheSize
from tunerd.engine.oscalls import OsCalls
from tunerd.engine.process import Engine, EngineRun, Exited, TreeGone, failure_from_exit
from tunerd.observe.health import HealthResult
from tunerd.observe.identity import Capabilities, EngineIdentity
from tunerd.observe.poller import PollSample
from tunerd.policy.corrections import correction
from tunerd.policy.restart import Action, decide_after_failure
from tunerd.records.metrics import Metrics
from tunerd.records.recorder import Recorder
from tunerd.records.state import DaemonState, StateStore
from tunerd.supervise.capacity import CalibrationDone, Capacity, PlanOutcome
from tunerd.supervise.change import ChangeSlot, Owner
from tunerd.supervise.drain import DoorDrain, Drain
from tunerd.supervise.engine_facts import EngineFacts, identity_job
from tunerd.supervise.preflight import Submit, run_here
from tunerd.supervise.run_guards import RunGuards
from tunerd.supervise.starting import PendingStart, Refused, Starter, Waiting

log = structlog.get_logger("tunerd")

ACTIVE = (EngineState.STARTING, EngineState.RUNNING)
# Failures whose log says how vLLM sized (or could not size) its KV cache.
CALIBRATES = (FailureKind.KV_CACHE_TOO_SMALL, FailureKind.NO_KV_MEMORY, FailureKind.INSUFFICIENT_MEMORY)
# Failures after which the engine serves nobody: its stop has nothing to drain.
NOT_SERVING = (FailureKind.ENGINE_DEAD, FailureKind.ENGINE_INIT_FAILED, FailureKind.EXITED)


class Lifecycle:
    def __init__(
        self,
        config: Config,
        *,
        oscalls: OsCalls,
        recorder: Recorder,
        store: StateStore,
        dstate: DaemonState,
        metrics: Metrics,
        on_status_change: Callable[[], None],
        background: Callable[[Callable[[], Any]], None],
        post: Callable[[object], None],
        door: DoorDrain | None = None,
        submit: Submit = run_here,
        monotonic: Callable[[], float],
        wallclock: Callable[[], datetime],
    ) -> None:
        self._config = config
        self.capacity = Capacity(config, lambda: (self.dstate.identity or {}).get("vllm_version"))
        self.rec = recorder
        self.store = store
        self.dstate = dstate
        self.metrics = metrics
        self.on_status_change = on_status_change
        self.background = background
        self.monotonic = monotonic
        self.engine = Engine(
            oscalls=oscalls,
            marker=dstate.instance_id,
            log_dir=config.paths.engine_log_dir,
            logs_kept=config.paths.engine_logs_kept,
            log_cap=LogCap(config.paths.engine_log_max_bytes, config.paths.engine_log_backups),
            on_transition=self._on_transition,
        )
        self.params = config.engine.params
        self.known_good = (
            EngineParams(**dstate.last_known_good) if dstate.last_known_good is not None else None
        )
        self.failures = 0
        self.pending: PendingStart | None = None
        self.open_intent: int | None = None
        self.fatal_reason: str | None = None
        self.waiting_reason: str | None = None
        self.notes: dict[str, str] = {}  # things an operator should know (upgrade, page cache …)
        self.restarts: Counter[str] = Counter()
        self.guards = RunGuards(recorder)
        self.facts = EngineFacts(recorder, dstate, self.save_state, self.notes)
        self.shutting_down = False
        self.stop_drain = Drain(
            door,
            self.engine,
            stop_grace=self._stop_grace,
            timeout_s=lambda: self.config.door.drain_timeout_s,
        )
        self.slot = ChangeSlot(
            post=post,
            restart=self._planned_restart,
            revert_now=self._revert_now,
            promote=self.promote,
            monotonic=monotonic,
        )
        self.starter = Starter(
            config,
            oscalls=oscalls,
            engine=self.engine,
            recorder=recorder,
            dstate=dstate,
            save_state=self.save_state,
            capacity=self.capacity,
            gpu=lambda: self.guards.gpu,
            wallclock=wallclock,
            submit=submit,
        )

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        self._config = config
        self.capacity.config = config
        self.starter.config = config
        self.engine.logs_kept = config.paths.engine_logs_kept  # from the next start on
        self.engine.log_cap = LogCap(config.paths.engine_log_max_bytes, config.paths.engine_log_backups)

    # -- starting ----------------------------------------------------------------------------------

    def initial_params(self) -> tuple[EngineParams, str]:
        """Last-known-good when the operator has not edited [engine.params] since; else the config's."""
        configured = self.config.engine.params
        lkg = self.dstate.last_known_good
        if lkg is not None and self.dstate.base_params == configured.as_dict():
            return EngineParams(**lkg), "daemon start: last-known-good parameters"
        if lkg is not None:
            return configured, "daemon start: [engine.params] changed since last-known-good; using the config"
        return configured, "daemon start: parameters from the config"

    def schedule_start(
        self, params: EngineParams, action: str, reason: str, delay: float, **fields: Any
    ) -> bool:
        """Announce a start (an fsynced intent) and queue it. False, and nothing queued, when a change
        of parameters could not be made durable."""
        if params != self.params:
            fields["params_before"] = self.params
        intent = self.rec.intent(action, reason=reason, params=params, delay_s=delay, **fields)
        if intent is None and params != self.params:
            log.error("change.refused", reason="journal unwritable: no change without a durable intent")
            return False
        if self.pending is not None:
            self.rec.outcome(self.pending.intent, "aborted", reason=f"superseded by {action}")
        self.pending = PendingStart(params, intent, action, self.monotonic() + delay)
        return True

    def _try_start(self, now: float) -> None:
        pending = self.pending
        assert pending is not None
        step = self.starter.step(pending, now)
        if isinstance(step, Waiting):
            self._set_waiting(step.reason)
            return
        self.pending = None
        self._set_waiting(None)
        self.params = pending.params
        if isinstance(step, Refused):
            # No launch: the failure goes through the same policy as a crash.
            self.rec.outcome(pending.intent, "failed", failure=step.failure.as_dict())
            self._count_failure(step.failure)
            self._decide_after_failure(step.failure, ran_for_s=None, now=now)
            return
        self.open_intent = pending.intent
        self.slot.launched(pending.params, pending.preflight.plan if pending.preflight else None)
        self.guards.new_run()

    # -- the loop's step -----------------------------------------------------------------------

    def step(self, now: float) -> None:
        engine = self.engine
        self._take_engine_events(now)
        run = engine.run
        budget = self.config.timeouts.startup_s
        if engine.state is EngineState.STARTING and run is not None and now - run.started_mono > budget:
            self._on_failure(
                EngineFailure(FailureKind.STARTUP_TIMEOUT, f"no /health 200 in {budget:g} s"), now
            )
        if engine.state is EngineState.RUNNING and run is not None:
            self._maybe_mark_known_good(run, now)
        self.stop_drain.step(now)
        pending = self.pending
        if (
            pending is not None
            and engine.run is None
            and not self.shutting_down
            and now >= pending.not_before
        ):
            self._try_start(now)

    def _take_engine_events(self, now: float) -> None:
        """What the engine did since the last look: its new log lines, its exits, its stop's progress."""
        for event in self.engine.poll(now):
            if isinstance(event, EngineFailure):
                self._on_failure(event, now)
            elif isinstance(event, KvCacheSize):
                self.metrics.kv_cache_tokens.set(event.tokens)
                log.info("engine.kv_cache", tokens=event.tokens, max_concurrency=event.max_concurrency)
            elif isinstance(event, Exited):
                self._on_exit(event, now)
            elif isinstance(event, TreeGone):
                self._on_tree_gone(event, now)

    def _stop_grace(self, failure: EngineFailure | None = None) -> float:
        """How long a stop waits between SIGTERM and SIGKILL.

        A memory emergency: seconds (the host is about to stall). An engine that never served: a short
        grace — it has no requests to drain, and vLLM's API server ignored SIGTERM after its worker
        failed at start-up, costing the whole graceful timeout per failed start (measured on CPU: 30 s).
        A serving engine: the graceful timeout (with --shutdown-timeout, vLLM drains within it).
        """
        timeouts = self.config.timeouts
        if failure is not None and failure.kind is FailureKind.MEMORY_EMERGENCY:
            return self.config.guard.emergency_grace_s
        run = self.engine.run
        if run is None or run.ready_mono is None or (failure is not None and failure.kind in NOT_SERVING):
            return min(timeouts.unready_stop_s, timeouts.graceful_stop_s)
        return timeouts.graceful_stop_s

    @property
    def settled(self) -> bool:
        """No process exists (what shutdown waits for)."""
        return self.engine.run is None

    # -- watching ------------------------------------------------------------------------------

    def on_health(self, result: HealthResult, now: float) -> None:
        run = self.engine.run
        if run is None or result.run_id != run.run_id:
            return  # a late answer about an earlier run
        if self.engine.state is EngineState.STARTING and result.ok:
            # vLLM logs its KV cache size (and may log a fatal line) before /health answers, but the
            # answer can reach the loop before its next look at the log: look now, then decide.
            self._take_engine_events(now)
            if self.engine.state is not EngineState.STARTING or self.engine.run is not run:
                return
            self.engine.mark_ready(now)
            seconds = round(now - run.started_mono, 2)
            kv = run.kv_cache.tokens if run.kv_cache else None
            self.rec.record(
                "engine.ready",
                pid=run.pid,
                seconds=seconds,
                kv_cache_tokens=kv,
                predicted_kv_cache_tokens=run.predicted_kv_tokens,
                init_engine_s=run.init_seconds,
                params=run.params,
            )
            self._close_intent("ok", seconds=seconds, kv_cache_tokens=kv)
            self.background(lambda: identity_job(run))
            self._learn_from(run)
            self.slot.ready(run, now)
        elif self.engine.state is EngineState.RUNNING:
            run.health_failures = 0 if result.ok else run.health_failures + 1
            if run.health_failures >= self.config.timeouts.health_failures:
                # A server that died answers no /health either, and the probe's answer can reach the loop
                # before its next reap: look at the engine first, so that a death is called by its exit
                # (a SIGKILL: likely the OOM killer), not "health failed" (CI saw exactly that race).
                self._take_engine_events(now)
                if self.engine.state is not EngineState.RUNNING or self.engine.run is not run:
                    return
                detail = f"/health failed {run.health_failures} times in a row (last: {result.detail})"
                self._on_failure(EngineFailure(FailureKind.HEALTH_FAILED, detail), now)

    def on_memory(self, reading: MemoryReading, now: float) -> None:
        """The host-wedge guard: stop vLLM before the host stalls on memory (also while a graceful stop
        runs: an emergency shortens it, once)."""
        state, run = self.engine.state, self.engine.run
        if state is EngineState.STOPPING:
            emergency = self.config.guard.emergency_grace_s
            if run is None or run.stop is None or run.stop.grace_s <= emergency:
                return
        elif state not in ACTIVE:
            return
        failure = self.guards.check_memory(reading, self.config.guard, self.params)
        if failure is not None:
            self._on_failure(failure, now)

    def on_poll(self, sample: PollSample, now: float) -> None:
        """Remember the GPU facts for the next preflight; watch forward progress of the current run."""
        self.guards.remember_gpu(sample)
        run = self.engine.run
        if run is not None and sample.run_id == run.run_id and self.engine.state is EngineState.RUNNING:
            failure = self.guards.check_progress(sample, self.config.guard, run.pid, now)
            if failure is not None:
                self._on_failure(failure, now)

    def on_identity(self, identity: EngineIdentity) -> None:
        self.facts.on_identity(identity, self.engine.run, self.known_good)

    def on_capabilities(self, caps: Capabilities) -> None:
        self.facts.on_capabilities(caps)

    def needs_capabilities(self) -> bool:
        return self.facts.needs_capabilities(list(self.config.engine.command))

    def _learn_from(self, run: EngineRun) -> None:
        """Calibrate the planner from what vLLM reported at this start (in a worker job)."""
        capacity, report, machine = self.capacity, run.report.report(), run.machine
        run_id, params = run.run_id, run.params
        self.background(lambda: capacity.calibrate(run_id, report, params, machine))

    def on_calibration(self, done: CalibrationDone) -> None:
        self.rec.record("planner.calibrated", run=done.run_id, **done.figures)

    # -- failures --------------------------------------------------------------------------------

    def fail(self, failure: EngineFailure, now: float) -> None:
        """A failure seen outside the engine's own signs (the probe's wedge): handled like any other."""
        if self.engine.run is not None:
            self._on_failure(failure, now)

    def _on_failure(self, failure: EngineFailure, now: float) -> None:
        """A failure while STARTING/RUNNING: journal it at once and stop the whole tree."""
        engine = self.engine
        run = engine.run
        assert run is not None
        if engine.state not in ACTIVE:
            if engine.state is EngineState.STOPPING and run.failure is not None:
                engine.note_failure(failure)  # a more specific cause printed while stopping
            if engine.state is EngineState.STOPPING and failure.kind is FailureKind.MEMORY_EMERGENCY:
                engine.begin_stop(now, str(failure.kind), self._stop_grace(failure))  # shortens the grace
            return
        standing = engine.note_failure(failure)
        phase = engine.state.name.lower()
        self.rec.record(
            "engine.failed",
            phase=phase,
            pid=run.pid,
            seconds=round(now - run.started_mono, 2),
            failure=standing.as_dict(),
            params=run.params,
            log=str(run.log_path),
        )
        log.error("engine.failed", phase=phase, kind=str(standing.kind), detail=standing.detail)
        engine.begin_stop(now, str(standing.kind), self._stop_grace(standing))

    def _on_exit(self, event: Exited, now: float) -> None:
        run = self.engine.run
        assert run is not None
        how = event.status.describe(killed_by_us=run.kill_sent)
        self.rec.record("engine.exited", pid=run.pid, exit=event.status.as_dict(), how=how)
        if self.engine.state in ACTIVE:
            self._on_failure(failure_from_exit(event.status, phase=self.engine.state), now)

    def _on_tree_gone(self, event: TreeGone, now: float) -> None:
        engine = self.engine
        run = engine.run
        assert run is not None
        self.rec.record(
            "engine.stopped",
            pid=run.pid,
            reason=run.stop_reason,
            seconds=round(event.seconds, 2),
            grace_s=run.stop.grace_s if run.stop is not None else None,
            sigkill=event.killed,
            survivors=list(event.survivors),
        )
        if event.survivors:
            log.error("engine.survivors", pids=list(event.survivors))
        failure = run.failure
        ran_for = run.uptime(now) if run.ready_mono is not None else None
        engine.settle(EngineState.STOPPED if failure is None else EngineState.BACKOFF)
        self.dstate.engine = None
        self.save_state()
        if failure is None:
            self._close_intent("aborted", reason=run.stop_reason)
            return
        self._count_failure(failure)
        self._close_intent("failed", failure=failure.as_dict(), tail=run.tail[-10:])
        if failure.kind in CALIBRATES:
            self._learn_from(run)  # vLLM's refusal says how much memory it found: calibrate from it too
        if not self.shutting_down:
            self._decide_after_failure(failure, ran_for_s=ran_for, now=now, run=run)

    def _count_failure(self, failure: EngineFailure) -> None:
        self.restarts[str(failure.kind)] += 1
        self.metrics.restarts.labels(reason=str(failure.kind)).inc()

    def _decide_after_failure(
        self, failure: EngineFailure, ran_for_s: float | None, now: float, run: EngineRun | None = None
    ) -> None:
        if self.slot.failed(failure):
            return
        report = run.report.report() if run is not None else None
        backend = run.machine.backend if run is not None and run.machine is not None else "cuda"
        decision = decide_after_failure(
            self.config.backoff,
            failures_before=self.failures,
            ran_for_s=ran_for_s,
            failure=failure,
            params=self.params,
            known_good=self.known_good,
            correction=correction(failure, self.params, report, backend),
        )
        self.failures = decision.failures
        if decision.action is Action.FATAL or decision.params is None:
            why = (
                decision.reason
                if decision.reason.startswith(str(failure.kind))
                else (f"{failure.kind}: {decision.reason}")
            )
            self._enter_fatal(f"{why}; last error: {failure.detail}")
            return
        if decision.drop_flags:
            self.facts.drop_flags(list(self.config.engine.command), decision.drop_flags)
        if self.engine.state is not EngineState.BACKOFF:
            self.engine.enter(EngineState.BACKOFF)
        self.rec.record(
            "engine.backoff",
            action=str(decision.action),
            delay_s=decision.delay_s,
            failures=decision.failures,
            reason=decision.reason,
        )
        if not self.schedule_start(
            decision.params, str(decision.action), decision.reason, decision.delay_s, after=str(failure.kind)
        ):
            # The change could not be made durable (journal unwritable): no change without an intent,
            # but the engine is not left down either — the parameters in force are tried again.
            delay = max(decision.delay_s, self.config.backoff.initial_s)
            self.schedule_start(
                self.params, "retry", "the change could not be journaled: retrying unchanged", delay
            )

    def _enter_fatal(self, reason: str) -> None:
        self.fatal_reason = reason
        self.pending = None
        self.engine.enter(EngineState.FATAL)
        self.rec.record("engine.fatal", reason=reason, params=self.params)
        log.error(
            "engine.fatal", reason=reason, hint="fix the cause, then `tunerd resume` or reload the config"
        )

    def _maybe_mark_known_good(self, run: EngineRun, now: float) -> None:
        """Parameters that have served for `known_good_after_s` become last-known-good — never while a
        change is in flight or its owner holds the slot: only the owner's decision promotes (`end`)."""
        if self.slot.in_flight or run.uptime(now) < self.config.backoff.known_good_after_s:
            return
        if self.known_good == run.params and self.failures == 0:
            return
        self.failures = 0
        if self.known_good == run.params:
            return
        self.promote(run.params, f"served {self.config.backoff.known_good_after_s:g} s")

    def promote(self, params: EngineParams, why: str) -> None:
        """`params` become last-known-good (a trial's or an exploration's decision; serving time)."""
        self.known_good = params
        self.dstate.last_known_good = params.as_dict()
        self.dstate.base_params = self.config.engine.params.as_dict()
        self.dstate.known_good_verified = True
        self.save_state()
        self.rec.record("known_good.updated", params=params, why=why)

    # -- changes (supervise/change.py) -------------------------------------------------------------

    def request(
        self,
        params: EngineParams,
        reason: str,
        owner: Owner,
        ref: int,
        plan: PlanOutcome | None = None,
        revert_to: EngineParams | None = None,
    ) -> int | None:
        """Restart a serving engine with `params` as a change of `owner` (journaled as trial `ref`),
        through the normal start path. Its id, whose outcome comes back as `ChangeEvent`s on the loop's
        queue; None (nothing done) unless the engine serves and no change is in flight, or when the
        intent could not be made durable.

        `plan`: the capacity planner's outcome for exactly `params`, asked by the owner before the
        request (a refusal costs no restart): the start's preflight uses it instead of asking again.
        `revert_to`: what a revert restarts with (default: the parameters in force; a trial's later
        starts name the configuration before the change, whichever side serves now)."""
        if self.engine.state is not EngineState.RUNNING or self.shutting_down:
            return None
        change_id = self.slot.open(params, revert_to or self.params, reason, owner, ref)
        pending = self.pending
        if change_id is not None and pending is not None and pending.params == params:
            pending.plan = plan
        return change_id

    def _revert_now(self, params: EngineParams, reason: str, **fields: Any) -> bool:
        """A change's start or run failed: back to `params` at once, no retries, no backoff."""
        self.failures = 0
        return self.schedule_start(params, "revert", reason, 0.0, **fields)

    # -- operator actions --------------------------------------------------------------------------

    def restart(self, params: EngineParams, reason: str, action: str = "restart") -> bool:
        """A planned restart (operator, reload): intent first, then stop, then start with `params`.
        A change in flight is superseded: it ends (event `aborted`, with the reason)."""
        self.slot.abort(f"superseded by {action}: {reason}")
        return self._planned_restart(params, action, reason)

    def _planned_restart(self, params: EngineParams, action: str, reason: str, **fields: Any) -> bool:
        self.failures = 0
        if not self.schedule_start(params, action, reason, delay=0.0, **fields):
            return False
        if self.engine.run is not None:
            self.stop_drain.planned_stop(self.monotonic(), action, reason)
        elif self.engine.state in (EngineState.BACKOFF, EngineState.FATAL):
            self.fatal_reason = None
            self.engine.enter(EngineState.STOPPED)
        return True

    def resume(self, reason: str, params: EngineParams | None = None) -> bool:
        """Leave FATAL (operator action): forget the failure count and the memory baseline."""
        if self.engine.state is not EngineState.FATAL:
            return False
        self.slot.abort(f"superseded: {reason}")
        self.fatal_reason = None
        self.failures = 0
        self.dstate.baseline = None  # the operator acted: measure free memory afresh
        self.engine.enter(EngineState.STOPPED)
        return self.schedule_start(params or self.params, "start", reason, delay=0.0)

    def shutdown(self) -> None:
        self.shutting_down = True
        if self.pending is not None:
            self.rec.outcome(self.pending.intent, "aborted", reason="daemon shutdown")
            self.pending = None
        if self.engine.run is not None and self.engine.state is not EngineState.STOPPING:
            # drained first, with the door
            self.stop_drain.planned_stop(self.monotonic(), "daemon shutdown", "daemon shutdown")

    def stop_now(self, monotonic: Callable[[], float], sleep: Callable[[float], None]) -> None:
        """Stop the engine outside the loop (the loop failed): SIGTERM, the grace, SIGKILL, reap.

        Bounded by the stop's grace plus the kill wait (`engine.stopper`); journals the stop.
        """
        engine = self.engine
        self.shutting_down = True
        self.pending = None
        if engine.run is not None and engine.state is not EngineState.STOPPING:
            engine.begin_stop(monotonic(), "daemon crashed", self._stop_grace())
        while engine.run is not None:
            for event in engine.poll(monotonic()):
                if isinstance(event, TreeGone):
                    self._on_tree_gone(event, monotonic())
                    return
            sleep(Engine.TICK_S)

    def kill_now(self) -> None:
        """SIGKILL the engine's tree at once (when even `stop_now` failed)."""
        run = self.engine.run
        if run is not None:
            self.engine.kill_tree()
            self.rec.record("engine.killed", pid=run.pid, reason="the stop after a daemon crash failed")

    # -- helpers ---------------------------------------------------------------------------------

    def _close_intent(self, result: str, **fields: Any) -> None:
        if self.open_intent is not None:
            self.rec.outcome(self.open_intent, result, **fields)
            self.open_intent = None

    def save_state(self) -> None:
        try:
            self.store.save(self.dstate)
        except OSError as exc:
            log.error("state.write_failed", error=str(exc))

    def _set_waiting(self, reason: str | None) -> None:
        if reason != self.waiting_reason:
            self.waiting_reason = reason
            if reason:
                log.info("engine.start_delayed", reason=reason)
            self.on_status_change()

    def _on_transition(self, old: EngineState, new: EngineState, run: EngineRun | None) -> None:
        log.info("engine.state", old=old.name, new=new.name, pid=run.pid if run else None)
        self.metrics.set_engine(new)
        if run is not None:
            self.metrics.set_params(run.params.as_dict())
        self.on_status_change()

    def status_line(self) -> str:
        state = self.engine.state
        run = self.engine.run
        if state is EngineState.FATAL:
            return f"engine FATAL: {self.fatal_reason}"
        if self.waiting_reason:
            return f"engine {state.name}: start delayed: {self.waiting_reason}"
        alive = run is not None and state in (*ACTIVE, EngineState.STOPPING)
        return f"engine {state.name}" + (f" (pid {run.pid})" if alive and run else "")
