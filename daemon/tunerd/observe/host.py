"""Host memory signals from procfs: capacity, page cache, swap, page faults, PSI, and the engine's share.

On a DGX Spark / GB10 CPU and GPU share one memory, NVML reports no memory figures, and the signals that
exist everywhere are the host's: `/proc/meminfo`, the `/proc/vmstat` fault and swap counters,
`/proc/pressure/memory`, and per-process minflt/majflt and RSS (shared/docs/vllm-facts.md, "Unified
memory"). The same readers serve discrete-GPU hosts, where they show host RAM pressure from the API
server, tokenizers and CPU offload.

A sample reads `meminfo`, `vmstat` and `pressure/memory` once each, plus `stat` (faults) and `statm`
(RSS) of each engine pid, with the one reader of each file in `tunerd.procfs`. psutil is not used: its
procfs root is a module global (`psutil.PROCFS_PATH`), not a per-collector parameter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tunerd.procfs.memory import (
    MemoryPressure,
    page_cache_bytes,
    read_meminfo,
    read_memory_pressure,
    read_vmstat,
)
from tunerd.procfs.processes import PAGE_SIZE, read_rss_bytes, read_stat

__all__ = [
    "EngineUsage",
    "HostCollector",
    "HostSample",
    "pci_sysfs_name",
    "read_engine_usage",
    "read_pci_numa_node",
]


def pci_sysfs_name(bus_id: str) -> str | None:
    """NVML's PCI bus id ("00000000:00:06.0", GB10's "0000000F:01:00.0") → the sysfs device name
    ("0000:00:06.0", "000f:01:00.0"); None if it isn't one."""
    domain, sep, rest = bus_id.strip().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest.lower()}" if sep and rest else None
    except ValueError:
        return None


def read_pci_numa_node(bus_id: str, sys: str = "/sys") -> int | None:
    """The NUMA node of a PCI device, from `<sys>/bus/pci/devices/<id>/numa_node`; None if the file is
    absent or unreadable, or says -1 (no NUMA affinity)."""
    name = pci_sysfs_name(bus_id)
    if name is None:
        return None
    try:
        with open(f"{sys}/bus/pci/devices/{name}/numa_node", encoding="ascii", errors="replace") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


@dataclass(frozen=True)
class EngineUsage:
    """Summed over the engine processes that could be read (`pids`): cumulative minor and major page
    faults and resident memory.

    The sums are over a set that changes when a process exits or starts, so a rate computed from two
    samples is only valid when `pids` are equal in both. RSS counts pages shared between the processes
    (shared memory, shared libraries) once per process, so it is an upper bound of their footprint.
    """

    pids: tuple[int, ...]
    minflt_total: int
    majflt_total: int
    rss_bytes: int
    faults_by_pid: tuple[tuple[int, int, int], ...] = ()  # (pid, minflt, majflt) for each pid read


def read_engine_usage(
    pids: Iterable[int], proc: str = "/proc", page_size: int = PAGE_SIZE
) -> EngineUsage | None:
    """Read `stat` and `statm` of each pid and sum faults and RSS; skip pids that vanished.

    Returns None if no pid was given or none could be read (the engine is not running). A zombie counts
    its faults and zero RSS. `page_size` converts `statm` pages to bytes.
    """
    faults: list[tuple[int, int, int]] = []
    rss = 0
    for pid in dict.fromkeys(pids):  # keeps order, drops duplicates
        stat = read_stat(pid, proc)
        if stat is None:  # vanished (ENOENT, ESRCH), not ours to read (EACCES) or malformed: skip it
            continue
        faults.append((pid, stat.minflt, stat.majflt))
        rss += read_rss_bytes(pid, proc, page_size) or 0
    if not faults:
        return None
    return EngineUsage(
        pids=tuple(pid for pid, _, _ in faults),
        minflt_total=sum(minor for _, minor, _ in faults),
        majflt_total=sum(major for _, _, major in faults),
        rss_bytes=rss,
        faults_by_pid=tuple(faults),
    )


@dataclass(frozen=True)
class HostSample:
    """One host sample. Sizes in bytes; `*_total` are cumulative kernel counters since boot (the
    caller turns two samples into rates with `taken_at`, a monotonic time in seconds). A field is None
    when the kernel does not provide it; None never means 0.

    `page_cache_bytes` is `procfs.memory.page_cache_bytes`, `Buffers + Cached − Shmem`: the file-backed
    page cache that dropping caches could release. Shmem (tmpfs, /dev/shm, which vLLM uses for IPC) sits
    inside `Cached` but can't be dropped, so it is taken out and kept apart in `shmem_bytes`.
    SReclaimable slab is not included.
    """

    taken_at: float
    mem_total_bytes: int | None
    mem_available_bytes: int | None
    mem_free_bytes: int | None
    page_cache_bytes: int | None
    shmem_bytes: int | None
    swap_total_bytes: int | None
    swap_used_bytes: int | None
    swap_in_pages_total: int | None
    swap_out_pages_total: int | None
    pgfault_total: int | None
    pgmajfault_total: int | None
    pressure: MemoryPressure | None
    engine: EngineUsage | None

    def as_readings(self) -> dict[str, float | None]:
        """Flat view for metrics and rules: exactly the keys below, None where unknown."""
        psi, eng = self.pressure, self.engine
        full = psi.full if psi is not None else None
        return {
            "host.mem_total_bytes": _f(self.mem_total_bytes),
            "host.mem_available_bytes": _f(self.mem_available_bytes),
            "host.mem_free_bytes": _f(self.mem_free_bytes),
            "host.swap_total_bytes": _f(self.swap_total_bytes),
            "host.swap_used_bytes": _f(self.swap_used_bytes),
            "host.swap_in_pages_total": _f(self.swap_in_pages_total),
            "host.swap_out_pages_total": _f(self.swap_out_pages_total),
            "host.pgfault_total": _f(self.pgfault_total),
            "host.pgmajfault_total": _f(self.pgmajfault_total),
            "host.psi_some_avg10": psi.some.avg10 if psi is not None else None,
            "host.psi_full_avg10": full.avg10 if full is not None else None,
            "host.psi_some_total_us": float(psi.some.total_us) if psi is not None else None,
            "host.psi_full_total_us": float(full.total_us) if full is not None else None,
            "host.page_cache_bytes": _f(self.page_cache_bytes),
            "engine.minflt_total": float(eng.minflt_total) if eng is not None else None,
            "engine.majflt_total": float(eng.majflt_total) if eng is not None else None,
            "engine.rss_bytes": float(eng.rss_bytes) if eng is not None else None,
        }


def _f(value: int | None) -> float | None:
    return None if value is None else float(value)


def _diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


class HostCollector:
    """Takes `HostSample`s from a procfs tree (`proc`, default "/proc"). `clock` stamps `taken_at`
    (monotonic seconds; tests pass a fake); `page_size` converts `statm` pages to bytes. Holds nothing
    open between samples.
    """

    def __init__(
        self,
        proc: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
        page_size: int = PAGE_SIZE,
    ) -> None:
        self.proc = proc
        self.page_size = page_size
        self._clock = clock

    def sample(self, engine_pids: Iterable[int] = ()) -> HostSample:
        """Read one sample; `engine_pids` are the engine's processes (see procfs.pids_in_group).

        Raises OSError only if `<proc>/meminfo` can't be read (procfs not mounted). A missing or
        unreadable vmstat or PSI file gives None fields; vanished engine pids are skipped.
        """
        taken_at = self._clock()
        mem = read_meminfo(self.proc)
        try:
            vm = read_vmstat(self.proc)
        except OSError:
            vm = {}
        return HostSample(
            taken_at=taken_at,
            mem_total_bytes=mem.get("MemTotal"),
            mem_available_bytes=mem.get("MemAvailable"),
            mem_free_bytes=mem.get("MemFree"),
            page_cache_bytes=page_cache_bytes(mem),
            shmem_bytes=mem.get("Shmem"),
            swap_total_bytes=mem.get("SwapTotal"),
            swap_used_bytes=_diff(mem.get("SwapTotal"), mem.get("SwapFree")),
            swap_in_pages_total=vm.get("pswpin"),
            swap_out_pages_total=vm.get("pswpout"),
            pgfault_total=vm.get("pgfault"),
            pgmajfault_total=vm.get("pgmajfault"),
            pressure=read_memory_pressure(self.proc),
            engine=read_engine_usage(engine_pids, self.proc, self.page_size),
        )
