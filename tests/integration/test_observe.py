"""Observation end to end with the fake vLLM: signals from /metrics, tunerd_* metrics, `tunerd status`,
and bad /metrics answers that are missing samples (never zeros, never a restart)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Daemon, running_daemon, wait_until
from tests.integration.conftest import fake_sections


def control(path: Path, **values: Any) -> None:
    """Set the fake vLLM's control file atomically (it may read it at any moment)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values))
    tmp.replace(path)


def signal_value(daemon: Daemon, name: str) -> float | None:
    return daemon.status().get("signals", {}).get(name, {}).get("value")


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def observed_sections(workdir: Path, ctl: Path) -> dict:
    return fake_sections(workdir, knobs={"FAKE_VLLM_CONTROL": str(ctl)}, observe={"poll_interval_s": 0.2})


def test_signals_and_tunerd_metrics_follow_vllm(workdir: Path) -> None:
    ctl = workdir / "control.json"
    control(ctl, running=3, kv_cache_usage=0.5, tokens_per_s=200)
    with running_daemon(workdir, observed_sections(workdir, ctl)) as daemon:
        daemon.wait_state("RUNNING")
        wait_until(lambda: signal_value(daemon, "kv_cache.usage") == 0.5, 10, "the KV usage signal")
        wait_until(lambda: (signal_value(daemon, "throughput.generation") or 0) > 100, 10, "throughput")
        assert signal_value(daemon, "requests.running") == 3
        assert signal_value(daemon, "host.mem_available_bytes") > 0
        samples = metric_samples(daemon.metrics_text())
        assert samples[("tunerd_engine_up", ())] == 1
        assert samples[("tunerd_engine_state", ())] == 20
        assert samples[("tunerd_engine_scrape_up", ())] == 1
        assert samples[("tunerd_param", (("name", "max_model_len"),))] == 512
        assert samples[("tunerd_signal_kv_cache_usage_ratio", ())] == 0.5
        assert samples[("tunerd_signal_kv_cache_usage_max_ratio", ())] == 0.5, "0.5 in every poll so far"
        assert samples[("tunerd_config_last_reload_successful", ())] == 1
        assert samples[("tunerd_engine_kv_cache_tokens", ())] == 1952

        text = subprocess.run(
            [sys.executable, "-m", "tunerd", "status", "--config", str(daemon.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert text.returncode == 0, text.stderr
        assert "engine: RUNNING" in text.stdout
        assert "kv_cache.usage" in text.stdout and "max_model_len" in text.stdout
        as_json = subprocess.run(
            [sys.executable, "-m", "tunerd", "status", "--json", "--config", str(daemon.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert json.loads(as_json.stdout)["engine"]["state"] == "RUNNING"

        control(ctl, running=3, kv_cache_usage=0.95, tokens_per_s=200)  # a peak, then back down
        wait_until(lambda: signal_value(daemon, "kv_cache.usage") == 0.95, 10, "the peak to be polled")
        control(ctl, running=3, kv_cache_usage=0.3, tokens_per_s=200)
        wait_until(lambda: signal_value(daemon, "kv_cache.usage") == 0.3, 10, "the drop to be polled")
        samples = metric_samples(daemon.metrics_text())
        assert samples[("tunerd_signal_kv_cache_usage_ratio", ())] == 0.3
        assert samples[("tunerd_signal_kv_cache_usage_max_ratio", ())] == 0.95, "the window's peak"


def test_garbage_or_slow_metrics_are_missing_samples_and_never_restart_vllm(workdir: Path) -> None:
    ctl = workdir / "control.json"
    control(ctl, running=2, kv_cache_usage=0.7)
    with running_daemon(workdir, observed_sections(workdir, ctl)) as daemon:
        daemon.wait_state("RUNNING")
        pid = daemon.status()["engine"]["pid"]
        wait_until(lambda: signal_value(daemon, "kv_cache.usage") == 0.7, 10, "a first good sample")
        for mode in ("garbage", "truncated", "huge", "slow"):
            control(ctl, running=2, kv_cache_usage=0.7, metrics=mode)
            wait_until(
                lambda: signal_value(daemon, "scrape.up") == 0, 20, f"scrape.up 0 with {mode} /metrics"
            )
            samples = metric_samples(daemon.metrics_text())
            assert samples[("tunerd_engine_scrape_up", ())] == 0
            assert signal_value(daemon, "kv_cache.usage") is None, "a failed scrape is not a zero"
        daemon.observe(1.0, samples=3)  # more failed scrapes, each one a chance to (wrongly) restart
        status = daemon.status()["engine"]
        assert (status["state"], status["pid"]) == ("RUNNING", pid), "scrape failures alone never restart"
    assert "engine.failed" not in daemon.events()
