"""The once-a-second observation: vLLM's /metrics, host memory and faults, NVML — one `PollSample`.

Runs in a scheduler thread and only posts its result to the main loop, which owns the signal window.
It reads `target` (an immutable tuple the loop swaps whole): which run to attribute samples to, where
vLLM listens (None while it does not serve yet) and the engine's root pid (for its process tree).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from tunerd.observe.gpu import GpuCollector, GpuSample
from tunerd.observe.host import HostCollector, HostSample
from tunerd.observe.vllm_metrics import SameBodySameSample, ScrapeResult, filtered_metrics_url, scrape
from tunerd.procfs import processes as procfs

PIDS_REFRESH_S = 10.0  # walking /proc for the engine's tree costs ~1 ms: not every poll


@dataclass(frozen=True, slots=True)
class PollTarget:
    run_id: int
    base_url: str | None  # None while vLLM is not serving (starting): host and GPU are still sampled
    root_pid: int


@dataclass(frozen=True, slots=True)
class PollSample:
    run_id: int | None
    taken_at: float  # monotonic seconds
    scrape: ScrapeResult | None  # None when there was nothing to scrape
    host: HostSample | None
    gpu: GpuSample
    readings: Mapping[str, float | None]


class FaultCounter:
    """Page faults of a process tree whose members come and go, as counters that only grow.

    Summing `minflt` over the current processes drops when one exits, which a rate would read as a
    counter reset (a false spike). Instead, each process contributes what it added since the last
    sample; a new process contributes its whole count.
    """

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}
        self.minor = 0
        self.major = 0

    def update(self, faults_by_pid: tuple[tuple[int, int, int], ...]) -> tuple[int, int]:
        current: dict[int, tuple[int, int]] = {}
        for pid, minor, major in faults_by_pid:
            last_minor, last_major = self._last.get(pid, (0, 0))
            self.minor += max(0, minor - last_minor)
            self.major += max(0, major - last_major)
            current[pid] = (minor, major)
        self._last = current
        return self.minor, self.major


class Poller:
    """One poll per `tick()`; results go to `events`. Keeps only per-run bookkeeping of its own.

    Per run it asks vLLM for `vllm:cache_config_info` only until one answer has it (static for a run, and
    a large share of the filtered answer); later samples carry that `cache_config` on. Scrapes go over
    one keep-alive `httpx.Client` (no proxies from the environment: vLLM is local), and an answer equal
    to the last one is not parsed again (`SameBodySameSample`: an idle vLLM's).
    """

    def __init__(
        self,
        events: queue.SimpleQueue[Any] | None,
        *,
        host: HostCollector | None = None,
        gpu: GpuCollector | None = None,
        proc: str = "/proc",
        clock: Any = time.monotonic,
    ) -> None:
        self.events = events
        self.target: PollTarget | None = None
        self.host = host or HostCollector(proc=proc)
        self.gpu = gpu or GpuCollector(proc=proc)
        self.proc = proc
        self.clock = clock
        self.client = httpx.Client(trust_env=False)
        self._run_id: int | None = None
        self._faults = FaultCounter()
        self._pids: list[int] = []
        self._pids_at = float("-inf")
        self._filtered = True  # False once vLLM (or a proxy) refused /metrics/?name[]=…
        self._cache_config: Mapping[str, str] | None = None  # the run's, once read
        self._parse = SameBodySameSample()

    def tick(self) -> None:
        sample = self.poll()
        if self.events is not None:
            self.events.put(sample)

    def poll(self) -> PollSample:
        """Take one sample now. Never raises for a missing engine, GPU or vLLM answer."""
        target = self.target
        now = self.clock()
        if target is None or target.run_id != self._run_id:
            self._new_run(target)
        pids = self._engine_pids(target, now)
        result = self._scrape(target)
        host = self._sample_host(pids)
        gpu = self.gpu.sample(pids, host)
        readings: dict[str, float | None] = {**(host.as_readings() if host else {}), **gpu.as_readings()}
        if host is not None and host.engine is not None:
            minor, major = self._faults.update(host.engine.faults_by_pid)
            readings["engine.minflt_total"], readings["engine.majflt_total"] = float(minor), float(major)
        return PollSample(target.run_id if target else None, now, result, host, gpu, readings)

    def _new_run(self, target: PollTarget | None) -> None:
        self._run_id = target.run_id if target else None
        self._faults = FaultCounter()
        self._pids, self._pids_at = [], float("-inf")
        self._filtered, self._cache_config = True, None
        self._parse = SameBodySameSample()

    def _engine_pids(self, target: PollTarget | None, now: float) -> list[int]:
        if target is None:
            return []
        if now - self._pids_at >= PIDS_REFRESH_S or not self._pids:
            self._pids = procfs.process_tree_pids(target.root_pid, self.proc)
            self._pids_at = now
        return self._pids

    def _scrape(self, target: PollTarget | None) -> ScrapeResult | None:
        if target is None or target.base_url is None:
            return None
        result = self._scrape_once(target.base_url)
        if result.error is not None and self._filtered and result.error.startswith("HTTP "):
            # A vLLM (or proxy) that does not serve /metrics/?name[]=…: fall back to the whole page.
            self._filtered = False
            result = self._scrape_once(target.base_url)
        sample = result.sample
        if sample is not None and sample.cache_config is not None and self._cache_config is None:
            # The run's first: carried on from now on, and no longer asked for (when filtering).
            self._cache_config = sample.cache_config
        return result

    def _scrape_once(self, base_url: str) -> ScrapeResult:
        url = self._metrics_url(base_url)
        return scrape(self.client, url, cache_config=self._cache_config, parse=self._parse)

    def _metrics_url(self, base_url: str) -> str:
        if not self._filtered:
            return base_url + "/metrics"
        return filtered_metrics_url(base_url, cache_config=self._cache_config is None)

    def _sample_host(self, pids: list[int]) -> HostSample | None:
        try:
            return self.host.sample(pids)
        except OSError:
            return None

    def close(self) -> None:
        self.client.close()
