"""The main loop: the single owner of state. Events in, one step at a time.

Signal handlers, the health-probe job and HTTP handlers only put events on `self.events` (a
SimpleQueue, whose put is safe inside a signal handler). Everything that changes state happens here,
in the loop's thread: spawning and stopping vLLM, reading its output, deciding what a failure means,
writing the journal and the state file, telling systemd.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog

from tunerd import __version__
from tunerd.act.leftovers import LeftoverReaper
from tunerd.config import Config, ConfigError, load_config
from tunerd.decide.restart_policy import Action, decide_after_failure
from tunerd.durable import atomic_write
from tunerd.engine.failures import EngineFailure, FailureKind
from tunerd.engine.launch import build_argv, build_env
from tunerd.engine.logwatch import KvCacheSize
from tunerd.engine.oscalls import OsCalls
from tunerd.engine.params import EngineParams
from tunerd.engine.process import Engine, EngineRun, Exited, TreeGone, failure_from_exit
from tunerd.engine.states import EngineState
from tunerd.export import Exporter, Metrics
from tunerd.journal import Journal, JournalError, utc_now
from tunerd.logs import configure_logging
from tunerd.observe.health import HealthResult
from tunerd.observe.jobs import ObserveJobs
from tunerd.observe.poller import PollSample, PollTarget
from tunerd.observe.signals import SIGNALS, SignalWindow
from tunerd.state import DaemonState, EngineRecord, StateStore
from tunerd.systemd import Notifier

_SIGNAL_UNITS = {spec.name: spec.unit for spec in SIGNALS}

EX_OK = 0
EX_CONFIG = 78  # sysexits.h: configuration error (RestartPreventExitStatus in the unit)

log = structlog.get_logger("tunerd")


class DaemonSetupError(Exception):
    """The daemon cannot run with this config (e.g. journal unwritable). Message: `key: reason`."""


@dataclass
class PendingStart:
    """A start the loop will make once `not_before` has passed and the preflight allows it."""

    params: EngineParams
    intent: int | None  # the journal intent this start fulfils
    action: str
    not_before: float


@dataclass(frozen=True)
class Command:
    """An operator command posted by the local HTTP endpoint (`tunerd resume`, …)."""

    name: str


class Supervisor:
    TICK_S = 0.1  # while a child exists: how often its output is read and its exit reaped

    def __init__(
        self,
        config: Config,
        config_path: str,
        *,
        oscalls: OsCalls | None = None,
        notifier: Notifier | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.os = oscalls or OsCalls()
        self.notifier = notifier or Notifier()
        self.monotonic = monotonic
        self.wallclock = wallclock
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.journal = Journal(config.paths.journal_path, clock=wallclock)
        self.store = StateStore(config.paths.state_file)
        self.dstate = DaemonState()
        self.engine: Engine | None = None
        self.params = config.engine.params
        self.known_good: EngineParams | None = None
        self.failures = 0
        self.pending: PendingStart | None = None
        self.open_intent: int | None = None
        self.fatal_reason: str | None = None
        self.waiting_reason: str | None = None
        self.shutting_down = False
        self.reload_requested = False
        self.exit_code: int | None = None
        self.journal_error: str | None = None
        self.restarts: Counter[str] = Counter()
        self.started_mono = monotonic()
        self.reaper: LeftoverReaper | None = None
        self.jobs = ObserveJobs(self.events, config.timeouts, config.observe)
        self.window = SignalWindow(config.observe.window_s)
        self.signals: dict[str, float | None] = {}
        self.metrics = Metrics()
        self.exporter: Exporter | None = None

    # -- set-up ----------------------------------------------------------------------------------

    def setup(self) -> None:
        """Open the journal and the state, choose the parameters, schedule the first start.

        Raises DaemonSetupError when the state dir or journal cannot be used.
        """
        self.os.become_subreaper()
        try:
            self.config.paths.state_dir.mkdir(parents=True, exist_ok=True)
            self.dstate, warning = self.store.load()
            report = self.journal.open()
        except (OSError, JournalError) as exc:
            raise DaemonSetupError(f"paths: cannot use the state dir or journal: {exc}") from exc
        if warning:
            log.warning("state.unreadable", detail=warning)
        if report.torn_bytes:
            log.warning("journal.repaired", torn_bytes=report.torn_bytes, moved_to=report.torn_moved_to)
        if report.aborted_intents:
            log.warning("journal.intents_aborted", intents=report.aborted_intents)
        self._start_exporter()
        self.engine = Engine(
            oscalls=self.os,
            marker=self.dstate.instance_id,
            log_dir=self.config.paths.engine_log_dir,
            logs_kept=self.config.paths.engine_logs_kept,
            on_transition=self._on_transition,
        )
        self.params, why = self._initial_params()
        self.known_good = EngineParams(**self.dstate.last_known_good) if self.dstate.last_known_good else None
        recorded = self.dstate.engine.pgid if self.dstate.engine else None
        self.reaper = LeftoverReaper(self.os, self.dstate.instance_id, recorded)
        self._record(
            "daemon.started", version=__version__, config=self.config_path, params=self.params, why=why
        )
        self._schedule_start(self.params, "start", why, delay=0.0)

    def _start_exporter(self) -> None:
        export = self.config.export
        if not export.enabled:
            return
        try:
            self.exporter = Exporter(
                export.host, export.port, self.metrics, lambda name: self.events.put(Command(name))
            )
        except OSError as exc:
            raise DaemonSetupError(
                f"export.port: cannot listen on {export.host}:{export.port}: {exc.strerror}"
            ) from exc
        host, port = self.exporter.address
        atomic_write(self.config.paths.export_address_file, f"{host}:{port}\n".encode())
        self.exporter.start()

    def _initial_params(self) -> tuple[EngineParams, str]:
        """Last-known-good when the operator has not edited [engine.params] since; else the config's."""
        configured = self.config.engine.params
        lkg = self.dstate.last_known_good
        if lkg is not None and self.dstate.base_params == configured.as_dict():
            return EngineParams(**lkg), "daemon start: last-known-good parameters"
        if lkg is not None:
            return configured, "daemon start: [engine.params] changed since last-known-good; using the config"
        return configured, "daemon start: parameters from the config"

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> int:
        """Run until shut down. Returns the process exit status."""
        self._install_signal_handlers()
        self.jobs.start()
        self.notifier.ready(self._status_line())
        try:
            while self.exit_code is None:
                self._wait_and_handle_events()
                self._step(self.monotonic())
                self.notifier.watchdog(self.monotonic())
        finally:
            self.jobs.stop()
            if self.exporter is not None:
                self.exporter.stop()
            self.journal.close()
        return self.exit_code

    def _wait_and_handle_events(self) -> None:
        timeout = self.TICK_S if self.engine and self.engine.run else 0.5
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._handle(event)
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return

    def _install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.events.put(signum))

    def _handle(self, event: Any) -> None:
        if event in (signal.SIGTERM, signal.SIGINT):
            self._begin_shutdown(signal.Signals(event).name)
        elif event == signal.SIGHUP:
            self.reload_requested = True
        elif isinstance(event, HealthResult):
            self._on_health(event, self.monotonic())
        elif isinstance(event, PollSample):
            self._on_poll(event)
        elif isinstance(event, Command):
            self._on_command(event)

    def _step(self, now: float) -> None:
        engine = self.engine
        assert engine is not None
        for ev in engine.poll(now, self.config.timeouts.graceful_stop_s):
            if isinstance(ev, EngineFailure):
                self._on_failure(ev, now)
            elif isinstance(ev, KvCacheSize):
                self.metrics.kv_cache_tokens.set(ev.tokens)
                log.info("engine.kv_cache", tokens=ev.tokens, max_concurrency=ev.max_concurrency)
            elif isinstance(ev, Exited):
                self._on_exit(ev, now)
            elif isinstance(ev, TreeGone):
                self._on_tree_gone(ev, now)
        run = engine.run
        budget = self.config.timeouts.startup_s
        if engine.state is EngineState.STARTING and run is not None and now - run.started_mono > budget:
            self._on_failure(
                EngineFailure(FailureKind.STARTUP_TIMEOUT, f"no /health 200 in {budget:g} s"), now
            )
        if engine.state is EngineState.RUNNING and run is not None:
            self._maybe_mark_known_good(run, now)
        if self.reload_requested and engine.state not in (EngineState.STARTING, EngineState.STOPPING):
            self.reload_requested = False
            self._reload()
        if self.shutting_down and engine.run is None:
            self._finish_shutdown()
        elif self.pending is not None and engine.run is None and now >= self.pending.not_before:
            self._try_start(now)
        self._publish_probe_target()
        self._publish_status(now)

    # -- starting ----------------------------------------------------------------------------------

    def _schedule_start(
        self, params: EngineParams, action: str, reason: str, delay: float, **fields: Any
    ) -> bool:
        """Announce a start in the journal (intent, fsynced) and queue it. False if not durable."""
        if params != self.params:
            fields["params_before"] = self.params
        intent = self._intent(action, reason=reason, params=params, delay_s=delay, **fields)
        if intent is None and params != self.params:
            log.error("change.refused", reason="journal unwritable: no change without a durable intent")
            return False
        self.pending = PendingStart(params, intent, action, self.monotonic() + delay)
        return True

    def _try_start(self, now: float) -> None:
        pending, engine, reaper = self.pending, self.engine, self.reaper
        assert pending is not None and engine is not None and reaper is not None
        verdict = reaper.step(now, self.config.timeouts.graceful_stop_s)
        for entry in verdict.journal:
            self._record(entry.pop("event"), **entry)
        if not verdict.clear:
            self._set_waiting(verdict.reason)
            return
        self._set_waiting(None)
        self.pending = None
        self.params = pending.params
        self.open_intent = pending.intent
        argv = build_argv(self.config.engine, pending.params)
        env = build_env(self.config.engine)
        try:
            run = engine.spawn(argv, env, pending.params, now, self.wallclock())
        except OSError as exc:
            self._on_spawn_error(exc, now)
            return
        host = self.config.engine.host
        run.base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.config.engine.port}"
        self.dstate.engine = EngineRecord(
            pid=run.pid, pgid=run.pgid, started=run.started_wall.isoformat(), log=str(run.log_path)
        )
        self._save_state()
        self._record("engine.spawned", pid=run.pid, argv=argv, log=str(run.log_path), intent=pending.intent)

    def _on_spawn_error(self, exc: OSError, now: float) -> None:
        failure = EngineFailure(
            FailureKind.SPAWN_FAILED, f"cannot execute {self.config.engine.command[0]}: {exc}"
        )
        self._record("engine.failed", phase="spawn", failure=failure.as_dict())
        self._close_intent("failed", failure=failure.as_dict())
        self._decide_after_failure(failure, ran_for_s=None, now=now)

    # -- watching ----------------------------------------------------------------------------------

    def _on_health(self, result: HealthResult, now: float) -> None:
        engine = self.engine
        assert engine is not None
        run = engine.run
        if run is None or result.run_id != run.run_id:
            return  # a late answer about an earlier run
        if engine.state is EngineState.STARTING and result.ok:
            engine.mark_ready(now)
            seconds = round(now - run.started_mono, 2)
            kv = run.kv_cache.tokens if run.kv_cache else None
            self._record("engine.ready", pid=run.pid, seconds=seconds, kv_cache_tokens=kv, params=run.params)
            self._close_intent("ok", seconds=seconds, kv_cache_tokens=kv)
        elif engine.state is EngineState.RUNNING:
            run.health_failures = 0 if result.ok else run.health_failures + 1
            if run.health_failures >= self.config.timeouts.health_failures:
                detail = f"/health failed {run.health_failures} times in a row (last: {result.detail})"
                self._on_failure(EngineFailure(FailureKind.HEALTH_FAILED, detail), now)

    def _on_failure(self, failure: EngineFailure, now: float) -> None:
        """A failure seen while STARTING/RUNNING: journal it at once and stop the whole tree."""
        engine = self.engine
        assert engine is not None and engine.run is not None
        if engine.state not in (EngineState.STARTING, EngineState.RUNNING):
            if engine.state is EngineState.STOPPING and engine.run.failure is not None:
                engine.note_failure(failure)  # a more specific cause printed while stopping
            return
        run = engine.run
        standing = engine.note_failure(failure)
        phase = engine.state.name.lower()
        self._record(
            "engine.failed",
            phase=phase,
            pid=run.pid,
            seconds=round(now - run.started_mono, 2),
            failure=standing.as_dict(),
            params=run.params,
            log=str(run.log_path),
        )
        log.error("engine.failed", phase=phase, kind=str(standing.kind), detail=standing.detail)
        engine.begin_stop(now, str(standing.kind))

    def _on_exit(self, event: Exited, now: float) -> None:
        engine = self.engine
        assert engine is not None and engine.run is not None
        run = engine.run
        self._record(
            "engine.exited",
            pid=run.pid,
            exit=event.status.as_dict(),
            how=event.status.describe(killed_by_us=run.kill_sent),
        )
        if engine.state in (EngineState.STARTING, EngineState.RUNNING):
            self._on_failure(failure_from_exit(event.status, phase=engine.state), now)

    def _on_tree_gone(self, event: TreeGone, now: float) -> None:
        engine = self.engine
        assert engine is not None and engine.run is not None
        run = engine.run
        self._record(
            "engine.stopped",
            pid=run.pid,
            reason=run.stop_reason,
            seconds=round(event.seconds, 2),
            sigkill=event.killed,
            survivors=list(event.survivors),
        )
        if event.survivors:
            log.error("engine.survivors", pids=list(event.survivors))
        if run.failure is None:
            engine.settle(EngineState.STOPPED)
            self._clear_engine_record()
            if self.open_intent is not None and self.open_intent != (self.pending and self.pending.intent):
                self._close_intent("aborted", reason=run.stop_reason)
            return
        failure = run.failure
        self.restarts[str(failure.kind)] += 1
        self.metrics.restarts.labels(reason=str(failure.kind)).inc()
        if self.open_intent is not None:
            self._close_intent("failed", failure=failure.as_dict(), tail=run.tail[-10:])
        ran_for = run.uptime(now) if run.ready_mono is not None else None
        engine.settle(EngineState.BACKOFF)
        self._clear_engine_record()
        if self.shutting_down:
            return
        self._decide_after_failure(failure, ran_for_s=ran_for, now=now)

    def _decide_after_failure(self, failure: EngineFailure, ran_for_s: float | None, now: float) -> None:
        engine = self.engine
        assert engine is not None
        decision = decide_after_failure(
            self.config.backoff,
            failures_before=self.failures,
            ran_for_s=ran_for_s,
            failure=failure,
            params=self.params,
            known_good=self.known_good,
        )
        self.failures = decision.failures
        if decision.action is Action.FATAL or decision.params is None:
            self._enter_fatal(f"{failure.kind}: {decision.reason}; last error: {failure.detail}")
            return
        if engine.state is not EngineState.BACKOFF:
            engine.enter(EngineState.BACKOFF)
        self._record(
            "engine.backoff",
            action=str(decision.action),
            delay_s=decision.delay_s,
            failures=decision.failures,
            reason=decision.reason,
        )
        self._schedule_start(
            decision.params, str(decision.action), decision.reason, decision.delay_s, after=str(failure.kind)
        )

    def _enter_fatal(self, reason: str) -> None:
        engine = self.engine
        assert engine is not None
        self.fatal_reason = reason
        self.pending = None
        engine.enter(EngineState.FATAL)
        self._record("engine.fatal", reason=reason, params=self.params)
        log.error(
            "engine.fatal", reason=reason, hint="fix the cause, then `tunerd resume` or reload the config"
        )

    def _maybe_mark_known_good(self, run: EngineRun, now: float) -> None:
        """Parameters that have served for `known_good_after_s` become last-known-good."""
        if run.uptime(now) < self.config.backoff.known_good_after_s:
            return
        if self.known_good == run.params and self.failures == 0:
            return
        self.failures = 0
        if self.known_good == run.params:
            return
        self.known_good = run.params
        self.dstate.last_known_good = run.params.as_dict()
        self.dstate.base_params = self.config.engine.params.as_dict()
        self._save_state()
        self._record("known_good.updated", params=run.params)

    # -- operator actions --------------------------------------------------------------------------

    def _on_command(self, command: Command) -> None:
        if command.name == "resume" and self.engine and self.engine.state is EngineState.FATAL:
            self._leave_fatal("operator resume", self.params)

    def _leave_fatal(self, reason: str, params: EngineParams) -> None:
        engine = self.engine
        assert engine is not None
        self.fatal_reason = None
        self.failures = 0
        engine.enter(EngineState.STOPPED)
        self._schedule_start(params, "start", reason, delay=0.0)

    def _reload(self) -> None:
        """SIGHUP: load the config again; a bad one is rejected and the old one stays."""
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            self.metrics.reload_ok.set(0)
            self._record("config.reload_failed", problems=exc.problems)
            log.error("config.reload_failed", problems=exc.problems)
            self.notifier.reloaded(self._status_line())
            return
        old, self.config = self.config, new
        self.metrics.reload_ok.set(1)
        self.metrics.reload_time.set_to_current_time()
        self.jobs.health.timeouts = new.timeouts
        configure_logging(new.logging.level, new.logging.format)
        if new.paths != old.paths or new.export != old.export:
            log.warning("config.restart_needed", detail="[paths] and [export] take effect at daemon restart")
        self._record("config.reloaded", engine_changed=new.engine != old.engine)
        log.info("config.reloaded", engine_changed=new.engine != old.engine)
        engine = self.engine
        assert engine is not None
        if engine.state is EngineState.FATAL:
            self._leave_fatal("config reload", new.engine.params)
        elif new.engine != old.engine:
            self._restart(new.engine.params, "config reload changed [engine]")
        self.notifier.reloaded(self._status_line())

    def _restart(self, params: EngineParams, reason: str) -> None:
        """A planned restart: intent first, then stop, then start with `params`."""
        engine = self.engine
        assert engine is not None
        self.failures = 0
        if not self._schedule_start(params, "restart", reason, delay=0.0):
            return
        if engine.run is not None:
            engine.begin_stop(self.monotonic(), "restart")
        elif engine.state is EngineState.BACKOFF:
            engine.enter(EngineState.STOPPED)

    # -- shutdown ----------------------------------------------------------------------------------

    def _begin_shutdown(self, why: str) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        self.notifier.stopping(f"stopping vLLM ({why})")
        log.info("daemon.stopping", signal=why)
        engine = self.engine
        assert engine is not None
        if engine.run is not None and engine.state is not EngineState.STOPPING:
            engine.begin_stop(self.monotonic(), "daemon shutdown")

    def _finish_shutdown(self) -> None:
        if self.pending is not None and self.pending.intent is not None:
            self.journal_outcome(self.pending.intent, "aborted", reason="daemon shutdown")
        if self.open_intent is not None:
            self._close_intent("aborted", reason="daemon shutdown")
        self._record("daemon.stopped")
        self.exit_code = EX_OK

    # -- journal, state, status ----------------------------------------------------------------

    def _record(self, event: str, **fields: Any) -> None:
        try:
            self.journal.append(event, **fields)
        except JournalError as exc:
            self._journal_failed(event, exc)

    def _intent(self, action: str, **fields: Any) -> int | None:
        try:
            return self.journal.intent(action, **fields)
        except JournalError as exc:
            self._journal_failed("intent", exc)
            return None

    def journal_outcome(self, intent: int, result: str, **fields: Any) -> None:
        try:
            self.journal.outcome(intent, result, **fields)
        except JournalError as exc:
            self._journal_failed("outcome", exc)

    def _journal_failed(self, event: str, exc: JournalError) -> None:
        self.journal_error = str(exc)
        self.metrics.journal_errors.inc()
        log.error("journal.write_failed", event_name=event, error=str(exc))

    def _close_intent(self, result: str, **fields: Any) -> None:
        if self.open_intent is not None:
            self.journal_outcome(self.open_intent, result, **fields)
            self.open_intent = None

    def _save_state(self) -> None:
        try:
            self.store.save(self.dstate)
        except OSError as exc:
            log.error("state.write_failed", error=str(exc))

    def _clear_engine_record(self) -> None:
        self.dstate.engine = None
        self._save_state()

    def _set_waiting(self, reason: str | None) -> None:
        if reason != self.waiting_reason:
            self.waiting_reason = reason
            if reason:
                log.info("engine.start_delayed", reason=reason)
            self.notifier.status(self._status_line())

    def _on_transition(self, old: EngineState, new: EngineState, run: EngineRun | None) -> None:
        log.info("engine.state", old=old.name, new=new.name, pid=run.pid if run else None)
        self.metrics.set_engine(new)
        if run is not None:
            self.metrics.set_params(run.params.as_dict())
        self.notifier.status(self._status_line())

    def _publish_probe_target(self) -> None:
        """Tell the observation jobs what to look at (an immutable value, swapped whole)."""
        engine = self.engine
        assert engine is not None
        run, state = engine.run, engine.state
        if run is None or state not in (EngineState.STARTING, EngineState.RUNNING):
            self.jobs.health.target = None
            self.jobs.poller.target = None
            return
        health = (run.run_id, run.base_url, state is EngineState.STARTING)
        if self.jobs.health.target != health:
            self.jobs.health.target = health
        serving = run.base_url if state is EngineState.RUNNING else None
        poll = PollTarget(run.run_id, serving, run.pid)
        if self.jobs.poller.target != poll:
            self.jobs.poller.target = poll

    def _on_poll(self, sample: PollSample) -> None:
        """Fold one observation into the signal window; a failed scrape is a missing sample, never 0."""
        run = self.engine.run if self.engine else None
        current = run is not None and sample.run_id == run.run_id
        scrape = sample.scrape if current else None
        engine_sample = scrape.sample if scrape is not None else None
        self.metrics.scrape_up.set(1.0 if scrape is not None and scrape.error is None else 0.0)
        if scrape is not None and scrape.error:
            log.debug("engine.scrape_failed", error=scrape.error)
        try:
            self.signals = dict(self.window.update(sample.taken_at, engine_sample, sample.readings))
        except ValueError:  # a sample older than the last one (never with one poll thread): drop it
            return
        self.metrics.set_signals(self.signals, _SIGNAL_UNITS)

    def _publish_status(self, now: float) -> None:
        if self.exporter is None:
            return
        engine = self.engine
        assert engine is not None
        run = engine.run
        pending = self.pending
        self.exporter.publish(
            {
                "daemon": {
                    "version": __version__,
                    "pid": os.getpid(),
                    "uptime_s": round(now - self.started_mono, 1),
                    "config": self.config_path,
                    "journal": str(self.config.paths.journal_path),
                    "journal_error": self.journal_error,
                },
                "engine": {
                    "state": engine.state.name,
                    "status": self._status_line(),
                    "pid": run.pid if run else None,
                    "uptime_s": round(run.uptime(now), 1) if run and run.ready_mono else None,
                    "params": (run.params if run else self.params).as_dict(),
                    "known_good": self.known_good.as_dict() if self.known_good else None,
                    "kv_cache_tokens": run.kv_cache.tokens if run and run.kv_cache else None,
                    "log": str(run.log_path) if run else None,
                    "consecutive_failures": self.failures,
                    "fatal_reason": self.fatal_reason,
                    "waiting_reason": self.waiting_reason,
                    "next_start_in_s": round(max(0.0, pending.not_before - now), 1) if pending else None,
                    "restarts": dict(self.restarts),
                },
                "last_journal": self.journal.last_record,
                "signals": {
                    name: {"value": value, "unit": _SIGNAL_UNITS.get(name, "")}
                    for name, value in self.signals.items()
                },
            }
        )

    def _status_line(self) -> str:
        engine = self.engine
        state = engine.state.name if engine else "STOPPED"
        run = engine.run if engine else None
        if state == "FATAL":
            return f"engine FATAL: {self.fatal_reason}"
        if self.waiting_reason:
            return f"engine {state}: start delayed: {self.waiting_reason}"
        return f"engine {state}" + (f" (pid {run.pid})" if run else "")
