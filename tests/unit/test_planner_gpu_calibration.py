"""The planner's GPU calibration against real vLLM 0.24.0 starts on an H200 that tunerd itself made.

tests/fixtures/vllm-0.24.0-h200-tunerd/: the same model started at gpu_memory_utilization 0.5
(633,200 KV tokens) and, after a tuning-style restart, at 0.6 (764,080). After one calibration start
the prediction for the other utilization must be vLLM's figure exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunerd.core.params import EngineParams
from tunerd.engine.logwatch import read_start_report
from tunerd.observe.gpu import GpuDeviceSample
from tunerd.observe.machine_facts import build_memory_facts, cuda_visible_total
from tunerd.observe.model.info import model_info_from_config
from tunerd.planner.calibration import calibrate
from tunerd.planner.plan import assess

HERE = Path(__file__).resolve().parent
CAPTURES = HERE.parent / "fixtures" / "vllm-0.24.0-h200-tunerd"
MIB = 1 << 20
# What tunerd's GPU collector read on that machine (gpu_check.txt): total 143,771 MiB; used + free
# (NVML v2, driver-reserved memory left out) 143,156 MiB while nothing ran.
NVML_TOTAL = 143_771 * MIB
CUDA_TOTAL = 143_156 * MIB


def model():
    config = json.loads((HERE / "model_configs" / "qwen3-0.6b.json").read_text())
    return model_info_from_config(config, path="/root/qwen3-0.6b")


def facts():
    meminfo = "MemTotal: 131000000 kB\nMemFree: 120000000 kB\nMemAvailable: 120000000 kB\n"
    return build_memory_facts(
        meminfo, gpu_total_bytes=CUDA_TOTAL, gpu_free_bytes=CUDA_TOTAL, gpu_present=True
    )


def params(utilization: float) -> EngineParams:
    return EngineParams(max_model_len=4096, gpu_memory_utilization=utilization)


@pytest.mark.parametrize(
    ("calibrated_at", "log", "predict_at", "logged"),
    [(0.5, "start_util_0.5.log", 0.6, 764_080), (0.6, "start_util_0.6.log", 0.5, 633_200)],
)
def test_one_calibration_start_predicts_another_utilization_exactly(
    calibrated_at: float, log: str, predict_at: float, logged: int
) -> None:
    parsed = read_start_report((CAPTURES / log).read_text().splitlines())
    calibration = calibrate(parsed, model(), params(calibrated_at), facts(), backend="cuda")
    verdict = assess(model(), params(predict_at), facts(), backend="cuda", calibration=calibration)
    assert verdict.kv_cache_tokens == logged


def test_the_total_is_what_cuda_sees_not_nvmls_total_with_reserved_memory() -> None:
    device = GpuDeviceSample.__new__(GpuDeviceSample)
    object.__setattr__(device, "mem_total_bytes", NVML_TOTAL)
    object.__setattr__(device, "mem_used_bytes", 73_011 * MIB)
    object.__setattr__(device, "mem_free_bytes", 70_145 * MIB)
    assert cuda_visible_total(device) == CUDA_TOTAL
