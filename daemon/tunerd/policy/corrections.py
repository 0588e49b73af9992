"""Start-up fallbacks (pure): what a classified start-up failure says would fit, as one corrected start.

- KV cache too small: vLLM's own estimate ("the estimated maximum model length is N") → max_model_len N;
  the same when the planner refused the start predicting that refusal (no doomed start is made).
- Not enough free GPU memory at start ("Free memory on device cuda:0 (9.24/139.8 GiB) on startup is less
  than desired GPU memory utilization (0.92, …)", fixture second_server_b.log): the share that is free.
- Out of memory while loading: a smaller gpu_memory_utilization by a step, then a shorter max_model_len.
- vLLM's CPU backend with a share too small for the worker itself ("requested memory for kv
  (-0.08/0.6 GiB)"): the cure is a larger share, never a smaller one.
- An unrecognized argument (argparse, exit 2: "unrecognized arguments: --swap-space 4"): drop that flag.
Each correction is one start; the crash-loop breaker still counts it as a failure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.params import TUNABLE_PARAMS, Backend, EngineParams, vllm_defaults
from tunerd.core.report import StartReport

UTILIZATION_STEP = 0.05
MIN_UTILIZATION = 0.05
MAX_CPU_UTILIZATION = 0.95  # the CPU worker's share of its NUMA node; the rest is the system's
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)$")
_BAD_VALUE = re.compile(r"error: argument (--[\w-]+)")
# Flags tunerd adds on its own where `--help` listed them (engine/launch.py): when vLLM refuses one's
# value at parsing ("error: argument --custom-histogram-buckets: invalid loads value"), the start goes on
# without it. An operator's own flags (extra_args) are never dropped for a bad value.
OPTIONAL_FLAGS = ("--custom-histogram-buckets", "--enable-per-request-metrics")
_NEGATIVE_KV = re.compile(r"requested memory for kv \(-")


@dataclass(frozen=True)
class Correction:
    """A corrected start: the parameters, why, and flags to leave out of the command line from now on."""

    params: EngineParams
    reason: str
    drop_flags: tuple[str, ...] = ()


def correction(
    failure: EngineFailure, params: EngineParams, report: StartReport | None, backend: Backend
) -> Correction | None:
    """The one corrected start `failure` calls for, or None when retrying the same way is all there is."""
    kind = failure.kind
    if kind in (FailureKind.KV_CACHE_TOO_SMALL, FailureKind.PLAN_REFUSED):
        # vLLM's refusal, or the planner's prediction of it (exact: tests/engine/test_planner_vs_vllm.py),
        # names the longest max_model_len that fits.
        estimate = failure.estimated_max_model_len or (report.estimated_max_model_len if report else None)
        if estimate and (params.max_model_len is None or params.max_model_len > estimate):
            return Correction(
                params.replace(max_model_len=estimate),
                f"vLLM estimates max_model_len {estimate} fits; retrying with it",
            )
        return None
    if kind is FailureKind.BAD_ARGUMENTS:
        return _drop_unrecognized(failure, params)
    # An unset utilization is the default of the vLLM that failed (its log's version; 0.34 on GPUs: 1.0).
    default = vllm_defaults(report.vllm_version if report else None, backend).gpu_memory_utilization
    if kind is FailureKind.INSUFFICIENT_MEMORY:
        if backend == "cpu" and _NEGATIVE_KV.search(failure.detail):
            return _larger_share(params, default)
        return _free_share(params, report, default)
    if kind is FailureKind.OUT_OF_MEMORY:
        return _smaller(params, default)
    return None


def _free_share(params: EngineParams, report: StartReport | None, default: float) -> Correction | None:
    """The utilization the free memory at start allows (vLLM logged free and total), one point below."""
    if report is None or not report.free_at_start_gib or not report.total_at_start_gib:
        return _smaller(params, default)
    share = math.floor((report.free_at_start_gib / report.total_at_start_gib - 0.01) * 100) / 100
    current = params.gpu_memory_utilization or default
    if share < MIN_UTILIZATION or share >= current:
        return None
    return Correction(
        params.replace(gpu_memory_utilization=share),
        f"only {report.free_at_start_gib:g} of {report.total_at_start_gib:g} GiB were free at start: "
        f"gpu_memory_utilization {current:g} → {share:g}",
    )


def _smaller(params: EngineParams, default: float) -> Correction | None:
    """Out of memory while loading: a step less of the device, and at the floor a shorter context."""
    current = params.gpu_memory_utilization or default
    lower = max(round(current - UTILIZATION_STEP, 2), MIN_UTILIZATION)
    if params.kv_cache_memory_bytes is None and lower < current:
        return Correction(
            params.replace(gpu_memory_utilization=lower),
            f"out of memory at start: gpu_memory_utilization {current:g} → {lower:g}",
        )
    if params.max_model_len is not None and params.max_model_len >= 512:
        shorter = params.max_model_len // 2
        return Correction(
            params.replace(max_model_len=shorter),
            f"out of memory at start: max_model_len {params.max_model_len} → {shorter}",
        )
    return None


def _larger_share(params: EngineParams, default: float) -> Correction | None:
    """CPU backend: the share did not even hold the worker's own memory; more of it, never less."""
    if params.kv_cache_memory_bytes is not None:
        return None
    current = params.gpu_memory_utilization or default
    higher = min(round(current + UTILIZATION_STEP, 2), MAX_CPU_UTILIZATION)
    if higher <= current:
        return None
    return Correction(
        params.replace(gpu_memory_utilization=higher),
        "the CPU worker's share left nothing for the KV cache: "
        f"gpu_memory_utilization {current:g} → {higher:g}",
    )


def _drop_unrecognized(failure: EngineFailure, params: EngineParams) -> Correction | None:
    """Drop the flags this vLLM does not know (managed parameters are unset; others left out of argv), or
    one of tunerd's OPTIONAL_FLAGS whose value it refused."""
    match = _UNRECOGNIZED.search(failure.detail)
    if match is None:
        bad = _BAD_VALUE.search(failure.detail)
        if bad is None or bad.group(1) not in OPTIONAL_FLAGS:
            return None
        flag = bad.group(1)
        return Correction(
            params, f"this vLLM refuses tunerd's {flag}: starting without it", drop_flags=(flag,)
        )
    flags = tuple(word.split("=", 1)[0] for word in match.group(1).split() if word.startswith("--"))
    if not flags:
        return None
    unset = {
        name: None
        for flag in flags
        if (name := flag[2:].removeprefix("no-").replace("-", "_")) in TUNABLE_PARAMS
        or name in EngineParams.model_fields
    }
    return Correction(
        params.replace(**unset),
        f"this vLLM does not know {' '.join(flags)}: starting without it",
        drop_flags=flags,
    )


def without_flags(argv: list[str], flags: tuple[str, ...] | list[str]) -> list[str]:
    """`argv` minus each flag in `flags` (`--x v`, `--x=v`, `--x`, and `--no-x`)."""
    dropped = set(flags) | {"--no-" + f[2:] for f in flags}
    out: list[str] = []
    skip_value = False
    for word in argv:
        if skip_value:
            skip_value = False
            if not word.startswith("--"):
                continue
        name = word.split("=", 1)[0]
        if name in dropped:
            skip_value = "=" not in word and not name.startswith("--no-")  # --no-x takes no value
            continue
        out.append(word)
    return out
