"""This machine's memory and preflight facts for the planner, read from the files vLLM reads and NVML
(what `tunerd.planner` plans against, as `core.machine` value types).

- Host: /proc/meminfo (MemTotal, MemAvailable, page cache, swap).
- CPU backend: the NUMA node of the first CPU this process may run on, its node meminfo and the cgroup
  memory limit — what vLLM's `get_memory_node_info` reads.
- GPU: NVML through `GpuCollector` (device 0, the one a single-GPU vLLM uses). NVML's total includes
  driver-reserved memory (~0.6 GiB more than CUDA reports on an H200); a calibration measured with the same
  figure cancels that out. On unified memory (GB10) NVML answers NOT_SUPPORTED for memory: the budget then
  comes from the host's meminfo (`build_memory_facts(..., gpu_memory_supported=False)`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tunerd.core.machine import BackendChoice, MachineFacts, MemoryFacts, PreflightFacts
from tunerd.core.params import Backend
from tunerd.observe.gpu import GpuCollector, GpuDeviceSample
from tunerd.procfs.memory import page_cache_bytes, parse_meminfo


def node_memory(
    node_meminfo: Mapping[str, int], cgroup_limit: int | None = None, cgroup_usage: int | None = None
) -> tuple[int, int]:
    """(total, available) of a NUMA node exactly as vLLM's `get_memory_node_info` computes them:
    available = MemFree + Active(file) + Inactive(file) + SReclaimable; a cgroup limit below the node's
    total replaces the total and caps available at limit − usage."""
    total = node_meminfo["MemTotal"]
    available = (
        node_meminfo["MemFree"]
        + node_meminfo["Active(file)"]
        + node_meminfo["Inactive(file)"]
        + node_meminfo["SReclaimable"]
    )
    if cgroup_limit is not None and cgroup_limit < total:
        total = cgroup_limit
        available = max(0, min(available, cgroup_limit - (cgroup_usage or 0)))
    return total, available


def build_memory_facts(
    proc_meminfo: str,
    *,
    gpu_total_bytes: int | None = None,
    gpu_free_bytes: int | None = None,
    gpu_present: bool = False,
    gpu_memory_supported: bool = True,
    node_meminfo: str | None = None,
    numa_node: int | None = None,
    cgroup_limit: int | None = None,
    cgroup_usage: int | None = None,
    own_engine_bytes: int = 0,
) -> MemoryFacts:
    """Assemble `MemoryFacts` from raw readings (pure). A GPU whose memory query answered NOT_SUPPORTED
    (`gpu_present and not gpu_memory_supported`) is unified memory: the budget then comes from the host.
    Page cache = Cached + Buffers − Shmem (shared memory cannot be dropped)."""
    host = parse_meminfo(proc_meminfo)
    unified = gpu_present and not gpu_memory_supported
    cache = page_cache_bytes(host)
    node_total = node_available = None
    if node_meminfo is not None:
        node_total, node_available = node_memory(parse_meminfo(node_meminfo), cgroup_limit, cgroup_usage)
    elif "MemTotal" in host:
        # vLLM's fallback without per-node meminfo: psutil's total/available (MemTotal/MemAvailable).
        node_total, node_available = host["MemTotal"], host.get("MemAvailable", host.get("MemFree", 0))
    return MemoryFacts(
        gpu_total_bytes=None if unified else gpu_total_bytes,
        gpu_free_bytes=None if unified else gpu_free_bytes,
        unified=unified,
        host_mem_total_bytes=host.get("MemTotal"),
        host_mem_available_bytes=host.get("MemAvailable"),
        host_mem_free_bytes=host.get("MemFree"),
        host_page_cache_bytes=cache,
        host_swap_total_bytes=host.get("SwapTotal"),
        host_swap_free_bytes=host.get("SwapFree"),
        numa_node=numa_node,
        node_mem_total_bytes=node_total,
        node_mem_available_bytes=node_available,
        own_engine_bytes=own_engine_bytes,
    )


def _read_int(path: Path) -> int | None:
    try:
        value = path.read_text().strip()
    except OSError:
        return None
    if not value or value == "max":
        return None
    try:
        return int(value)
    except ValueError:
        return None


def _cgroup_limit_and_usage(sys: str = "/sys") -> tuple[int | None, int | None]:
    """vLLM `get_cgroup_memory_limit` / `get_cgroup_memory_usage` (cgroup v2, then v1)."""
    cgroup = Path(sys) / "fs" / "cgroup"
    limit = _read_int(cgroup / "memory.max")
    if limit is not None:
        return limit, _read_int(cgroup / "memory.current")
    limit = _read_int(cgroup / "memory" / "memory.limit_in_bytes")
    if limit is not None and limit < (1 << 62):
        return limit, _read_int(cgroup / "memory" / "memory.usage_in_bytes")
    return None, None


def _numa_node_of_first_allowed_cpu(sys: str = "/sys") -> int:
    """The NUMA node of the first CPU this process may run on (vLLM's CPU worker uses that node)."""
    cpus = sorted(os.sched_getaffinity(0))
    if cpus:
        base = Path(sys) / "devices" / "system" / "cpu" / f"cpu{cpus[0]}"
        with contextlib.suppress(OSError):
            for entry in base.iterdir():
                if entry.name.startswith("node") and entry.name[4:].isdigit():
                    return int(entry.name[4:])
    return 0


def _numa_node_count(sys: str = "/sys") -> int | None:
    try:
        nodes = [p for p in (Path(sys) / "devices" / "system" / "node").iterdir() if p.name[4:].isdigit()]
    except OSError:
        return None
    return len(nodes) or None


@dataclass(frozen=True)
class _HostReadings:
    proc_meminfo: str
    node_meminfo: str | None
    numa_node: int
    cgroup_limit: int | None
    cgroup_usage: int | None


def _read_host(node: int | None, proc: str, sys: str) -> _HostReadings:
    """The raw host readings `build_memory_facts` takes: /proc/meminfo, the node's meminfo, the cgroup."""
    numa = _numa_node_of_first_allowed_cpu(sys) if node is None else node
    node_path = Path(sys) / "devices" / "system" / "node" / f"node{numa}" / "meminfo"
    limit, usage = _cgroup_limit_and_usage(sys)
    return _HostReadings(
        proc_meminfo=(Path(proc) / "meminfo").read_text(),
        node_meminfo=node_path.read_text() if node_path.exists() else None,
        numa_node=numa,
        cgroup_limit=limit,
        cgroup_usage=usage,
    )


def _memory_facts(
    host: _HostReadings, device: GpuDeviceSample | None = None, own_engine_bytes: int = 0
) -> MemoryFacts:
    return build_memory_facts(
        host.proc_meminfo,
        gpu_total_bytes=cuda_visible_total(device),
        gpu_free_bytes=device.mem_free_bytes if device else None,
        gpu_present=device is not None,
        gpu_memory_supported=not (device and device.unified_memory),
        node_meminfo=host.node_meminfo,
        numa_node=host.numa_node,
        cgroup_limit=host.cgroup_limit,
        cgroup_usage=host.cgroup_usage,
        own_engine_bytes=own_engine_bytes,
    )


def cuda_visible_total(device: GpuDeviceSample | None) -> int | None:
    """The device memory CUDA reports as total, which `gpu_memory_utilization` multiplies.

    NVML's v2 total includes memory the driver reserves; its `used + free` leaves that out and equals
    what CUDA sees (H200: 143,771 MiB total, 143,156 MiB used + free, and vLLM's "139.8 GiB"). With it,
    one calibration start predicts another utilization's KV-cache tokens exactly
    (tests/fixtures/vllm-0.24.0-h200-tunerd: 633,200 tokens at 0.5 → 764,080 at 0.6).
    """
    if device is None:
        return None
    if device.mem_used_bytes is not None and device.mem_free_bytes is not None:
        return device.mem_used_bytes + device.mem_free_bytes
    return device.mem_total_bytes


def read_cpu_node_memory(
    node: int | None = None, own_engine_bytes: int = 0, *, proc: str = "/proc", sys: str = "/sys"
) -> MemoryFacts:
    """Host memory facts for the CPU backend, read from the files vLLM reads (no GPU). Raises OSError if
    /proc/meminfo can't be read."""
    return _memory_facts(_read_host(node, proc, sys), own_engine_bytes=own_engine_bytes)


def _process_name(pid: int, proc: str) -> str:
    try:
        return (Path(proc) / str(pid) / "comm").read_text().strip() or "?"
    except OSError:
        return "?"


def probe_machine(
    backend: BackendChoice = "auto",
    *,
    gpu: GpuCollector | None = None,
    own_engine_bytes: int = 0,
    proc: str = "/proc",
    sys: str = "/sys",
) -> MachineFacts:
    """Read this machine's memory and preflight facts. `backend` auto: cuda when NVML finds a GPU, else
    cpu. `gpu`: a collector to reuse (default: a new one, closed afterwards). `own_engine_bytes`: memory
    our running vLLM holds and would give back before a restart. Raises OSError if /proc/meminfo can't
    be read; NVML problems only leave the GPU figures out (and say so in `notes`)."""
    collector = gpu or GpuCollector(read_pcie=False, proc=proc, sys=sys)
    try:
        sample = collector.sample()
        info = collector.info()
    finally:
        if gpu is None:
            collector.close()
    device: GpuDeviceSample | None = sample.devices[0] if sample.available and sample.devices else None
    chosen: Backend = ("cuda" if device is not None else "cpu") if backend == "auto" else backend
    notes: list[str] = []
    if chosen == "cuda" and device is None:
        notes.append(f"no GPU found by NVML ({sample.reason}): GPU memory unknown")
    elif chosen == "cuda" and device is not None and len(sample.devices) > 1:
        notes.append(f"{len(sample.devices)} GPUs: planning for device 0")
    memory = _memory_facts(_read_host(None, proc, sys), device, own_engine_bytes)
    swap_used = None
    if memory.host_swap_total_bytes is not None and memory.host_swap_free_bytes is not None:
        swap_used = memory.host_swap_total_bytes - memory.host_swap_free_bytes
    others = tuple(
        (p.pid, _process_name(p.pid, proc), p.used_bytes or 0)
        for p in (device.processes or () if device else ())
        if p.pid != os.getpid()
    )
    preflight = PreflightFacts(
        backend=chosen,
        unified=memory.unified,
        swap_total_bytes=memory.host_swap_total_bytes,
        swap_used_bytes=swap_used,
        driver_version=info.driver_version,
        cuda_version=info.cuda_driver_version,
        mem_total_bytes=memory.host_mem_total_bytes,
        mem_available_bytes=memory.host_mem_available_bytes,
        page_cache_bytes=memory.host_page_cache_bytes,
        gpu_numa_node=device.numa_node if device else None,
        numa_nodes=_numa_node_count(sys),
        numactl_available=shutil.which("numactl") is not None,
        gpu_processes=others,
    )
    return MachineFacts(backend=chosen, memory=memory, preflight=preflight, notes=tuple(notes))
