"""Periodic observation jobs (APScheduler threads) that only post results to the main loop's queue, and
one-shot jobs (a thread pool) whose futures the loop looks at.

The jobs never touch supervisor state. They read targets, immutable values the main loop replaces
as a whole (an atomic reference swap), and put their results on the event queue.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
import structlog
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from tunerd.config import Config, TimeoutsConfig
from tunerd.observe.gpu import GpuCollector
from tunerd.observe.health import probe_health
from tunerd.observe.memory import read_memory
from tunerd.observe.poller import Poller

log = structlog.get_logger("tunerd")

WAKE = "wake"  # event: a submitted job finished (the loop only wakes up and steps)
# One-shot jobs at once: a probe (minutes at most), a plan, a port or process scan, a cache reset, the
# fleet's exchange, the capability probe; more wait their turn, never dropped.
ONE_SHOT_WORKERS = 8


@dataclass(frozen=True)
class Due:
    """Event: scheduled work is due (`what`: "probe", "cache_reset"); the loop decides whether it runs."""

    what: str


T = TypeVar("T")

STARTING_PROBE_S = 0.25  # real vLLM refuses connections until it serves; then /health is 200 at once


class HealthJob:
    """Probes `/health` of the current run: every 0.25 s while starting, every interval while running."""

    def __init__(self, events: queue.SimpleQueue[Any], timeouts: TimeoutsConfig) -> None:
        self.events = events
        self.timeouts = timeouts
        # (run id, base URL, starting?) or None when there is nothing to probe.
        self.target: tuple[int, str, bool] | None = None
        self._client = httpx.Client(trust_env=False)
        self._last_probe = 0.0
        self._last_run: int | None = None

    def tick(self) -> None:
        target = self.target
        if target is None:
            return
        run_id, base_url, starting = target
        interval = STARTING_PROBE_S if starting else self.timeouts.health_interval_s
        now = time.monotonic()
        if run_id == self._last_run and now - self._last_probe < interval:
            return
        self._last_probe, self._last_run = now, run_id
        self.events.put(probe_health(self._client, base_url, run_id, self.timeouts.health_timeout_s))

    def close(self) -> None:
        self._client.close()


class MemoryGuardJob:
    """Reads host memory every `guard.interval_s` while vLLM starts or runs (the host-wedge guard)."""

    def __init__(self, events: queue.SimpleQueue[Any], proc: str) -> None:
        self.events = events
        self.proc = proc
        self.active = False  # set by the main loop

    def tick(self) -> None:
        if self.active:
            self.events.put(read_memory(self.proc))


class ObserveJobs:
    """The scheduler with the health probe and the poll; started and stopped by the supervisor."""

    def __init__(self, events: queue.SimpleQueue[Any], config: Config) -> None:
        timeouts, observe, guard = config.timeouts, config.observe, config.guard
        self.events = events
        self.health = HealthJob(events, timeouts)
        self.poller = Poller(events, gpu=GpuCollector(read_pcie=observe.gpu_pcie))
        self.memory = MemoryGuardJob(events, observe.memory_proc)
        self._poll_interval_s = observe.poll_interval_s
        self._guard_interval_s = guard.interval_s
        self._scheduler = BackgroundScheduler(daemon=True)
        # Not the scheduler's: APScheduler drops a one-shot job its pool picks up more than its misfire
        # grace (1 s) late, and a dropped job's future never completes. On a loaded CI box a probe's
        # job was dropped ("was missed by 0:00:01.1"): the prober waited on it for ever, and every
        # later `tunerd probe` with it.
        self._one_shot = ThreadPoolExecutor(ONE_SHOT_WORKERS, thread_name_prefix="tunerd-job")

    def start(self) -> None:
        for job, seconds, name in (
            (self.health.tick, STARTING_PROBE_S, "health"),
            (self.poller.tick, self._poll_interval_s, "poll"),
            (self.memory.tick, self._guard_interval_s, "memory-guard"),
        ):
            # One instance at a time; a late run is skipped, not queued (a slow scrape never piles up).
            # The first run is now, not an interval later: the first start's preflight waits for a poll.
            self._scheduler.add_job(
                job,
                "interval",
                seconds=seconds,
                max_instances=1,
                coalesce=True,
                id=name,
                next_run_time=datetime.now(UTC),
            )
        self._scheduler.start()

    def run_once(self, job: Callable[[], Any]) -> None:
        """Run `job` in a worker thread (now, or once a worker is free); its result (unless None) goes on
        the event queue."""

        def run() -> None:
            try:
                result = job()
            except Exception as exc:  # a background probe must never take the daemon down
                log.error(
                    "job.failed", job=getattr(job, "__name__", "job"), error=f"{type(exc).__name__}: {exc}"
                )
                return
            if result is not None:
                self.events.put(result)

        with contextlib.suppress(RuntimeError):  # stopped: the daemon is exiting
            self._one_shot.submit(run)

    def schedule(self, what: str, *, interval_s: float | None = None, cron: str | None = None) -> None:
        """Post `Due(what)` at the crontab times `cron` (local time), else every `interval_s`; neither:
        never. Replaces the schedule `what` had (a config reload)."""
        if cron is not None:
            trigger: Any = CronTrigger.from_crontab(cron)
        elif interval_s is not None:
            trigger = IntervalTrigger(seconds=interval_s)
        else:
            with contextlib.suppress(JobLookupError):
                self._scheduler.remove_job(f"due-{what}")
            return
        event = Due(what)
        self._scheduler.add_job(
            lambda: self.events.put(event),
            trigger,
            id=f"due-{what}",
            max_instances=1,
            coalesce=True,
            replace_existing=True,
        )

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run `job` in a worker thread (now, or once a worker is free: however late, it runs); the
        returned future holds its result (or exception). The loop is woken (a `WAKE` event) when it is
        done, so whoever waits on it looks again at once."""
        try:
            future = self._one_shot.submit(job)
        except RuntimeError as exc:  # stopped: the daemon is exiting, nothing will wait for it
            future = Future()
            future.set_exception(exc)
            return future
        future.add_done_callback(lambda _: self.events.put(WAKE))
        return future

    def stop(self) -> None:
        if self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        self._one_shot.shutdown(wait=False, cancel_futures=True)
        self.health.close()
        self.poller.close()
