"""GPU collector with a fake NVML: a discrete H200, a GB10-like unified-memory device, and no GPU."""

from __future__ import annotations

import ctypes.util
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from tunerd.observe.gpu import GpuCollector
from tunerd.observe.host import HostCollector
from tunerd.procfs.processes import PAGE_SIZE

MIB = 1024 * 1024
KIB = 1024

NOT_SUPPORTED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, FUNCTION_NOT_FOUND, GPU_IS_LOST = 3, 9, 12, 13, 15


class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code in `.value`."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeDevice:
    name: str = "NVIDIA H200"
    uuid: str = "GPU-8e2a1c7e-0000-0000-0000-000000000000"
    bus_id: str = "00000000:00:06.0"
    memory: tuple[int, int, int] | int = (143771 * MIB, 133689 * MIB, 10082 * MIB)  # or an error code
    util: tuple[int, int] | int = (90, 41)
    pcie_kb_s: tuple[int, int] | int = (1200, 3400)  # (tx, rx)
    power_mw: int = 202_000
    processes: list[tuple[int, int | None]] = field(default_factory=lambda: [(1809, 133680 * MIB)])


class FakeNvml:
    """A stand-in for the pynvml module: the same function names and constants, no driver."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_DRIVER_NOT_LOADED = DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = GPU_IS_LOST
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    nvmlMemory_v2 = 0x02000028

    def __init__(self, devices: list[FakeDevice], *, init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        self.failures: dict[str, BaseException] = {}  # function name → exception to raise

    def _hit(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.failures:
            raise self.failures[name]

    @staticmethod
    def _answer(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < 100:
            raise FakeNVMLError(value)
        return value

    def nvmlInit(self) -> None:
        self._hit("nvmlInit")
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self._hit("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._hit("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        self._hit("nvmlDeviceGetHandleByIndex")
        return self.devices[index]

    def nvmlDeviceGetName(self, h: FakeDevice) -> str:
        return h.name

    def nvmlDeviceGetUUID(self, h: FakeDevice) -> str:
        return h.uuid

    def nvmlDeviceGetPciInfo(self, h: FakeDevice) -> SimpleNamespace:
        return SimpleNamespace(busId=h.bus_id)

    def nvmlDeviceGetMemoryInfo(self, h: FakeDevice, version: int | None = None) -> SimpleNamespace:
        self._hit("nvmlDeviceGetMemoryInfo")
        total, used, free = self._answer(h.memory)
        return SimpleNamespace(version=version, total=total, reserved=0, used=used, free=free)

    def nvmlDeviceGetUtilizationRates(self, h: FakeDevice) -> SimpleNamespace:
        self._hit("nvmlDeviceGetUtilizationRates")
        gpu, memory = self._answer(h.util)
        return SimpleNamespace(gpu=gpu, memory=memory)

    def nvmlDeviceGetPcieThroughput(self, h: FakeDevice, counter: int) -> int:
        self._hit("nvmlDeviceGetPcieThroughput")
        return self._answer(h.pcie_kb_s)[counter]

    def nvmlDeviceGetPowerUsage(self, h: FakeDevice) -> int:
        self._hit("nvmlDeviceGetPowerUsage")
        return h.power_mw

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeDevice) -> list[SimpleNamespace]:
        self._hit("nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.processes]

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 13000


GB10 = dict(
    name="NVIDIA GB10",
    uuid="GPU-2dee1e25-b3b5-007e-2b55-79f2d0f2ebe5",
    bus_id="0000000F:01:00.0",
    memory=NOT_SUPPORTED,
    util=(96, 0),
    pcie_kb_s=NOT_SUPPORTED,
    power_mw=11_170,
    processes=[(3001, 37 * 1024 * MIB)],
)


def fake_host(tmp_path: Path) -> tuple[Path, Path]:
    """A fake /proc (GB10-sized meminfo, an engine of two processes) and /sys (NUMA of both buses)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(
        "MemTotal:       127600748 kB\nMemFree:         5000000 kB\nMemAvailable:   118566368 kB\n"
    )
    for pid, ppid, rss_kb in ((3000, 1, 1275256), (3001, 3000, 9437184)):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "stat").write_text(f"{pid} (python) S {ppid} 3000 3000 0 -1 0 10 0 1 0 1 1\n")
        (proc / str(pid) / "statm").write_text(f"99999 {rss_kb * 1024 // PAGE_SIZE} 0 0 0 0 0\n")
    sysfs = tmp_path / "sys"
    for name, node in (("0000:00:06.0", "-1"), ("000f:01:00.0", "0")):
        d = sysfs / "bus" / "pci" / "devices" / name
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
    return proc, sysfs


def test_discrete_h200_reports_nvml_figures(tmp_path: Path) -> None:
    proc, sysfs = fake_host(tmp_path)
    h200 = FakeDevice(processes=[(1809, 133680 * MIB), (4242, 2 * 1024 * MIB)])
    gpu = GpuCollector(FakeNvml([h200]), proc=str(proc), sys=str(sysfs), clock=lambda: 7.0)
    s = gpu.sample([1745, 1808, 1809])
    assert s.available and s.reason is None and s.taken_at == 7.0
    (d,) = s.devices
    assert (d.name, d.uuid, d.pci_bus_id, d.numa_node) == ("NVIDIA H200", h200.uuid, "00000000:00:06.0", None)
    assert not d.unified_memory and d.memory_source == "nvml"
    assert (d.mem_total_bytes, d.mem_used_bytes, d.mem_free_bytes) == (
        143771 * MIB,
        133689 * MIB,
        10082 * MIB,
    )
    assert (d.util_percent, d.mem_bw_util_percent) == (90.0, 41.0)
    assert (d.pcie_tx_bytes_per_s, d.pcie_rx_bytes_per_s) == (1200 * KIB, 3400 * KIB)
    assert d.power_watts == 202.0
    assert d.engine_mem_bytes == d.engine_nvml_mem_bytes == 133680 * MIB  # pid 4242 is not ours
    assert [(p.pid, p.used_bytes) for p in d.processes or ()] == [(1809, 133680 * MIB), (4242, 2048 * MIB)]
    assert d.unsupported == frozenset() and d.errors == ()
    assert s.as_readings() == {
        "gpu.mem_used_bytes": 133689.0 * MIB,
        "gpu.mem_total_bytes": 143771.0 * MIB,
        "gpu.util_percent": 90.0,
        "gpu.pcie_tx_bytes_per_s": 1200.0 * KIB,
        "gpu.pcie_rx_bytes_per_s": 3400.0 * KIB,
        "gpu.engine_mem_bytes": 133680.0 * MIB,
        "gpu.power_watts": 202.0,
        "gpu.unified_memory": 0.0,
    }


def test_info_gives_versions_for_the_journal() -> None:
    info = GpuCollector(FakeNvml([FakeDevice()])).info()
    assert info.available
    assert (info.driver_version, info.cuda_driver_version) == ("580.159.04", "13.0")
    assert [(d.index, d.name, d.unified_memory) for d in info.devices] == [(0, "NVIDIA H200", False)]


def test_no_engine_pids_means_no_engine_figure_but_processes_listed() -> None:
    s = GpuCollector(FakeNvml([FakeDevice()])).sample()
    assert s.devices[0].engine_mem_bytes is None
    assert s.as_readings()["gpu.engine_mem_bytes"] is None
    assert [p.pid for p in s.devices[0].processes or ()] == [1809]


def test_gb10_takes_memory_from_the_host_instead_of_failing(tmp_path: Path) -> None:
    proc, sysfs = fake_host(tmp_path)
    nvml = FakeNvml([FakeDevice(**GB10)])
    gpu = GpuCollector(nvml, proc=str(proc), sys=str(sysfs))
    s = gpu.sample([3000, 3001])
    (d,) = s.devices
    assert d.unified_memory and s.unified_memory and d.memory_source == "host"
    assert (d.pci_bus_id, d.numa_node) == ("0000000F:01:00.0", 0)
    assert d.mem_total_bytes == 127600748 * KIB
    assert d.mem_free_bytes == 118566368 * KIB
    assert d.mem_used_bytes == (127600748 - 118566368) * KIB
    # NVML's per-process figure works on GB10 and counts what the driver takes from RAM outside RSS.
    assert d.engine_mem_bytes == d.engine_nvml_mem_bytes == 37 * 1024 * MIB
    assert d.util_percent == 96.0 and d.power_watts == 11.17
    assert d.pcie_tx_bytes_per_s is None and d.pcie_rx_bytes_per_s is None
    assert {"mem_total_bytes", "mem_used_bytes", "mem_free_bytes", "pcie_tx_bytes_per_s"} <= d.unsupported
    assert "util_percent" not in d.unsupported and d.errors == ()
    r = s.as_readings()
    assert r["gpu.unified_memory"] == 1.0
    assert r["gpu.mem_total_bytes"] == 127600748.0 * KIB
    assert r["gpu.engine_mem_bytes"] == 37 * 1024 * MIB
    assert r["gpu.pcie_tx_bytes_per_s"] is None
    assert gpu.info().devices[0].unified_memory


def test_gb10_falls_back_to_rss_where_nvml_lists_none_of_the_engine(tmp_path: Path) -> None:
    proc, sysfs = fake_host(tmp_path)
    gb10 = FakeDevice(**{**GB10, "processes": [(9999, 5 * MIB)]})  # another program; the engine not yet
    d = GpuCollector(FakeNvml([gb10]), proc=str(proc), sys=str(sysfs)).sample([3000, 3001]).devices[0]
    assert d.engine_nvml_mem_bytes == 0
    assert d.engine_mem_bytes == (1275256 + 9437184) * KIB  # the engine tree's RSS


def test_gb10_uses_the_polls_host_sample_instead_of_reading_proc_again(tmp_path: Path) -> None:
    host = HostCollector(proc=str(fake_host(tmp_path)[0]), page_size=PAGE_SIZE).sample([3000, 3001])
    no_proc = str(tmp_path / "nothing")  # the collector has nothing to read: figures come from `host`
    d = GpuCollector(FakeNvml([FakeDevice(**GB10)]), proc=no_proc).sample([3000, 3001], host).devices[0]
    assert (d.mem_total_bytes, d.mem_free_bytes) == (127600748 * KIB, 118566368 * KIB)
    d = GpuCollector(FakeNvml([FakeDevice(**{**GB10, "processes": []})]), proc=no_proc).sample([3001], host)
    assert d.devices[0].engine_mem_bytes == host.engine.rss_bytes == (1275256 + 9437184) * KIB


def test_unsupported_queries_are_not_asked_again(tmp_path: Path) -> None:
    proc, sysfs = fake_host(tmp_path)
    nvml = FakeNvml([FakeDevice(**GB10)])
    gpu = GpuCollector(nvml, proc=str(proc), sys=str(sysfs))
    for _ in range(3):
        gpu.sample([3001])
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] == 1  # the probe at start
    assert nvml.calls["nvmlDeviceGetPcieThroughput"] == 2  # TX and RX once each
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 3


def test_gb10_without_readable_meminfo_gives_none_not_a_crash(tmp_path: Path) -> None:
    gpu = GpuCollector(FakeNvml([FakeDevice(**GB10)]), proc=str(tmp_path / "nothing"))
    s = gpu.sample([3001])
    assert s.available
    assert s.devices[0].mem_total_bytes is None  # no host figures to stand in for NVML's
    assert s.devices[0].engine_mem_bytes == 37 * 1024 * MIB  # NVML's per-process memory still answers
    assert s.as_readings()["gpu.mem_total_bytes"] is None


@pytest.mark.parametrize(
    ("code", "reason"),
    [(LIBRARY_NOT_FOUND, "NVML library not found"), (DRIVER_NOT_LOADED, "NVIDIA driver not loaded")],
)
def test_no_gpu_says_so_once_and_samples_stay_empty(code: int, reason: str) -> None:
    nvml = FakeNvml([], init_error=code)
    gpu = GpuCollector(nvml)
    with capture_logs() as logs:
        samples = [gpu.sample([1]) for _ in range(3)]
        info = gpu.info()
    events = [e for e in logs if e["event"] == "gpu.unavailable"]
    assert len(events) == 1
    assert events[0]["log_level"] == "info" and reason in events[0]["reason"]
    assert nvml.calls["nvmlInit"] == 1
    for s in samples:
        assert not s.available and reason in (s.reason or "") and s.devices == ()
        assert set(s.as_readings().values()) == {None}
    assert not info.available and info.driver_version is None


def test_zero_devices_is_no_gpu() -> None:
    nvml = FakeNvml([])
    gpu = GpuCollector(nvml)
    with capture_logs() as logs:
        s = gpu.sample()
        gpu.sample()
    assert not s.available and "no GPU" in (s.reason or "")
    assert [e["event"] for e in logs] == ["gpu.unavailable"]
    assert nvml.calls["nvmlShutdown"] == 1


def test_pynvml_not_importable_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with capture_logs() as logs:
        s = GpuCollector().sample()
    assert not s.available and "pynvml not importable" in (s.reason or "")
    assert [e["event"] for e in logs] == ["gpu.unavailable"]


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has NVML")
def test_real_pynvml_on_a_machine_without_driver_is_no_gpu() -> None:
    gpu = GpuCollector()
    with capture_logs() as logs:
        first, second = gpu.sample(), gpu.sample()
    assert not first.available and not second.available
    assert first.reason == "NVML library not found (no driver)"
    assert len(logs) == 1


def test_other_nvml_errors_are_per_sample_and_logged_once() -> None:
    nvml = FakeNvml([FakeDevice()])
    nvml.failures["nvmlDeviceGetUtilizationRates"] = FakeNVMLError(GPU_IS_LOST)
    gpu = GpuCollector(nvml)
    with capture_logs() as logs:
        first, second = gpu.sample(), gpu.sample()
    for s in (first, second):
        d = s.devices[0]
        assert d.util_percent is None and "util_percent" not in d.unsupported
        assert d.errors == (("utilization", "NVML error 15"),)
        assert d.mem_total_bytes == 143771 * MIB
    failed = [e for e in logs if e["event"] == "gpu.query_failed"]
    assert len(failed) == 1 and failed[0]["log_level"] == "warning" and failed[0]["code"] == GPU_IS_LOST
    del nvml.failures["nvmlDeviceGetUtilizationRates"]
    assert gpu.sample().devices[0].util_percent == 90.0  # transient: asked again, and back


def test_unexpected_exception_never_escapes_sample() -> None:
    nvml = FakeNvml([FakeDevice()])
    gpu = GpuCollector(nvml)
    gpu.sample()
    nvml.failures["nvmlDeviceGetPowerUsage"] = RuntimeError("ctypes exploded")
    with capture_logs() as logs:
        s = gpu.sample()
    assert not s.available and "ctypes exploded" in (s.reason or "")
    assert [e["event"] for e in logs] == ["gpu.sample_failed"]
    del nvml.failures["nvmlDeviceGetPowerUsage"]
    assert gpu.sample().available


def test_functions_missing_from_an_old_binding_are_unsupported() -> None:
    fake = FakeNvml([FakeDevice()])
    hidden = {"nvmlDeviceGetPcieThroughput", "nvmlSystemGetCudaDriverVersion_v2"}
    # A module-like object without those two names, as an older nvidia-ml-py would be.
    nvml = SimpleNamespace(**{n: getattr(fake, n) for n in dir(fake) if n[0] != "_" and n not in hidden})
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 12080
    gpu = GpuCollector(nvml)
    d = gpu.sample().devices[0]
    assert d.pcie_tx_bytes_per_s is None and {"pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"} <= d.unsupported
    assert d.mem_total_bytes == 143771 * MIB
    assert gpu.info().cuda_driver_version == "12.8"


def test_driver_without_memory_v2_falls_back_to_v1() -> None:
    class OldDriver(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, h: FakeDevice, version: int | None = None) -> SimpleNamespace:
            if version is not None:
                raise FakeNVMLError(FUNCTION_NOT_FOUND)
            return super().nvmlDeviceGetMemoryInfo(h)

    d = GpuCollector(OldDriver([FakeDevice()])).sample().devices[0]
    assert d.mem_total_bytes == 143771 * MIB and not d.unified_memory


def test_read_pcie_false_skips_the_slow_counters() -> None:
    nvml = FakeNvml([FakeDevice()])
    d = GpuCollector(nvml, read_pcie=False).sample().devices[0]
    assert d.pcie_tx_bytes_per_s is None and "pcie_tx_bytes_per_s" not in d.unsupported
    assert nvml.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_two_gpus_sum_bytes_and_average_utilization() -> None:
    a = FakeDevice(util=(80, 10), processes=[(10, 100 * MIB)])
    b = FakeDevice(bus_id="00000000:00:07.0", util=(40, 10), power_mw=100_000, processes=[(11, 50 * MIB)])
    r = GpuCollector(FakeNvml([a, b])).sample([10, 11]).as_readings()
    assert r["gpu.mem_total_bytes"] == 2 * 143771.0 * MIB
    assert r["gpu.util_percent"] == 60.0
    assert r["gpu.power_watts"] == 302.0
    assert r["gpu.engine_mem_bytes"] == 150.0 * MIB


def test_process_with_unknown_memory_counts_nothing() -> None:
    d = GpuCollector(FakeNvml([FakeDevice(processes=[(1809, None)])])).sample([1809]).devices[0]
    assert d.engine_mem_bytes == 0 and d.processes is not None and d.processes[0].used_bytes is None


def test_close_shuts_nvml_down_and_later_samples_are_empty() -> None:
    nvml = FakeNvml([FakeDevice()])
    gpu = GpuCollector(nvml)
    assert gpu.sample().available
    gpu.close()
    assert nvml.calls["nvmlShutdown"] == 1
    s = gpu.sample()
    assert not s.available and s.reason == "closed"
