"""What the machine's memory looks like to vLLM: `MemoryFacts`, built from raw readings (pure).

The readings come from the I/O edge (`tunerd.observe.machine_facts`): /proc/meminfo, the NUMA node's
meminfo and cgroup limit (what vLLM's CPU backend reads, `utils/cpu_resource_utils.get_memory_node_info`),
and NVML. On unified memory (GB10, GH200) NVML answers NOT_SUPPORTED for memory and the host's meminfo
stands in (`utils/mem_utils.MemorySnapshot.measure` reads MemAvailable there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tunerd.engine.params import Backend

MemoryKind = Literal["discrete-gpu", "unified", "cpu"]

# vLLM's default `gpu_memory_utilization` (vllm 0.32 `CacheConfig`); the CPU backend uses it too.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92


@dataclass(frozen=True)
class MemoryFacts:
    """What the observers measured, in bytes (None: not measured / not supported).

    Measure with no vLLM of ours running, or put the memory our running vLLM holds (and will give back
    before the restart) into `own_engine_bytes`; it is added back to the free/available figures.

    - `gpu_total_bytes` / `gpu_free_bytes`: the device's total/free as CUDA reports them
      (`torch.cuda.mem_get_info`; NVML's total includes driver-reserved memory and reads ~0.6 GiB higher
      on an H200). On unified memory NVML answers NOT_SUPPORTED: leave them None and set `unified`.
    - `host_*`: /proc/meminfo (MemTotal, MemAvailable, page cache = Cached + Buffers − Shmem, swap).
    - `node_*`: the NUMA node the CPU backend binds to, as vLLM reads it (node meminfo: MemTotal, and
      available = MemFree + Active(file) + Inactive(file) + SReclaimable; both clamped to a cgroup limit).
    """

    gpu_total_bytes: int | None = None
    gpu_free_bytes: int | None = None
    unified: bool = False
    host_mem_total_bytes: int | None = None
    host_mem_available_bytes: int | None = None
    host_mem_free_bytes: int | None = None
    host_page_cache_bytes: int | None = None
    host_swap_total_bytes: int | None = None
    host_swap_free_bytes: int | None = None
    numa_node: int | None = None
    node_mem_total_bytes: int | None = None
    node_mem_available_bytes: int | None = None
    own_engine_bytes: int = 0


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo or a node's meminfo ("Node 0 MemTotal: N kB") → {key: bytes}."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "Node" and len(parts) >= 4:
            key, number, unit = parts[2].rstrip(":"), parts[3], parts[4] if len(parts) > 4 else ""
        elif len(parts) >= 2:
            key, number, unit = parts[0].rstrip(":"), parts[1], parts[2] if len(parts) > 2 else ""
        else:
            continue
        with contextlib.suppress(ValueError):
            values[key] = int(number) * (1024 if unit == "kB" else 1)
    return values


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
    cache = None
    if "Cached" in host:
        cache = max(0, host.get("Cached", 0) + host.get("Buffers", 0) - host.get("Shmem", 0))
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


def memory_kind(backend: Backend, facts: MemoryFacts) -> MemoryKind:
    """Which memory vLLM sizes against: the CPU node, a discrete GPU, or unified memory."""
    if backend == "cpu":
        return "cpu"
    return "unified" if facts.unified else "discrete-gpu"


def utilization_total(backend: Backend, facts: MemoryFacts) -> tuple[int | None, str]:
    """The total that `gpu_memory_utilization` multiplies, and where it came from."""
    if backend == "cpu":
        return (
            facts.node_mem_total_bytes,
            f"NUMA node {facts.numa_node if facts.numa_node is not None else 0} MemTotal",
        )
    if facts.gpu_total_bytes is not None:
        return facts.gpu_total_bytes, "GPU total (CUDA)"
    if facts.unified and facts.host_mem_total_bytes is not None:
        # On GB10 cudaMemGetInfo's total is the system memory; /proc/meminfo MemTotal stands in for it.
        return facts.host_mem_total_bytes, "host MemTotal (unified memory; NVML NOT_SUPPORTED)"
    return None, "unknown"
