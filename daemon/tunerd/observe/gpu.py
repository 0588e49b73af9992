"""GPU signals from NVML (`nvidia-ml-py`, module `pynvml`), with host fallbacks for unified memory.

- Discrete GPU (H200 …): memory, utilization, PCIe, power and per-process memory from NVML
  (`memory_source="nvml"`).
- Unified memory (DGX Spark / GB10): NVML answers NOT_SUPPORTED for memory and PCIe throughput
  (shared/docs/vllm-facts.md, "Unified memory"). The device is marked `unified_memory=True` and memory
  comes from the host (`memory_source="host"`): capacity `MemTotal`, free `MemAvailable`, used = total −
  available, engine use = RSS of the engine's processes. nvidia-ml-py 13.615 has no "is integrated"
  query (`nvmlDeviceGetAddressingMode` and `nvmlDeviceGetC2cModeInfoV` answer on GH200 too, whose HBM
  NVML does report), so NOT_SUPPORTED from the memory query is the signal.
- No GPU, driver or pynvml: `gpu.unavailable` is logged once, every `sample()` is empty and cheap.

NOT_SUPPORTED is a property of the device: the query's fields go into `unsupported`, are None (never 0),
and the query is not asked again. Other NVML errors are per sample: None, noted in `errors`, and a
`gpu.query_failed` warning once per device, query and code. Static facts are read once, at first use.
Over 400 lines: every NVML query and its failure modes in one place, so no other module touches pynvml.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import structlog

from tunerd.observe.host import HostSample, read_engine_usage, read_pci_numa_node
from tunerd.procfs.memory import read_meminfo

log = structlog.get_logger(__name__)

MemorySource = Literal["nvml", "host"]
_MISSING: Any = object()

# NVML query → the GpuDeviceSample fields it fills (names used in `unsupported`).
_QUERY_FIELDS: dict[str, tuple[str, ...]] = {
    "memory": ("mem_total_bytes", "mem_used_bytes", "mem_free_bytes"),
    "utilization": ("util_percent", "mem_bw_util_percent"),
    "pcie_tx": ("pcie_tx_bytes_per_s",),
    "pcie_rx": ("pcie_rx_bytes_per_s",),
    "power": ("power_watts",),
    "processes": ("processes", "engine_nvml_mem_bytes"),
    "name": ("name",),
    "uuid": ("uuid",),
    "pci": ("pci_bus_id", "numa_node"),
}


@dataclass(frozen=True)
class GpuProcess:
    """A process NVML lists as running compute work; `used_bytes` None where NVML can't tell."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuDeviceSample:
    """One device's figures. Bytes, bytes/s, percent, watts; None = not known.

    `unsupported` names the fields NVML can't provide on this device. Their value is None, except the
    `mem_*` fields on a unified-memory device, which the host fills in (`memory_source="host"`).
    `engine_mem_bytes` is the engine's GPU memory: the sum of NVML's per-process `usedGpuMemory` over
    the engine pids (`engine_nvml_mem_bytes`; it works on GB10 too), or on unified memory, where NVML
    lists none of them, the engine processes' RSS.
    Both are None when no engine pid was given. `processes` lists every compute process, so a caller can
    spot another program holding GPU memory.
    """

    index: int
    name: str | None
    uuid: str | None
    pci_bus_id: str | None
    numa_node: int | None
    unified_memory: bool
    memory_source: MemorySource
    mem_total_bytes: int | None
    mem_used_bytes: int | None
    mem_free_bytes: int | None
    util_percent: float | None
    mem_bw_util_percent: float | None
    pcie_tx_bytes_per_s: float | None
    pcie_rx_bytes_per_s: float | None
    power_watts: float | None
    engine_mem_bytes: int | None
    engine_nvml_mem_bytes: int | None
    processes: tuple[GpuProcess, ...] | None
    unsupported: frozenset[str]
    errors: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class GpuSample:
    """All devices at one moment (`taken_at`, monotonic seconds). `available=False` (with `reason`)
    means no usable NVML: then `devices` is empty."""

    available: bool
    reason: str | None
    taken_at: float
    devices: tuple[GpuDeviceSample, ...] = ()

    @property
    def unified_memory(self) -> bool:
        """True if any device shares the host's memory."""
        return any(d.unified_memory for d in self.devices)

    @property
    def unsupported(self) -> frozenset[str]:
        """Fields unsupported on at least one device."""
        return frozenset().union(*(d.unsupported for d in self.devices))

    def as_readings(self) -> dict[str, float | None]:
        """Flat view, combined over all devices: bytes, watts and throughput are summed, utilization is
        the mean. Host-sourced memory figures (unified memory) describe one shared pool and are counted
        once, not once per device. A key is None when any device lacks it, or when there is no GPU."""
        devs = self.devices
        util = _combine(devs, "util_percent", host_once=False)
        return {
            "gpu.mem_used_bytes": _combine(devs, "mem_used_bytes", host_once=True),
            "gpu.mem_total_bytes": _combine(devs, "mem_total_bytes", host_once=True),
            "gpu.util_percent": None if util is None else util / len(devs),
            "gpu.pcie_tx_bytes_per_s": _combine(devs, "pcie_tx_bytes_per_s", host_once=False),
            "gpu.pcie_rx_bytes_per_s": _combine(devs, "pcie_rx_bytes_per_s", host_once=False),
            "gpu.engine_mem_bytes": _combine(devs, "engine_mem_bytes", host_once=True),
            "gpu.power_watts": _combine(devs, "power_watts", host_once=False),
            "gpu.unified_memory": (1.0 if self.unified_memory else 0.0) if devs else None,
        }


def _combine(devs: tuple[GpuDeviceSample, ...], attr: str, *, host_once: bool) -> float | None:
    values = [getattr(d, attr) for d in devs]
    if not devs or None in values:
        return None
    if host_once:  # one shared host pool: count the first host-sourced device only
        host = [v for d, v in zip(devs, values, strict=True) if d.memory_source == "host"]
        values = [v for d, v in zip(devs, values, strict=True) if d.memory_source != "host"] + host[:1]
    return float(sum(values))


class _HostMemory(NamedTuple):
    """What a unified-memory device takes from the host: MemTotal, MemAvailable, the engine's RSS."""

    total: int | None
    available: int | None
    engine_rss: int | None


def _host_memory(host: HostSample) -> _HostMemory:
    engine_rss = host.engine.rss_bytes if host.engine is not None else None
    return _HostMemory(host.mem_total_bytes, host.mem_available_bytes, engine_rss)


@dataclass(frozen=True)
class GpuDeviceInfo:
    """Static facts about one device."""

    index: int
    name: str | None
    uuid: str | None
    pci_bus_id: str | None
    numa_node: int | None
    unified_memory: bool


@dataclass(frozen=True)
class GpuInfo:
    """What the journal records about the GPUs: versions and devices (`cuda_driver_version` like
    "13.0")."""

    available: bool
    reason: str | None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    devices: tuple[GpuDeviceInfo, ...] = ()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version(value: int) -> str:
    # NVML encodes CUDA 13.0 as 13000, 12.8 as 12080.
    return f"{value // 1000}.{(value % 1000) // 10}"


class _Device:
    """Mutable per-device state: handle, static facts, queries found unsupported."""

    def __init__(self, index: int, handle: Any) -> None:
        self.index, self.handle = index, handle
        self.name: str | None = None
        self.uuid: str | None = None
        self.pci_bus_id: str | None = None
        self.numa_node: int | None = None
        self.unsupported: set[str] = set()
        self.memory_v2 = True

    @property
    def unified(self) -> bool:
        return "memory" in self.unsupported

    def info(self) -> GpuDeviceInfo:
        return GpuDeviceInfo(self.index, self.name, self.uuid, self.pci_bus_id, self.numa_node, self.unified)


class GpuCollector:
    """Samples all GPUs through NVML. `nvml` is the pynvml module (or a fake with the same names);
    None imports `pynvml` at first use. `proc` feeds the unified-memory fallback, `sys` the NUMA lookup;
    `read_pcie=False` skips the PCIe counters: NVML samples each over 20 ms, so the two make a sample take
    ~42 ms on an H200 (0.02 ms without them).

    Construction touches nothing; NVML is initialised by the first `sample()` or `info()`. Not thread
    safe: one sampler owns it. `close()` shuts NVML down.
    """

    def __init__(
        self,
        nvml: Any = None,
        *,
        proc: str = "/proc",
        sys: str = "/sys",
        read_pcie: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self.proc, self.sys, self.read_pcie = proc, sys, read_pcie
        self._clock = clock
        self._state: Literal["new", "up", "down"] = "new"
        self._reason: str | None = None
        self._devices: list[_Device] = []
        self._info = GpuInfo(available=False, reason="not started")
        self._logged: set[tuple[Any, ...]] = set()
        self._errors: list[tuple[str, str]] = []  # the current device sample's query errors
        self._catch: tuple[type[BaseException], ...] = ()
        self._unsupported_codes: set[int] = set()

    # --- life cycle -------------------------------------------------------------------------------

    def _ensure_started(self) -> bool:
        if self._state == "new":
            try:
                self._start()
            except Exception as exc:  # anything NVML or ctypes throws: no GPU for this run
                self._go_down(f"NVML start failed: {exc!r}")
        return self._state == "up"

    def _go_down(self, reason: str, **fields: Any) -> None:
        if self._state == "up":
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._state, self._reason = "down", reason
        self._info = GpuInfo(available=False, reason=reason)
        log.info("gpu.unavailable", reason=reason, **fields)

    def _start(self) -> None:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                self._go_down(f"pynvml not importable: {exc}")
                return
            self._nvml = pynvml
        nvml = self._nvml
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        self._catch = (nvml.NVMLError, mismatch) if isinstance(mismatch, type) else (nvml.NVMLError,)
        # Codes that mean "this device or driver can't answer that query", now or later.
        unsupported = nvml.NVML_ERROR_NOT_SUPPORTED
        missing = getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", unsupported)
        self._unsupported_codes = {unsupported, missing}
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            reasons = {
                getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", -1): "NVML library not found (no driver)",
                getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", -1): "NVIDIA driver not loaded",
            }
            self._go_down(reasons.get(code, f"nvmlInit failed: {exc}"), code=code)
            return
        self._state = "up"
        count = nvml.nvmlDeviceGetCount()
        for index in range(count):
            try:
                self._devices.append(self._open_device(index))
            except nvml.NVMLError as exc:  # e.g. GPU_IS_LOST on one device: sample the others
                log.warning("gpu.query_failed", device=index, query="handle", error=str(exc))
        if not self._devices:
            self._go_down(f"no GPU: NVML reports {count} devices, none usable" if count else "no GPU")
            return
        driver = self._call(None, "driver_version", "nvmlSystemGetDriverVersion")
        cuda_fn = "nvmlSystemGetCudaDriverVersion_v2"
        cuda = self._call(None, "cuda_driver_version", cuda_fn if hasattr(nvml, cuda_fn) else cuda_fn[:-3])
        info = self._info = GpuInfo(
            available=True,
            reason=None,
            driver_version=None if driver is _MISSING else _text(driver),
            cuda_driver_version=None if cuda is _MISSING else _cuda_version(int(cuda)),
            devices=tuple(d.info() for d in self._devices),
        )
        log.info(
            "gpu.available",
            devices=len(info.devices),
            driver_version=info.driver_version,
            cuda_driver_version=info.cuda_driver_version,
            unified_memory=[d.unified_memory for d in info.devices],
        )

    def _open_device(self, index: int) -> _Device:
        dev = _Device(index, self._nvml.nvmlDeviceGetHandleByIndex(index))
        name = self._call(dev, "name", "nvmlDeviceGetName", dev.handle)
        uuid = self._call(dev, "uuid", "nvmlDeviceGetUUID", dev.handle)
        pci = self._call(dev, "pci", "nvmlDeviceGetPciInfo", dev.handle)
        dev.name = None if name is _MISSING else _text(name)
        dev.uuid = None if uuid is _MISSING else _text(uuid)
        if pci is not _MISSING:
            dev.pci_bus_id = _text(pci.busId)
            dev.numa_node = read_pci_numa_node(dev.pci_bus_id, self.sys)
        # Probe memory once, so that `info()` can say "unified" before the first sample.
        self._call(dev, "memory", self._memory_info, dev)
        return dev

    def close(self) -> None:
        """Shut NVML down (if it was started); later samples are empty with reason "closed"."""
        if self._state == "up":
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._state, self._reason = "down", "closed"
        self._info = GpuInfo(available=False, reason="closed")

    # --- queries ----------------------------------------------------------------------------------

    def _call(self, dev: _Device | None, query: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one NVML query (`fn`: a pynvml function name, or a callable). Return its result, or
        _MISSING if the query is (now known to be) unsupported on `dev` (NOT_SUPPORTED, or a function
        this binding or driver lacks) or NVML raised another error (added to `self._errors`, logged
        once per device, query and code)."""
        if dev is not None and query in dev.unsupported:
            return _MISSING
        if isinstance(fn, str):
            fn = getattr(self._nvml, fn, None)
            if fn is None:  # an older nvidia-ml-py without this function
                if dev is not None:
                    dev.unsupported.add(query)
                return _MISSING
        try:
            return fn(*args, **kwargs)
        except self._catch as exc:
            code = getattr(exc, "value", None)
            # NVMLLibraryMismatchError (no code): pynvml's unversioned call met a driver without it.
            if code is None or code in self._unsupported_codes:
                if dev is not None:
                    dev.unsupported.add(query)
                return _MISSING
            self._errors.append((query, str(exc)))
            index = None if dev is None else dev.index
            key = ("query", index, query, code)
            self._log_once(key, "gpu.query_failed", device=index, query=query, code=code, error=str(exc))
            return _MISSING

    def _memory_info(self, dev: _Device) -> Any:
        nvml = self._nvml
        if dev.memory_v2 and hasattr(nvml, "nvmlMemory_v2"):
            try:
                return nvml.nvmlDeviceGetMemoryInfo(dev.handle, version=nvml.nvmlMemory_v2)
            except nvml.NVMLError as exc:
                # Drivers before R510 lack nvmlDeviceGetMemoryInfo_v2: fall back to v1 for good.
                if getattr(exc, "value", None) != getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", -1):
                    raise
                dev.memory_v2 = False
        return nvml.nvmlDeviceGetMemoryInfo(dev.handle)

    def _log_once(self, key: tuple[Any, ...], event: str, **fields: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(event, **fields)

    # --- public -----------------------------------------------------------------------------------

    def info(self) -> GpuInfo:
        """Versions and static device facts, for the journal. Starts NVML if needed; never raises."""
        self._ensure_started()
        return self._info

    def sample(self, engine_pids: Iterable[int] = (), host: HostSample | None = None) -> GpuSample:
        """Sample every device; `engine_pids` are the engine's processes (host pid namespace, as NVML
        reports them). On unified memory the host's figures stand in for NVML's: taken from `host`, the
        same moment's host sample of the same pids, when the caller has one, else read here. Never
        raises: with no usable NVML it returns `available=False` at once."""
        taken_at = self._clock()
        try:
            if not self._ensure_started():
                return GpuSample(available=False, reason=self._reason, taken_at=taken_at)
            pids = frozenset(engine_pids)
            host_mem: _HostMemory | None = None
            if any(d.unified for d in self._devices):
                host_mem = _host_memory(host) if host is not None else self._read_host_memory(pids)
            devices = tuple(self._sample_device(d, pids, host_mem) for d in self._devices)
            return GpuSample(available=True, reason=None, taken_at=taken_at, devices=devices)
        except Exception as exc:  # the daemon must outlive any NVML surprise
            self._log_once(("sample", repr(exc)), "gpu.sample_failed", error=repr(exc))
            return GpuSample(available=False, reason=f"sample failed: {exc!r}", taken_at=taken_at)

    def _read_host_memory(self, pids: frozenset[int]) -> _HostMemory:
        total = available = None
        with contextlib.suppress(OSError):  # no /proc/meminfo: the mem_* fields stay None
            info = read_meminfo(self.proc)
            total, available = info.get("MemTotal"), info.get("MemAvailable")
        engine = read_engine_usage(pids, self.proc)
        return _HostMemory(total, available, engine.rss_bytes if engine is not None else None)

    def _sample_device(
        self, dev: _Device, pids: frozenset[int], host_mem: _HostMemory | None
    ) -> GpuDeviceSample:
        self._errors = []
        h, nvml = dev.handle, self._nvml
        mem = self._call(dev, "memory", self._memory_info, dev)
        util = self._call(dev, "utilization", "nvmlDeviceGetUtilizationRates", h)
        tx = rx = _MISSING
        if self.read_pcie:
            tx_counter = getattr(nvml, "NVML_PCIE_UTIL_TX_BYTES", 0)
            rx_counter = getattr(nvml, "NVML_PCIE_UTIL_RX_BYTES", 1)
            tx = self._call(dev, "pcie_tx", "nvmlDeviceGetPcieThroughput", h, tx_counter)
            rx = self._call(dev, "pcie_rx", "nvmlDeviceGetPcieThroughput", h, rx_counter)
        power = self._call(dev, "power", "nvmlDeviceGetPowerUsage", h)
        procs = self._call(dev, "processes", "nvmlDeviceGetComputeRunningProcesses", h)

        processes: tuple[GpuProcess, ...] | None = None
        engine_nvml: int | None = None
        listed = False  # NVML lists at least one engine process
        if procs is not _MISSING:
            processes = tuple(GpuProcess(int(p.pid), p.usedGpuMemory) for p in procs)
            if pids:
                ours = [p.used_bytes or 0 for p in processes if p.pid in pids]
                engine_nvml, listed = sum(ours), bool(ours)

        total = used = free = None
        engine_mem = engine_nvml
        if dev.unified:
            if host_mem is not None and host_mem.total is not None and host_mem.available is not None:
                total, free = host_mem.total, host_mem.available
                used = total - free
            # NVML's per-process memory works on GB10 (vllm-facts.md) and counts what the driver takes
            # from RAM outside the processes' RSS; RSS is the fallback where NVML lists none of them
            # (before the engine touches the GPU, or pids from another namespace).
            if not listed and pids:
                engine_mem = host_mem.engine_rss if host_mem is not None else None
        elif mem is not _MISSING:
            total, used, free = int(mem.total), int(mem.used), int(mem.free)

        unsupported = {f for q in dev.unsupported for f in _QUERY_FIELDS.get(q, (q,))}
        if not dev.unified and "processes" in dev.unsupported:
            unsupported.add("engine_mem_bytes")
        return GpuDeviceSample(
            index=dev.index,
            name=dev.name,
            uuid=dev.uuid,
            pci_bus_id=dev.pci_bus_id,
            numa_node=dev.numa_node,
            unified_memory=dev.unified,
            memory_source="host" if dev.unified else "nvml",
            mem_total_bytes=total,
            mem_used_bytes=used,
            mem_free_bytes=free,
            util_percent=None if util is _MISSING else float(util.gpu),
            mem_bw_util_percent=None if util is _MISSING else float(util.memory),
            # NVML reports KB/s; its KB is taken as 1024 bytes, like its memory figures.
            pcie_tx_bytes_per_s=None if tx is _MISSING else float(tx) * 1024,
            pcie_rx_bytes_per_s=None if rx is _MISSING else float(rx) * 1024,
            power_watts=None if power is _MISSING else power / 1000.0,  # NVML: milliwatts
            engine_mem_bytes=engine_mem,
            engine_nvml_mem_bytes=engine_nvml,
            processes=processes,
            unsupported=frozenset(unsupported),
            errors=tuple(self._errors),
        )
