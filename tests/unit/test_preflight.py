"""The start preflight's memory step: the baseline waits for the first poll's GPU reading."""

from __future__ import annotations

from pathlib import Path

from tests.harness import free_port
from tunerd.config import load_config
from tunerd.core.machine import GpuFacts
from tunerd.core.params import EngineParams
from tunerd.engine.leftovers import LeftoverReaper
from tunerd.engine.oscalls import OsCalls
from tunerd.supervise.preflight import Preflight

GIB = 1 << 30


def make_preflight(tmp_path: Path, gpu: list[GpuFacts | None]) -> Preflight:
    """A preflight over a fake /proc (no processes; 64 GiB total, 60 GiB available) whose GPU facts are
    whatever `gpu[0]` holds when it asks."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 67108864 kB\nMemFree: 1000 kB\nMemAvailable: 62914560 kB\n")
    config_path = tmp_path / "tunerd.toml"
    config_path.write_text(
        f'[engine]\nmodel = "/models/x"\nport = {free_port()}\n[observe]\nmemory_proc = "{proc}"\n'
    )
    oscalls = OsCalls(proc=str(proc))
    return Preflight(
        load_config(config_path),
        EngineParams(),
        oscalls=oscalls,
        marker="test-marker",
        reaper=LeftoverReaper(oscalls, "test-marker"),
        gate=None,
        gpu=lambda: gpu[0],
        plan_check=None,
        started=0.0,
    )


def test_the_first_baseline_waits_for_the_gpu_reading_and_then_includes_it(tmp_path: Path) -> None:
    gpu: list[GpuFacts | None] = [None]  # no poll yet
    preflight = make_preflight(tmp_path, gpu)
    step = preflight.step(0.5)
    assert not step.clear and step.failure is None
    assert step.reason == "waiting for the first reading of GPU memory"
    assert [r["check"] for r in step.records if r["event"] == "preflight.waiting"] == ["memory"]
    assert preflight.baseline is None

    gpu[0] = GpuFacts(unified_memory=False, free_bytes=140 * GIB)  # the first poll came
    step = preflight.step(1.0)
    assert step.clear
    (baseline,) = [r for r in step.records if r["event"] == "preflight.baseline"]
    assert baseline["gpu_free_bytes"] == 140 * GIB
    assert baseline["mem_available_bytes"] == 62914560 * 1024
    assert preflight.baseline is not None and preflight.baseline.baseline_gpu_free_bytes == 140 * GIB


def test_without_a_gpu_the_baseline_is_host_memory_alone(tmp_path: Path) -> None:
    preflight = make_preflight(tmp_path, [GpuFacts()])  # polled: no GPU
    step = preflight.step(0.5)
    assert step.clear
    (baseline,) = [r for r in step.records if r["event"] == "preflight.baseline"]
    assert baseline["gpu_free_bytes"] is None
