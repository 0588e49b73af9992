"""What the sensors found about this machine, handed to the planner and the policy as plain values.

`MemoryFacts` (what vLLM would size against), `PreflightFacts` (what the operator's checks look at),
`MachineFacts` (both, plus the backend to plan for), `MemoryReading` (what the host-wedge guard reads
every half second) and `GpuFacts` (what the last poll saw of the GPU, for the next start's preflight).
Built by `tunerd.observe` (machine_facts, memory, the poll); read by `tunerd.planner` and `tunerd.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tunerd.core.params import Backend

MemoryKind = Literal["discrete-gpu", "unified", "cpu"]
BackendChoice = Literal["auto", "cpu", "cuda"]


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


@dataclass(frozen=True)
class PreflightFacts:
    """What the observers found before the first start. None: not measured."""

    backend: Backend
    unified: bool = False
    swap_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    driver_version: str | None = None
    cuda_version: str | None = None  # the driver's CUDA version (nvidia-smi "CUDA Version", NVML)
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    page_cache_bytes: int | None = None
    gpu_numa_node: int | None = None  # /sys/bus/pci/devices/<id>/numa_node; -1: not reported
    numa_nodes: int | None = None
    numactl_available: bool | None = None
    gpu_processes: tuple[tuple[int, str, int], ...] = ()  # (pid, name, bytes) of processes not ours


@dataclass(frozen=True)
class MachineFacts:
    """What `probe_machine` found: the backend to plan for, memory facts, preflight facts (the plan
    goes to the checks beside them), and notes for the operator about how the figures were obtained."""

    backend: Backend
    memory: MemoryFacts
    preflight: PreflightFacts
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """What the host says now. None = not known (no PSI on this kernel, unreadable file)."""

    mem_total_bytes: int | None
    mem_available_bytes: int | None
    psi_some_avg10: float | None
    psi_full_avg10: float | None


@dataclass(frozen=True)
class GpuFacts:
    """What the last poll saw of the GPU (fields None: no GPU, or NVML does not say)."""

    unified_memory: bool | None = None
    free_bytes: int | None = None
