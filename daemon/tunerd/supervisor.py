"""The main loop: the single owner of state. Events in, one step at a time.

Signal handlers, the observation jobs and HTTP handlers only put events on `self.events` (a
SimpleQueue, whose put is safe inside a signal handler). Everything that changes state happens here,
in the loop's thread: the engine's lifecycle (supervise/lifecycle.py), the tuner, the probe, the front
door's state, the signal window, config reloads, shutdown, the status document, systemd notifications.

Over 400 lines on purpose: it wires every part together (`setup`) and dispatches every event; what each
part does lives in supervise/ (the engine's life) and tune/ (the tuning loop); the operator's commands
in commands.py.
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

import structlog

from tunerd import __version__
from tunerd.commands import Asked, Commands, ask, needs_answer, refusal
from tunerd.config import Config, ConfigError, load_all
from tunerd.config.rules import RuleSet
from tunerd.core.commands import Command
from tunerd.core.machine import MemoryReading
from tunerd.core.params import EngineParams
from tunerd.core.slo import SloWindow, readings
from tunerd.core.slo_estimate import HISTOGRAM_INPUTS, histogram_estimate
from tunerd.core.states import EngineState
from tunerd.door import Door, DoorRequests
from tunerd.engine.launch import build_env
from tunerd.engine.oscalls import OsCalls
from tunerd.faces.http import Exporter
from tunerd.faces.logs import configure_logging
from tunerd.faces.operator import OperatorSocket
from tunerd.faces.status import DaemonFacts, build_status, objective_status, tuning_status
from tunerd.faces.systemd import Notifier
from tunerd.observe.health import HealthResult
from tunerd.observe.identity import Capabilities, EngineIdentity, probe_capabilities
from tunerd.observe.jobs import WAKE, Due, ObserveJobs
from tunerd.observe.poller import PollSample, PollTarget
from tunerd.observe.signals import SIGNALS, SignalWindow
from tunerd.records.durable import atomic_write
from tunerd.records.experience import Experience, experience_path
from tunerd.records.journal import Journal, JournalError, utc_now
from tunerd.records.metrics import Metrics
from tunerd.records.recorder import Recorder
from tunerd.records.state import StateStore
from tunerd.supervise.cache_reset import CacheReset
from tunerd.supervise.capacity import CalibrationDone
from tunerd.supervise.change import ChangeEvent
from tunerd.supervise.door_link import DOOR_EVENTS, DOOR_LIVE_KEYS, DoorLink, Upstream
from tunerd.supervise.lifecycle import ACTIVE, Lifecycle
from tunerd.tune.fleet import fleet_for
from tunerd.tune.prober import Prober
from tunerd.tune.recall import Recall
from tunerd.tune.tuner import Tuner

EX_OK = 0
EX_SOFTWARE = 70  # sysexits.h: internal software error (an unhandled exception in the loop)
EX_CONFIG = 78  # sysexits.h: configuration error (RestartPreventExitStatus in the unit)

SIGNAL_UNITS = {spec.name: spec.unit for spec in SIGNALS}

log = structlog.get_logger("tunerd")


class DaemonSetupError(Exception):
    """The daemon cannot run with this config (e.g. journal unwritable). Message: `key: reason`."""


class Supervisor:
    TICK_S = 0.1  # while a child exists: how often its output is read and its exit reaped
    STATUS_EVERY_S = 0.5  # how often the status document is rebuilt (not at every tick)

    def __init__(
        self,
        config: Config,
        config_path: str,
        *,
        rules: RuleSet | None = None,
        oscalls: OsCalls | None = None,
        notifier: Notifier | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.rules = rules
        self.os = oscalls or OsCalls()
        self.notifier = notifier or Notifier()
        self.monotonic = monotonic
        self.wallclock = wallclock
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.metrics = Metrics()
        self.journal = Journal(config.paths.journal_path, clock=wallclock)
        self.recorder = Recorder(self.journal, self.metrics)
        self.store = StateStore(config.paths.state_file)
        self.jobs = ObserveJobs(self.events, config)
        self.window = SignalWindow(config.observe.window_s)
        self.slo = SloWindow(config.observe.window_s, started=monotonic())  # the door's recent requests
        self.signals: Mapping[str, float | None] = {}  # the window returns a fresh mapping per poll
        self.exporter: Exporter | None = None
        self.operator: OperatorSocket | None = None
        self.lifecycle: Lifecycle | None = None
        self.tuner: Tuner | None = None
        self.prober: Prober | None = None
        self.cache_reset: CacheReset | None = None
        self.door_link: DoorLink | None = None
        self.commands: Commands | None = None
        self._published_at = float("-inf")
        self.reload_requested = False
        self.shutting_down = False
        self.exit_code: int | None = None
        self.started_mono = monotonic()

    # -- set-up ----------------------------------------------------------------------------------

    def setup(self) -> None:
        """Open the journal and the state, choose the parameters, schedule the first start.

        Raises DaemonSetupError when the state dir, the journal or the export port cannot be used.
        """
        self.os.become_subreaper()
        try:
            self.config.paths.state_dir.mkdir(parents=True, exist_ok=True)
            dstate, warning = self.store.load()
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
        door = self._start_door()
        upstream = Upstream(door) if door is not None else None
        self._start_operator_socket()
        self.lifecycle = Lifecycle(
            self.config,
            oscalls=self.os,
            recorder=self.recorder,
            store=self.store,
            dstate=dstate,
            metrics=self.metrics,
            on_status_change=self._status_changed,
            background=self.jobs.run_once,
            post=self.events.put,  # a change's outcome (ChangeEvent) comes back through the loop
            door=upstream,
            submit=self.jobs.submit,
            monotonic=self.monotonic,
            wallclock=self.wallclock,
        )
        if upstream is not None:
            self.door_link = DoorLink(upstream, self.lifecycle, recorder=self.recorder)
        experience = Experience(experience_path(self.config.paths.state_dir))
        fleet = fleet_for(lambda: self.config, experience, recorder=self.recorder, submit=self.jobs.submit)
        recall = Recall(
            experience,
            self.lifecycle,
            lambda: self.config,
            recorder=self.recorder,
            wallclock=self.wallclock,
        )
        capacity = self.lifecycle.capacity
        self.prober = Prober(
            self.config,
            self.lifecycle,
            recorder=self.recorder,
            submit=self.jobs.submit,
            vocab=lambda: model.vocab_size if (model := capacity.model()) is not None else None,
            monotonic=self.monotonic,
            recall=recall,
        )
        self.cache_reset = CacheReset(
            self.config, self.lifecycle, recorder=self.recorder, submit=self.jobs.submit
        )
        self.tuner = Tuner(
            self.config,
            self.rules,
            self.lifecycle,
            recorder=self.recorder,
            dstate=dstate,
            save_state=self.lifecycle.save_state,
            metrics=self.metrics,
            submit=self.jobs.submit,
            wallclock=self.wallclock,
            prober=self.prober,
            recall=recall,
            fleet=fleet,
            restart_wait=self.door_link.restart_wait if self.door_link is not None else None,
            door_lost=self.door_link.lost_caps if self.door_link is not None else None,
            door=self.door_link,
        )
        cache_reset = self.cache_reset
        self.commands = Commands(
            self.lifecycle,
            self.tuner,
            self.prober,
            lambda: self.door_link,
            recorder=self.recorder,
            submit=self.jobs.submit,
            cache_reset=lambda trigger: cache_reset.due(self.signals, trigger),
            monotonic=self.monotonic,
        )
        self._schedule()
        params, why = self.lifecycle.initial_params()
        self.recorder.record(
            "daemon.started", version=__version__, config=self.config_path, params=params, why=why
        )
        self.lifecycle.schedule_start(params, "start", why, delay=0.0)

    def _schedule(self) -> None:
        """The scheduled work (APScheduler posts `Due` events; the loop decides whether it runs)."""
        probe = self.config.probe
        on = probe.enabled
        self.jobs.schedule(
            "probe",
            interval_s=probe.interval_s if on and probe.interval_s else None,
            cron=probe.cron if on else None,
        )
        self.jobs.schedule("cache_reset", cron=self.config.cache_reset.cron)

    def _start_exporter(self) -> None:
        export = self.config.export
        if not export.enabled:
            return
        socket_path = str(self.config.paths.socket_path)
        try:
            self.exporter = Exporter(export.host, export.port, self.metrics, socket_path)
        except OSError as exc:
            raise DaemonSetupError(
                f"export.port: cannot listen on {export.host}:{export.port}: {exc.strerror}"
            ) from exc
        host, port = self.exporter.address
        atomic_write(self.config.paths.export_address_file, f"{host}:{port}\n".encode())
        self.exporter.start()

    def _start_door(self) -> Door | None:
        """The front door, listening before the first start (requests wait in it until vLLM serves)."""
        config = self.config.door
        if not config.enabled:
            return None
        door = Door(config, post=self.events.put, registry=self.metrics.registry)
        try:
            door.start()
        except OSError as exc:
            raise DaemonSetupError(
                f"door.port: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
            ) from exc
        return door

    def _start_operator_socket(self) -> None:
        path = str(self.config.paths.socket_path)
        try:
            self.operator = OperatorSocket(path, self._accept_command)
        except OSError as exc:
            raise DaemonSetupError(f"paths.socket: cannot listen on {path}: {exc.strerror or exc}") from exc
        self.operator.start()

    def _accept_command(self, command: Command) -> str | None:
        """Handler thread: validate what can be validated without the loop's state, then enqueue; a
        `restart --set` waits for the loop's answer (the planner's check runs off this thread).
        None = accepted; else why not."""
        why = refusal(command, self.config)
        if why is not None:
            return why
        if needs_answer(command):
            return ask(command, self.events.put)
        self.events.put(command)
        return None

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> int:
        """Run until shut down. Returns the process exit status: 0 after a clean shutdown, 70 after an
        unhandled exception in the loop (journaled, vLLM stopped first: never left unsupervised)."""
        lifecycle = self.lifecycle
        assert lifecycle is not None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.events.put(signum))
        self.jobs.start()
        self._probe_capabilities_if_needed()
        self.notifier.ready(self._status_line())
        try:
            while self.exit_code is None:
                self._wait_and_handle_events()
                self._step(self.monotonic())
                self.notifier.watchdog(self.monotonic())
        except Exception as exc:  # gunicorn's arbiter: log it, stop the children, exit
            self._crashed(exc)
        finally:
            if self.commands is not None:
                self.commands.close()
            self.jobs.stop()
            for face in (self.exporter, self.operator):
                if face is not None:
                    face.stop()
            if self.door_link is not None:  # last: what still waits in it gets 503, never a reset
                self.door_link.door.stop()
            self.journal.close()
        return self.exit_code

    def _probe_capabilities_if_needed(self) -> None:
        """Ask `<command> --help` what the installed vLLM offers, once per engine command."""
        assert self.lifecycle is not None
        if self.lifecycle.needs_capabilities():
            command, env = list(self.config.engine.command), build_env(self.config.engine)
            self.jobs.run_once(lambda: probe_capabilities(command, env))

    def _crashed(self, exc: Exception) -> None:
        """An unhandled exception in the loop: journal it, stop vLLM (bounded), exit 70 so that systemd
        restarts the daemon, whose next start reaps anything left by the marker."""
        detail = "".join(traceback.format_exception(exc))
        log.error("daemon.crashed", error=f"{type(exc).__name__}: {exc}", traceback=detail)
        self.recorder.record("daemon.crashed", error=f"{type(exc).__name__}: {exc}", traceback=detail[-4000:])
        self.notifier.stopping("stopping vLLM: tunerd hit an internal error")
        self.exit_code = EX_SOFTWARE
        assert self.lifecycle is not None
        try:
            self.lifecycle.stop_now(self.monotonic, sleep=time.sleep)
        except Exception as again:  # the engine itself is what failed: the process group still goes
            log.error("daemon.crash_stop_failed", error=f"{type(again).__name__}: {again}")
            self.lifecycle.kill_now()

    def _wait_and_handle_events(self) -> None:
        busy = self.lifecycle is not None and self.lifecycle.engine.run is not None
        try:
            event = self.events.get(timeout=self.TICK_S if busy else 0.5)
        except queue.Empty:
            return
        while True:
            self._handle(event)
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, event: Any) -> None:
        lifecycle = self.lifecycle
        assert lifecycle is not None
        now = self.monotonic()
        if event in (signal.SIGTERM, signal.SIGINT):
            self._begin_shutdown(signal.Signals(event).name)
        elif event == signal.SIGHUP:
            self.reload_requested = True
        elif isinstance(event, HealthResult):
            lifecycle.on_health(event, now)
        elif isinstance(event, PollSample):
            self._on_poll(event, now)
        elif isinstance(event, MemoryReading):
            lifecycle.on_memory(event, now)
        elif isinstance(event, EngineIdentity):
            lifecycle.on_identity(event)
            assert self.tuner is not None
            self.tuner.on_identity()
        elif isinstance(event, Capabilities):
            lifecycle.on_capabilities(event)
        elif isinstance(event, CalibrationDone):
            lifecycle.on_calibration(event)
        elif isinstance(event, Command):
            self._on_command(event)
        elif isinstance(event, Asked):
            self._on_asked(event)
        elif isinstance(event, ChangeEvent):
            assert self.tuner is not None
            self.tuner.on_change(event)  # to the trial or the exploration that requested it
        elif isinstance(event, DoorRequests):
            self.slo.add(event.samples)
        elif isinstance(event, DOOR_EVENTS):
            assert self.door_link is not None
            self.door_link.on_event(event)
        elif isinstance(event, Due):
            self._on_due(event)
        elif event == WAKE:
            pass  # a submitted job finished: the step that follows looks at it
        else:
            log.warning("daemon.unknown_event", event_type=type(event).__name__)

    def _step(self, now: float) -> None:
        lifecycle = self.lifecycle
        assert lifecycle is not None and self.commands is not None
        self.commands.step()  # a `restart --set` the planner accepted is requested before the step
        lifecycle.step(now)
        assert self.tuner is not None and self.prober is not None and self.cache_reset is not None
        self.prober.step(now)
        self.tuner.step(now)
        self.cache_reset.step(self.signals)
        if self.door_link is not None:
            self.door_link.step()
        state = lifecycle.engine.state
        if self.reload_requested and state not in (EngineState.STARTING, EngineState.STOPPING):
            self.reload_requested = False  # a reload during a restart waits until it settles
            self._reload()
        if self.shutting_down and lifecycle.settled:
            self.recorder.record("daemon.stopped")
            self.exit_code = EX_OK
        self._publish_targets()
        if self.exporter is not None and now - self._published_at >= self.STATUS_EVERY_S:
            self._published_at = now
            self.exporter.publish(self._status(now))

    def _on_poll(self, sample: PollSample, now: float) -> None:
        """Fold one observation into the signal window; a failed scrape is a missing sample, never 0."""
        lifecycle = self.lifecycle
        assert lifecycle is not None
        run = lifecycle.engine.run
        scrape = sample.scrape if run is not None and sample.run_id == run.run_id else None
        if self.door_link is not None:  # the door's queue and per-request figures: inputs of their own
            sample = replace(sample, readings={**sample.readings, **self._door_readings(sample.taken_at)})
        self.metrics.scrape_up.set(1.0 if scrape is not None and scrape.error is None else 0.0)
        if scrape is not None and scrape.error:
            log.debug("engine.scrape_failed", error=scrape.error)
        try:
            engine_sample = scrape.sample if scrape is not None else None
            signals = self.window.update(
                sample.taken_at, engine_sample, sample.readings, scraped=scrape is not None
            )
        except ValueError:  # older than the last sample (cannot happen with one poll thread): drop it
            return
        assert self.prober is not None
        self.signals = {**signals, **self.prober.signals(now)}  # the rules read the probe's figures too
        self.metrics.set_signals(self.signals, SIGNAL_UNITS)
        lifecycle.on_poll(sample, now)
        assert self.tuner is not None
        self.tuner.on_poll(sample, self.signals, now)

    def _door_readings(self, now: float) -> dict[str, float | None]:
        """`door.waiting` (never added to vLLM's `requests.waiting`) and the window's `slo.*`/`door.*`
        figures from the door's per-request samples (core/slo.py), also exported as tunerd_slo_*."""
        assert self.door_link is not None
        objective = self.config.objective
        stats = self.slo.stats(now, objective.targets, objective.count)
        self.metrics.set_slo(stats, objective.targets, objective.attainment)
        door = self.door_link.door.drain_state()
        return readings(stats, door.queued, door.arrivals)

    def _publish_targets(self) -> None:
        """Tell the observation jobs what to look at (immutable values, swapped whole)."""
        lifecycle = self.lifecycle
        assert lifecycle is not None
        run, state = lifecycle.engine.run, lifecycle.engine.state
        active = run is not None and state in ACTIVE
        self.jobs.memory.active = run is not None and state in (*ACTIVE, EngineState.STOPPING)
        if not active or run is None:
            self.jobs.health.target = None
            self.jobs.poller.target = None
            return
        health = (run.run_id, run.base_url, state is EngineState.STARTING)
        if self.jobs.health.target != health:
            self.jobs.health.target = health
        poll = PollTarget(run.run_id, run.base_url if state is EngineState.RUNNING else None, run.pid)
        if self.jobs.poller.target != poll:
            self.jobs.poller.target = poll

    def _on_due(self, due: Due) -> None:
        """Scheduled work came due: the periodic probe, the off-peak cache reset."""
        assert self.prober is not None and self.cache_reset is not None
        if self.shutting_down:
            return
        if due.what == "probe":
            self.prober.due("periodic health check", busy=self.signals.get("requests.running"))
        elif due.what == "cache_reset":
            self.cache_reset.due(self.signals)

    # -- operator actions --------------------------------------------------------------------------

    def _on_command(self, command: Command) -> None:
        if not self.shutting_down:
            assert self.commands is not None
            self.commands.run(command)

    def _on_asked(self, asked: Asked) -> None:
        assert self.commands is not None
        if self.shutting_down:
            self.commands.decline(asked, "tunerd is stopping (nothing was done)")
        else:
            self.commands.ask(asked)

    def _reload(self) -> None:
        """SIGHUP: load the config again; a bad one is rejected and the old one stays."""
        lifecycle = self.lifecycle
        assert lifecycle is not None
        self.notifier.reloading()
        try:
            loaded = load_all(self.config_path)
        except ConfigError as exc:
            self.metrics.reload_ok.set(0)
            self.recorder.record("config.reload_failed", problems=exc.problems)
            log.error("config.reload_failed", problems=exc.problems)
            self.notifier.reloaded(self._status_line())
            return
        new = loaded.config
        old, self.config, self.rules = self.config, new, loaded.rules
        lifecycle.config = new
        assert self.tuner is not None and self.prober is not None and self.cache_reset is not None
        self.tuner.reload(new, loaded.rules)
        self.prober.config = self.cache_reset.config = new
        self._schedule()
        self.metrics.reload_ok.set(1)
        self.metrics.reload_time.set_to_current_time()
        self.jobs.health.timeouts = new.timeouts
        configure_logging(new.logging.level, new.logging.format)
        live = dict.fromkeys(DOOR_LIVE_KEYS)  # what the running door takes (door_link.apply_config)
        same_door = new.door.model_copy(update=live) == old.door.model_copy(update=live)
        if (new.paths, new.export, new.observe) != (old.paths, old.export, old.observe) or not same_door:
            log.warning(
                "config.restart_needed",
                detail="[paths], [export], [observe] and [door] (but max_in_flight, min_in_flight) apply at "
                "daemon restart",
            )
        if self.door_link is not None:
            if new.door.max_in_flight != old.door.max_in_flight:
                if new.door.max_in_flight is None:  # no fixed cap any more: the controller's again
                    self.door_link.steer("config reload")
                else:
                    self.door_link.set_max_in_flight(new.door.max_in_flight, "config reload")
            self.door_link.apply_config(new)  # the objective's targets, [door] min_in_flight
            if new.engine.model != old.engine.model:
                self.door_link.set_model_dir(new.engine.model)
        self._probe_capabilities_if_needed()  # a new engine command is asked what it offers
        self.recorder.record(
            "config.reloaded",
            engine_changed=new.engine != old.engine,
            rules=[rule.name for rule in loaded.rules.rules] if loaded.rules else [],
        )
        log.info("config.reloaded", engine_changed=new.engine != old.engine)
        if lifecycle.engine.state is EngineState.FATAL:
            lifecycle.resume("config reload", new.engine.params)
        elif new.engine != old.engine:
            lifecycle.restart(new.engine.params, "config reload changed [engine]")
        self.notifier.reloaded(self._status_line())

    def _begin_shutdown(self, why: str) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        self.notifier.stopping(f"stopping vLLM ({why})")
        log.info("daemon.stopping", signal=why)
        assert self.lifecycle is not None
        self.lifecycle.shutdown()

    def _status(self, now: float) -> dict[str, Any]:
        assert self.lifecycle is not None
        daemon = DaemonFacts(
            pid=os.getpid(),
            uptime_s=now - self.started_mono,
            config=self.config_path,
            journal=str(self.config.paths.journal_path),
            journal_error=self.recorder.error,
        )
        assert self.tuner is not None
        document = build_status(
            daemon,
            self.lifecycle,
            self.params_in_force(),
            self.signals,
            SIGNAL_UNITS,
            self.recorder.last_record,
            now,
        )
        document["tuning"] = tuning_status(self.tuner, now)
        increases = {t: self.window.histogram_increase(name) for t, name in HISTOGRAM_INPUTS.items()}
        estimate = histogram_estimate(increases, self.config.objective.targets)
        document["objective"] = objective_status(self.config, self.signals, estimate)
        if self.door_link is not None:
            document["door"] = self.door_link.status()
        return document

    def _status_changed(self) -> None:
        """The engine's state or wait reason changed: systemd hears it, and /status is rebuilt at once."""
        self.notifier.status(self._status_line())
        self._published_at = float("-inf")

    def _status_line(self) -> str:
        return self.lifecycle.status_line() if self.lifecycle else "engine STOPPED"

    def params_in_force(self) -> EngineParams:
        assert self.lifecycle is not None
        run = self.lifecycle.engine.run
        return run.params if run else self.lifecycle.params
