"""The checks an operator runs before the first start, each with a verdict and a remedy (pure over facts).

`preflight_checks(PreflightFacts(...), plan)` returns one `CheckResult` per check that applies: swap, CUDA
driver, free memory against the plan, page cache (unified memory), NUMA binding and other processes
holding GPU memory. The facts are gathered at the edge (`tunerd.observe.machine_facts.probe_machine`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tunerd.core.machine import PreflightFacts
from tunerd.core.units import GiB, gib_text
from tunerd.planner.plan import PlanVerdict

Verdict = Literal["ok", "warn", "fail"]

# vLLM's CUDA wheels need a driver that supports CUDA 12.1 or later.
MIN_CUDA = (12, 1)


@dataclass(frozen=True)
class CheckResult:
    """One preflight line: name, verdict (ok | warn | fail), what was found, what to do."""

    name: str
    verdict: Verdict
    detail: str
    remedy: str = ""


def preflight_checks(facts: PreflightFacts, plan: PlanVerdict | None = None) -> list[CheckResult]:
    """The checks that apply to `facts` (CUDA, NUMA and GPU-process checks only on the cuda backend, the
    page-cache check only on unified memory), in a fixed order: swap, cuda, memory, page-cache, numa,
    gpu-processes."""
    checks: list[Callable[[PreflightFacts, PlanVerdict | None], CheckResult | None]] = [
        _swap_check,
        _cuda_check,
        _memory_check,
        _page_cache_check,
        _numa_check,
        _gpu_processes_check,
    ]
    return [result for check in checks if (result := check(facts, plan)) is not None]


def _version_tuple(text: str) -> tuple[int, ...] | None:
    m = re.match(r"\s*(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return (int(m.group(1)), int(m.group(2) or 0))


def _swap_check(facts: PreflightFacts, plan: PlanVerdict | None) -> CheckResult:
    if facts.swap_total_bytes is None:
        return CheckResult("swap", "warn", "swap state not measured", "check `swapon --show`")
    if facts.swap_total_bytes == 0:
        return CheckResult("swap", "ok", "no swap configured")
    if facts.unified:
        return CheckResult(
            "swap",
            "warn",
            f"swap enabled ({gib_text(facts.swap_total_bytes)}, {gib_text(facts.swap_used_bytes or 0)} used) "
            "on unified memory: under pressure GPU-visible pages get swapped and the box stalls instead of "
            "failing fast",
            "swapoff -a (and remove the swap entry from /etc/fstab)",
        )
    used = facts.swap_used_bytes or 0
    return CheckResult(
        "swap",
        "warn" if used > GiB else "ok",
        f"swap {gib_text(facts.swap_total_bytes)}, {gib_text(used)} used",
        "find what is swapping before starting vLLM" if used > GiB else "",
    )


def _cuda_check(facts: PreflightFacts, plan: PlanVerdict | None) -> CheckResult | None:
    if facts.backend != "cuda":
        return None
    cuda = _version_tuple(facts.cuda_version) if facts.cuda_version else None
    if cuda is None:
        return CheckResult(
            "cuda",
            "fail",
            f"CUDA driver version unknown (driver {facts.driver_version or 'not found'})",
            "install the NVIDIA driver (nvidia-smi must work)",
        )
    if cuda < MIN_CUDA:
        return CheckResult(
            "cuda",
            "fail",
            f"driver {facts.driver_version} supports CUDA {facts.cuda_version} < 12.1",
            "upgrade the NVIDIA driver to one supporting CUDA ≥ 12.1",
        )
    return CheckResult("cuda", "ok", f"driver {facts.driver_version}, CUDA {facts.cuda_version}")


def _memory_check(facts: PreflightFacts, plan: PlanVerdict | None) -> CheckResult:
    if plan is None:
        return CheckResult("memory", "warn", "no plan to compare free memory with", "run `tunerd plan`")
    refusals = plan.budget.start_refusals
    if refusals or plan.band in ("refuse", "never"):
        return CheckResult(
            "memory",
            "fail",
            refusals[0] if refusals else f"oversubscription {_ratio_text(plan)} ({plan.band})",
            _memory_remedy(plan),
        )
    if plan.band == "caution":
        return CheckResult(
            "memory", "warn", f"oversubscription {_ratio_text(plan)} (caution)", _memory_remedy(plan)
        )
    return CheckResult(
        "memory",
        "ok",
        f"plan needs ratio {_ratio_text(plan)} of {gib_text(plan.budget.physical_bytes)} available",
    )


def _page_cache_check(facts: PreflightFacts, plan: PlanVerdict | None) -> CheckResult | None:
    if not facts.unified:
        return None
    cache = facts.page_cache_bytes
    threshold = max(GiB, int(0.05 * (facts.mem_total_bytes or 0)))
    if cache is None:
        return CheckResult("page-cache", "warn", "page cache not measured", "")
    if cache >= threshold:
        return CheckResult(
            "page-cache",
            "warn",
            f"page cache {gib_text(cache)} (e.g. a previous model load); some vLLM versions count it as "
            "used on unified memory and size the KV cache down",
            "sync; echo 3 > /proc/sys/vm/drop_caches",
        )
    return CheckResult("page-cache", "ok", f"page cache {gib_text(cache)}")


def _numa_check(facts: PreflightFacts, plan: PlanVerdict | None) -> CheckResult | None:
    if facts.backend != "cuda":
        return None
    node = facts.gpu_numa_node
    if node is None or node < 0 or (facts.numa_nodes or 1) <= 1:
        return CheckResult("numa", "ok", "single NUMA node (or not reported): nothing to bind")
    if facts.numactl_available:
        return CheckResult(
            "numa",
            "ok",
            f"GPU on NUMA node {node} of {facts.numa_nodes}; numactl available",
            f"start vLLM under `numactl --cpunodebind={node} --membind={node}`",
        )
    return CheckResult(
        "numa",
        "warn",
        f"GPU on NUMA node {node} of {facts.numa_nodes}, numactl not installed: host memory may land on "
        "the far node",
        f"install numactl and bind with `numactl --cpunodebind={node} --membind={node}`",
    )


def _gpu_processes_check(facts: PreflightFacts, plan: PlanVerdict | None) -> CheckResult | None:
    if facts.backend != "cuda":
        return None
    if not facts.gpu_processes:
        return CheckResult("gpu-processes", "ok", "no other process holds GPU memory")
    held = sum(b for _, _, b in facts.gpu_processes)
    who = ", ".join(f"{name} (pid {pid}, {gib_text(b)})" for pid, name, b in facts.gpu_processes[:5])
    blocking = bool(plan and plan.budget.start_refusals)
    return CheckResult(
        "gpu-processes",
        "fail" if blocking else "warn",
        f"{len(facts.gpu_processes)} other process(es) hold {gib_text(held)} of GPU memory: {who}",
        "stop them (a leftover VLLM::EngineCore is the usual one) or lower gpu_memory_utilization",
    )


def _ratio_text(plan: PlanVerdict) -> str:
    # No ratio when the physical memory was not measured (band caution) or is 0 (band never).
    return "?" if plan.ratio is None else f"{plan.ratio:.2f}"


def _memory_remedy(plan: PlanVerdict) -> str:
    if plan.suggested is not None and plan.suggested != plan.params:
        return "try: " + " ".join(plan.suggested.to_argv())
    return "lower gpu_memory_utilization / max_model_len, or free memory"
