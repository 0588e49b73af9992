"""Sliding windows of polled samples → named signals with units, for rules to read (docs/signals.md).

Pure: the caller passes `time.monotonic()` stamps; nothing here reads a clock or does I/O. Each poll
feeds the `EngineSample` (None when the scrape failed) and host/GPU readings by name (`host.*`,
`engine.*`, `gpu.*`, as the collectors' `as_readings()` give them). Any numeric input can be fed by
name: names ending in `_total` (plus `extra_counters`) are counters, all others gauges.

- None, NaN or ±inf is a *missing* reading, never 0; an empty window yields no signal (all None).
- Counter rates survive a vLLM restart: a decrease is a reset and the new value counts from zero
  (Prometheus `rate()`), so a rate is never negative. Histograms are handled the same way, per bucket.
- Quantiles interpolate inside the bucket like Prometheus `histogram_quantile`, over the bucket
  increases in the window; no observation in the window → None.
Cost: a poll appends to one deque per input; rates and quantiles use only the first and last point of a
series (resets are folded into an offset at add time), averages a C-level sum; signals are cached until
the next poll.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import add, lt, sub
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tunerd.observe.vllm_metrics import EngineSample, Histogram

__all__ = [
    "EXTRA_COUNTERS",
    "KEY_INDICATORS",
    "SIGNALS",
    "SignalSpec",
    "SignalWindow",
    "histogram_quantile",
    "signals_markdown",
]

# Counters whose names do not end in `_total` (PSI stall time in microseconds).
EXTRA_COUNTERS = frozenset({"host.psi_some_total_us", "host.psi_full_total_us"})
_ENGINE_FIELDS = (
    "kv_cache_usage", "requests_running", "requests_waiting", "preemptions_total", "prompt_tokens_total",
    "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
)  # fmt: skip
_ENGINE_HISTOGRAMS = ("ttft", "inter_token_latency", "e2e_latency", "queue_time")  # input "vllm.<field>"


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """One published signal. `kind` says how it is computed over the window: `last` (latest poll),
    `avg`/`max`/`min` (over the window's readings), `rate` (counter increase per second), `ratio`
    (increase of one counter over another's), `quantile` (from histogram bucket increases)."""

    name: str
    unit: str
    kind: str
    source: str
    description: str


_M = "vLLM /metrics (the scrape's outcome)"
_KV = "vllm:kv_cache_usage_perc (old: vllm:gpu_cache_usage_perc), max over engines"
_RUN = "vllm:num_requests_running, summed over engines"
_WAIT = "vllm:num_requests_waiting, summed over engines"
_MEM = "host.mem_available_bytes, host.mem_total_bytes (/proc/meminfo)"
_AVAIL = "/proc/meminfo MemAvailable"
_PCIE = "gpu.pcie_tx_bytes_per_s + gpu.pcie_rx_bytes_per_s (NVML; None on unified memory: no PCIe link)"
_LAT = (
    ("ttft", "vllm.ttft", "vllm:time_to_first_token_seconds"),
    ("itl", "vllm.inter_token_latency", "vllm:inter_token_latency_seconds (old: time_per_output_token)"),
    ("e2e", "vllm.e2e_latency", "vllm:e2e_request_latency_seconds"),
    ("queue_time", "vllm.queue_time", "vllm:request_queue_time_seconds"),
)
# (name, unit, kind, argument, source, description). The argument is the input name; (input, q) for
# quantiles; (numerator, denominator) counters for ratios.
# fmt: off
_TABLE: tuple[tuple[str, str, str, object, str, str], ...] = (
    ("scrape.up", "1/0", "last", "scrape.up", _M, "1 when the latest poll's scrape gave a sample, else 0"),
    ("scrape.success_ratio", "ratio 0..1", "avg", "scrape.up", _M, "share of polls with a sample"),
    ("kv_cache.usage", "ratio 0..1", "last", "vllm.kv_cache_usage", _KV, "KV-cache usage, latest poll"),
    ("kv_cache.usage_avg", "ratio 0..1", "avg", "vllm.kv_cache_usage", _KV, "mean over the window"),
    ("kv_cache.usage_max", "ratio 0..1", "max", "vllm.kv_cache_usage", _KV, "max over the window"),
    ("kv_cache.size_tokens", "tokens", "last", "vllm.kv_cache_size_tokens",
     "vllm:cache_config_info label kv_cache_size_tokens", "KV-cache capacity as vLLM resolved it"),
    ("requests.running", "requests", "last", "vllm.requests_running", _RUN, "requests in the batch, latest"),
    ("requests.running_avg", "requests", "avg", "vllm.requests_running", _RUN, "mean over the window"),
    ("requests.waiting", "requests", "last", "vllm.requests_waiting", _WAIT, "requests queued, latest"),
    ("requests.waiting_max", "requests", "max", "vllm.requests_waiting", _WAIT, "max over the window"),
    ("requests.completed_rate", "1/s", "rate", "vllm.e2e_latency", "vllm:e2e_request_latency_seconds",
     "requests finished per second (increase of the +Inf bucket)"),
    ("preemptions.rate", "1/s", "rate", "vllm.preemptions_total", "vllm:num_preemptions_total",
     "preemptions per second: the KV cache is too small for the batch"),
    ("throughput.generation", "tokens/s", "rate", "vllm.generation_tokens_total",
     "vllm:generation_tokens_total", "generated tokens per second"),
    ("throughput.prompt", "tokens/s", "rate", "vllm.prompt_tokens_total", "vllm:prompt_tokens_total",
     "prompt tokens per second"),
    ("prefix_cache.hit_ratio", "ratio 0..1", "ratio",
     ("vllm.prefix_cache_hits_total", "vllm.prefix_cache_queries_total"),
     "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total (old: vllm:gpu_prefix_cache_*)",
     "increase of hit tokens / increase of queried tokens; None without queries"),
    *(
        (f"{short}.p{round(q * 100)}", "s", "quantile", (name, q), metric,
         f"{q:g} quantile of the window's observations (histogram_quantile of bucket increases)")
        for short, name, metric in _LAT for q in (0.5, 0.95, 0.99)
    ),
    ("memory.used_ratio", "ratio 0..1", "last", "host.mem_used_ratio", _MEM,
     "1 − MemAvailable/MemTotal: host memory in use (on unified memory, the GPU's too)"),
    ("memory.used_ratio_max", "ratio 0..1", "max", "host.mem_used_ratio", _MEM, "max over the window"),
    ("host.mem_available_bytes", "bytes", "last", "host.mem_available_bytes", _AVAIL, "latest poll"),
    ("host.mem_available_bytes_min", "bytes", "min", "host.mem_available_bytes", _AVAIL, "window min"),
    ("host.page_cache_bytes", "bytes", "last", "host.page_cache_bytes", "/proc/meminfo",
     "Buffers + Cached − Shmem: page cache that dropping caches would free"),
    ("host.swap_used_bytes", "bytes", "last", "host.swap_used_bytes", "/proc/meminfo", "swap in use"),
    ("host.swap_in_rate", "pages/s", "rate", "host.swap_in_pages_total", "/proc/vmstat pswpin",
     "pages swapped in per second"),
    ("host.swap_out_rate", "pages/s", "rate", "host.swap_out_pages_total", "/proc/vmstat pswpout",
     "pages swapped out per second"),
    ("host.page_fault_rate", "1/s", "rate", "host.pgfault_total", "/proc/vmstat pgfault",
     "page faults (minor + major) per second, whole host"),
    ("host.major_fault_rate", "1/s", "rate", "host.pgmajfault_total", "/proc/vmstat pgmajfault",
     "major faults (served from disk) per second, whole host"),
    ("host.psi_some_avg10", "percent", "last", "host.psi_some_avg10", "/proc/pressure/memory some avg10",
     "share of time some task stalled on memory (10 s average)"),
    ("host.psi_full_avg10", "percent", "last", "host.psi_full_avg10", "/proc/pressure/memory full avg10",
     "share of time all tasks stalled on memory (10 s average)"),
    ("engine.fault_rate", "1/s", "rate", "engine.faults_total",
     "engine.minflt_total + engine.majflt_total (/proc/<pid>/stat, engine process tree)",
     "page faults per second in the engine processes"),
    ("engine.major_fault_rate", "1/s", "rate", "engine.majflt_total",
     "engine.majflt_total (/proc/<pid>/stat, engine process tree)",
     "major faults per second in the engine processes"),
    ("engine.rss_bytes", "bytes", "last", "engine.rss_bytes", "/proc/<pid>/status VmRSS, engine tree",
     "resident memory of the engine processes"),
    ("gpu.mem_used_bytes", "bytes", "last", "gpu.mem_used_bytes", "NVML", "in use (host figure on GB10)"),
    ("gpu.mem_used_ratio", "ratio 0..1", "last", "gpu.mem_used_ratio",
     "gpu.mem_used_bytes, gpu.mem_total_bytes (NVML)", "used / total GPU memory"),
    ("gpu.engine_mem_bytes", "bytes", "last", "gpu.engine_mem_bytes", "NVML per-process memory",
     "GPU memory held by the engine processes"),
    ("gpu.util_percent", "percent", "last", "gpu.util_percent", "NVML", "GPU utilization, latest poll"),
    ("gpu.util_percent_avg", "percent", "avg", "gpu.util_percent", "NVML", "mean over the window"),
    ("gpu.migration_bytes_per_s", "bytes/s", "last", "gpu.migration_bytes_per_s", _PCIE,
     "host↔GPU traffic, latest poll"),
    ("gpu.migration_bytes_per_s_avg", "bytes/s", "avg", "gpu.migration_bytes_per_s", _PCIE, "window mean"),
    ("gpu.unified_memory", "1/0", "last", "gpu.unified_memory", "NVML", "1: CPU and GPU share memory (GB10)"),
)
# fmt: on
SIGNALS: tuple[SignalSpec, ...] = tuple(SignalSpec(n, u, k, src, d) for n, u, k, _, src, d in _TABLE)
_ARGS = tuple((k, arg) for _, _, k, arg, _, _ in _TABLE)
# The four indicators the operators' guide watches together.
KEY_INDICATORS = ("memory.used_ratio", "host.page_fault_rate", "gpu.migration_bytes_per_s", "kv_cache.usage")


def signals_markdown() -> str:
    """The catalogue as a Markdown table (docs/signals.md embeds it; a test keeps the two equal)."""
    rows = ["| signal | unit | kind | how computed | source |", "|---|---|---|---|---|"]
    for s in SIGNALS:
        rows.append(f"| `{s.name}` | {s.unit} | {s.kind} | {s.description} | {s.source} |")
    return "\n".join(rows) + "\n"


def histogram_quantile(q: float, bounds: tuple[float, ...], cumulative: tuple[float, ...]) -> float | None:
    """Prometheus' `histogram_quantile` (promql/quantile.go `bucketQuantile`) for one histogram.

    `bounds` are the sorted upper bounds ending with +Inf, `cumulative` the cumulative counts. Returns
    None where Prometheus returns NaN (no observations, no +Inf bucket, fewer than two buckets).
    """
    if not 0.0 <= q <= 1.0 or len(bounds) < 2 or bounds[-1] != math.inf:
        return None
    counts, top = [], 0.0
    for c in cumulative:  # ensureMonotonic: a reset mid-window can leave small dips
        top = c if c > top else top
        counts.append(top)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next((i for i, c in enumerate(counts[:-1]) if c >= rank), len(counts) - 1)
    if b == len(counts) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, count = 0.0, counts[b]
    if b > 0:
        start, count, rank = bounds[b - 1], count - counts[b - 1], rank - counts[b - 1]
    return start + (bounds[b] - start) * (rank / count)


class _Series:
    """Present readings of one input inside the window. Counters store `raw + offset`, where offset
    grows by the last value seen before each reset; histograms store the raw bucket vector and an
    offset vector shared by consecutive points until a reset."""

    __slots__ = ("les", "offset", "raw_last", "times", "values")

    def __init__(self, les: tuple[float, ...] | None = None) -> None:
        self.times: deque[float] = deque()
        self.values: deque = deque()
        self.les = les
        self.raw_last = self.offset = None


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den <= 0 else num / den


class SignalWindow:
    """Polls of the last `window_s` seconds and the signals computed from them (see module doc)."""

    def __init__(self, window_s: float = 60.0, *, extra_counters: Iterable[str] = EXTRA_COUNTERS) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._counters = frozenset(extra_counters)
        self._polls: deque[float] = deque()
        self._latest: dict[str, float | None] = {}
        self._gauges: dict[str, _Series] = {}
        self._counts: dict[str, _Series] = {}
        self._hists: dict[str, _Series] = {}
        self._cache: dict[str, float | None] | None = None
        self._deltas: dict[str, tuple[float, tuple[float, ...]] | None] = {}  # per poll, for 3 quantiles

    def __len__(self) -> int:
        """Polls inside the window."""
        return len(self._polls)

    def add(self, now: float, engine: EngineSample | None, readings: Mapping[str, float | None] = {}) -> None:
        """Record one poll at monotonic time `now` (never earlier than the previous poll, else
        ValueError): the engine sample (None: the scrape failed) and any readings by name."""
        if self._polls and now < self._polls[-1]:
            raise ValueError(f"poll at {now} is earlier than the previous one at {self._polls[-1]}")
        inputs = {name: _finite(v) for name, v in readings.items()}
        inputs.update(_derived(inputs))
        inputs["scrape.up"] = 0.0 if engine is None else 1.0
        if engine is not None:
            for field in _ENGINE_FIELDS:
                inputs["vllm." + field] = _finite(getattr(engine, field))
            size = (engine.cache_config or {}).get("kv_cache_size_tokens")
            inputs["vllm.kv_cache_size_tokens"] = _parse_number(size)
            for field in _ENGINE_HISTOGRAMS:
                hist = getattr(engine, field)
                if hist is not None:
                    self._add_histogram(now, "vllm." + field, hist)
        for name, value in inputs.items():
            if value is None:
                continue
            if name.endswith("_total") or name in self._counters:
                self._add_counter(now, name, value)
            else:
                series = self._gauges.get(name) or self._gauges.setdefault(name, _Series())
                series.times.append(now)
                series.values.append(value)
        self._polls.append(now)
        self._latest = inputs
        self._cache = None
        self._deltas.clear()
        self._evict(now - self.window_s)

    def _add_counter(self, now: float, name: str, value: float) -> None:
        series = self._counts.get(name) or self._counts.setdefault(name, _Series())
        if series.raw_last is None:
            series.offset = 0.0
        elif value < series.raw_last:  # reset: the counter restarted from zero
            series.offset += series.raw_last
        series.raw_last = value
        series.times.append(now)
        series.values.append(value + series.offset)

    def _add_histogram(self, now: float, name: str, hist: Histogram) -> None:
        les = tuple(le for le, _ in hist.buckets)
        counts = tuple(c for _, c in hist.buckets)
        series = self._hists.get(name)
        if series is None or series.les != les:  # new, or another bucket layout: start afresh
            series = self._hists[name] = _Series(les)
            series.offset = (0.0,) * len(les)
        elif any(map(lt, counts, series.raw_last)):
            series.offset = tuple(map(add, series.offset, series.raw_last))
        series.raw_last = counts
        series.times.append(now)
        series.values.append((counts, series.offset))

    def _evict(self, cutoff: float) -> None:
        polls = self._polls
        while polls[0] < cutoff:
            polls.popleft()
        for table in (self._gauges, self._counts, self._hists):
            for name in [n for n, s in table.items() if s.times[0] < cutoff]:
                series = table[name]
                while series.times and series.times[0] < cutoff:
                    series.times.popleft()
                    series.values.popleft()
                if not series.times:
                    del table[name]

    # --- accessors over any input name -------------------------------------------------------------
    def last(self, name: str) -> float | None:
        """The input's value at the latest poll (None if that poll lacked it)."""
        return self._latest.get(name)

    def avg(self, name: str) -> float | None:
        """Mean of the input's readings in the window."""
        series = self._gauges.get(name)
        return math.fsum(series.values) / len(series.values) if series else None

    def max(self, name: str) -> float | None:
        series = self._gauges.get(name)
        return max(series.values) if series else None

    def min(self, name: str) -> float | None:
        series = self._gauges.get(name)
        return min(series.values) if series else None

    def increase(self, name: str) -> tuple[float, float] | None:
        """(increase, seconds) of a counter between its first and last reading in the window, resets
        counted from zero; for a histogram input, of its observation count."""
        series = self._counts.get(name)
        if series is not None and len(series.times) > 1:
            return series.values[-1] - series.values[0], series.times[-1] - series.times[0]
        delta = self._bucket_increase(name)
        return None if delta is None else (delta[1][-1], delta[0])

    def rate(self, name: str) -> float | None:
        """Per-second increase of a counter (or histogram count) over the window; never negative."""
        inc = self.increase(name)
        return None if inc is None or inc[1] <= 0 else inc[0] / inc[1]

    def _bucket_increase(self, name: str) -> tuple[float, tuple[float, ...]] | None:
        """(seconds, per-bucket cumulative increase) between the window's first and last histogram."""
        if name in self._deltas:
            return self._deltas[name]
        series, delta = self._hists.get(name), None
        if series is not None and len(series.times) > 1:
            (first, first_off), (last, last_off) = series.values[0], series.values[-1]
            if first_off is not last_off:  # a reset in between: compare raw + offset
                first, last = tuple(map(add, first, first_off)), tuple(map(add, last, last_off))
            delta = series.times[-1] - series.times[0], tuple(map(sub, last, first))
        self._deltas[name] = delta
        return delta

    def quantile(self, name: str, q: float) -> float | None:
        """q-quantile of a histogram input's observations in the window (None without any)."""
        delta = self._bucket_increase(name)
        les = self._hists[name].les if delta is not None else None
        return None if les is None else histogram_quantile(q, les, delta[1])  # type: ignore[index]

    def signals(self) -> Mapping[str, float | None]:
        """Every signal of `SIGNALS` by name, None where unknown; cached until the next `add`."""
        if self._cache is not None:
            return self._cache
        out: dict[str, float | None] = {}
        for spec, (kind, arg) in zip(SIGNALS, _ARGS, strict=True):
            if not self._polls:
                value = None
            elif kind == "last":
                value = self._latest.get(arg)  # type: ignore[call-overload]
            elif kind == "rate":
                value = self.rate(arg)  # type: ignore[arg-type]
            elif kind == "quantile":
                value = self.quantile(*arg)  # type: ignore[misc]
            elif kind == "ratio":
                num, den = (self.increase(n) for n in arg)  # type: ignore[union-attr]
                value = _ratio(num[0], den[0]) if num and den else None
            else:  # avg / max / min
                value = getattr(self, kind)(arg)
            out[spec.name] = value
        self._cache = out
        return out

    def update(
        self, now: float, engine: EngineSample | None, readings: Mapping[str, float | None] = {}
    ) -> Mapping[str, float | None]:
        """`add` then `signals`: the per-poll call."""
        self.add(now, engine, readings)
        return self.signals()


def _parse_number(text: str | None) -> float | None:
    try:
        return _finite(float(text)) if text is not None else None
    except ValueError:  # vLLM writes "None" for unset config values
        return None


def _derived(r: Mapping[str, float | None]) -> dict[str, float | None]:
    """Inputs computed from other readings of the same poll, so that windows apply to them too."""
    avail, total = r.get("host.mem_available_bytes"), r.get("host.mem_total_bytes")
    used, gtotal = r.get("gpu.mem_used_bytes"), r.get("gpu.mem_total_bytes")
    tx, rx = r.get("gpu.pcie_tx_bytes_per_s"), r.get("gpu.pcie_rx_bytes_per_s")
    minflt, majflt = r.get("engine.minflt_total"), r.get("engine.majflt_total")
    free = _ratio(avail, total)
    return {
        "host.mem_used_ratio": None if free is None else 1.0 - free,
        "gpu.mem_used_ratio": _ratio(used, gtotal),
        "gpu.migration_bytes_per_s": None if tx is None or rx is None else tx + rx,
        "engine.faults_total": None if minflt is None or majflt is None else minflt + majflt,
    }


if __name__ == "__main__":  # python -m tunerd.observe.signals: print the table for docs/signals.md
    print(signals_markdown(), end="")
