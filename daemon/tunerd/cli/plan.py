"""`tunerd plan`: the capacity plan for a config (or a model directory and flags) on this machine.

Reads the model directory (`observe.model_dir`), this machine's memory and preflight facts
(`observe.machine_facts.probe_machine`, replaceable in tests), the calibration store in the config's state
dir, runs the planner (`decide.planner.assess`) and the preflight checks, and prints the table
(`decide.plan_report`) or JSON. Exit status: 0 feasible; 1 not feasible (the planner refuses, a preflight
check fails, or the machine can't be read); 2 usage error (bad flag value, unreadable `--model`
directory); 78 bad config (or the config's model directory can't be read).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from tunerd.config import Config, ConfigError, TuningConfig, default_config_path, load_config
from tunerd.core.machine import MachineFacts
from tunerd.core.model import ModelInfo, ModelInfoError
from tunerd.core.params import EngineParams, backend_problems, sizing_flag
from tunerd.observe.machine_facts import probe_machine
from tunerd.observe.model.directory import load_model_info
from tunerd.planner.checks import CheckResult, preflight_checks
from tunerd.planner.plan import PlanVerdict, assess
from tunerd.planner.report import plan_to_json, render_plan_table
from tunerd.supervise.capacity import CalibrationStore

EX_OK, EX_NOT_FEASIBLE, EX_USAGE, EX_CONFIG = 0, 1, 2, 78

# `tunerd plan` flags that set an EngineParams field (argparse dest == field name).
PARAM_FLAGS = (
    "max_model_len",
    "max_num_seqs",
    "block_size",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "kv_cache_dtype",
    "max_num_batched_tokens",
)


class _Refusal(Exception):
    """Stop with a one-line message on stderr and an exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def run_plan(args: argparse.Namespace) -> int:
    """Run `tunerd plan` for parsed `args`; prints to stdout (stderr for errors) and returns the exit
    status. Never raises for bad input: every problem becomes one line and an exit status."""
    try:
        config = _config_for(args)
        params = _params_for(args, config)
        model = _model_for(args, config)
        with _logs_to_stderr():
            machine = probe_machine(args.backend)
    except _Refusal as exc:
        print(f"tunerd plan: {exc}", file=sys.stderr)
        return exc.status
    except OSError as exc:
        print(f"tunerd plan: cannot read this machine's memory: {exc}", file=sys.stderr)
        return EX_NOT_FEASIBLE
    # What the daemon would launch: on unified memory always an explicit sizing (core.params.sizing_flag),
    # and vLLM's defaults for the version its last start reported (state file; unknown: ≤ 0.33).
    cap = (config.tuning if config is not None else TuningConfig()).unified_max_gpu_memory_utilization
    params = sizing_flag(params, backend=machine.backend, unified=machine.memory.unified, cap=cap)
    calibration = None
    if config is not None:
        calibration = CalibrationStore(config.paths.state_dir).get(model, params, machine.backend)
    plan = assess(
        model,
        params,
        machine.memory,
        backend=machine.backend,
        calibration=calibration,
        force=args.force,
        version=_known_version(config),
    )
    checks = _checks(plan, machine)
    feasible = plan.feasible and not any(c.verdict == "fail" for c in checks)
    if args.json:
        print(json.dumps(_json(plan, checks, machine, feasible), indent=2, ensure_ascii=False))
    else:
        print(_text(plan, checks, machine, feasible))
    return EX_OK if feasible else EX_NOT_FEASIBLE


def _known_version(config: Config | None) -> str | None:
    """The vLLM version the daemon's last start reported (its state file, read only), or None."""
    if config is None:
        return None
    try:
        identity = json.loads(Path(config.paths.state_file).read_text()).get("identity") or {}
    except (OSError, ValueError, AttributeError):
        return None
    version = identity.get("vllm_version") if isinstance(identity, dict) else None
    return version if isinstance(version, str) else None


def _config_for(args: argparse.Namespace) -> Config | None:
    """The config, unless `--model` was given without `-c` (then the flags alone describe the plan)."""
    if args.model is not None and args.config is None:
        return None
    path = args.config or default_config_path()
    try:
        return load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        hint = "" if args.model is not None else "; to plan without a config: --model DIR"
        raise _Refusal(f"cannot use config {path}{hint}", EX_CONFIG) from None


def _params_for(args: argparse.Namespace, config: Config | None) -> EngineParams:
    """The config's `engine.params` (or none), with every flag given on the command line applied."""
    base = config.engine.params if config is not None else EngineParams()
    changes = {name: getattr(args, name) for name in PARAM_FLAGS if getattr(args, name) is not None}
    try:
        return base.replace(**changes)
    except ValidationError as exc:
        first = exc.errors()[0]
        flag = "--" + str(first["loc"][0]).replace("_", "-") if first["loc"] else "flags"
        raise _Refusal(f"{flag}: {first['msg']}", EX_USAGE) from None


def _model_for(args: argparse.Namespace, config: Config | None) -> ModelInfo:
    """The model directory read into a `ModelInfo` (`--model`, else the config's `engine.model`)."""
    directory = args.model if args.model is not None else config.engine.model if config else ""
    try:
        return load_model_info(directory, dtype=config.engine.extra_flag("dtype") if config else None)
    except ModelInfoError as exc:
        raise _Refusal(str(exc), EX_USAGE if args.model is not None else EX_CONFIG) from None


@contextlib.contextmanager
def _logs_to_stderr() -> Iterator[None]:
    """While probing, send log events (NVML's gpu.available / gpu.unavailable …) to stderr at warning
    level, so stdout stays the table or the JSON; the previous logging set-up is restored after."""
    from tunerd.faces.logs import configure_logging

    configured, saved = structlog.is_configured(), structlog.get_config()
    configure_logging("warning", "auto")
    try:
        yield
    finally:
        if configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()


def _checks(plan: PlanVerdict, machine: MachineFacts) -> list[CheckResult]:
    """The preflight checks against this plan, plus the backend's constraints on the flags."""
    checks = preflight_checks(machine.preflight, plan)
    checks += [CheckResult("params", "fail", p) for p in backend_problems(plan.params, plan.backend)]
    return checks


def _text(plan: PlanVerdict, checks: list[CheckResult], machine: MachineFacts, feasible: bool) -> str:
    lines = [render_plan_table(plan), "", "preflight:"]
    width = max(len(c.name) for c in checks)
    for c in checks:
        lines.append(f"  {c.verdict:<4}  {c.name.ljust(width)}  {c.detail}")
        if c.remedy:
            lines.append(f"        {' ' * width}  → {c.remedy}")
    lines += [f"note: {note}" for note in machine.notes]
    if plan.feasible and not feasible:
        failed = ", ".join(c.name for c in checks if c.verdict == "fail")
        lines += ["", f"NOT FEASIBLE: preflight check failed ({failed})"]
    return "\n".join(lines)


def _json(
    plan: PlanVerdict, checks: list[CheckResult], machine: MachineFacts, feasible: bool
) -> dict[str, Any]:
    """`plan_to_json` plus the preflight results, the machine notes and the overall answer."""
    data = plan_to_json(plan)
    data["preflight"] = [asdict(c) for c in checks]
    data["machine_notes"] = list(machine.notes)
    data["ok_to_start"] = feasible
    return data
