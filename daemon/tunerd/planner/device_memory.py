"""Which memory vLLM sizes against on this machine, and what `gpu_memory_utilization` multiplies (pure).

vLLM's CPU backend sizes against its NUMA node (`utils/cpu_resource_utils.get_memory_node_info`), a
discrete GPU against CUDA's total, and on unified memory (GB10, GH200), where NVML answers NOT_SUPPORTED,
against the host's memory (`utils/mem_utils.MemorySnapshot.measure` reads MemAvailable there).
"""

from __future__ import annotations

from tunerd.core.machine import MemoryFacts, MemoryKind
from tunerd.core.params import Backend

# vLLM's default `gpu_memory_utilization` up to 0.33 (`CacheConfig`); the CPU backend uses it too. Per
# version (0.34 on GPUs: 1.0): `core.params.vllm_defaults`, which the planner reads.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92


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
