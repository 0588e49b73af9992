#!/usr/bin/env python3
"""The tuning loop, an exploration, restart cost and the front door on a real GPU (docs/gpu.md).

    python3 bench/gpu_story.py story   --out DIR [--seconds 380]
    python3 bench/gpu_story.py sweep   --out DIR [--values default,16,8,4]
    python3 bench/gpu_story.py explore --out DIR

Run on the H200 machine with vLLM 0.24.0 from ../shared/tools/gpu-vllm, its `device.sh env` sourced
(tunerd passes that environment on to the vLLM it starts). One workload in every part: 64 closed-loop
clients (tests/load.py: cache-cold prompts of 256 random token ids, 512 generated, `ignore_eos`) against
the recipe's Qwen3-0.6B-shaped model with a small KV cache (`--kv-cache-memory-bytes` 1.3 GB: 11,335
tokens at 114,688 bytes a token, ~14 requests of 768 tokens) and vLLM's default `max_num_seqs` (1024 on
an H200), so the cache, not the batch limit, bounds what runs and vLLM preempts.

Each part fits one device command (10 min); the lease ran them back to back (docs/gpu.md).

- `story`: `tunerd run` with the door on (clients go through it) and the shipped rules, their `for_s`
  cut to 20 s and cooldowns to 30 s (the lease has minutes); prints the journal's decisions as they
  happen, then `tunerd trials`, the status and the load's errors.
- `sweep`: the oracle, no tunerd: for each max_num_seqs, a bare vLLM start (Popen to /health 200), the
  same load straight at vLLM, 5 s of warm-up, 20 s of per-second /metrics (median generation tokens/s,
  as tunerd's live window scores; preemptions/s), SIGTERM and the time to exit.
- `explore`: `tunerd explore max_num_seqs` from 16 within --bounds (8, 32) under the same load; then,
  if the command's time allows (--extras-before-s), the door's added latency (bench/front_door.py
  against that vLLM, 64 streams) and a restart to a `max_model_len` (100000) the KV cache cannot hold:
  refused, or what it costs before tunerd serves again.
Everything lands in --out (journals, status, vLLM logs, JSON of the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "daemon")]

from tests.harness import Daemon, free_port, toml_value  # noqa: E402
from tests.load import ClosedLoopLoad  # noqa: E402

MODEL = "/root/qwen3-0.6b"
PARAMS = {"max_model_len": 2048, "kv_cache_memory_bytes": 1_300_000_000}
LOAD = {"clients": 64, "prompt_tokens": 256, "max_tokens": 512, "vocab": 50_000}
WARMUP_S, WINDOW_S = 5.0, 20.0
VLLM = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
SHOWN = ("rule.fired", "rule.deferred", "rule.alert", "rule.exhausted", "trial.", "explore.", "engine.ready")


def say(text: str) -> None:
    print(text, flush=True)


def shortened_rules() -> str:
    """The shipped rules as they are, `for_s` at most 20 s and cooldowns at most 30 s."""
    shipped = tomllib.loads((REPO / "etc" / "tunerd" / "rules.toml").read_text())
    lines = []
    for rule in shipped["rule"]:
        rule = {**rule, "for_s": min(rule["for_s"], 20), "cooldown_s": min(rule["cooldown_s"], 30)}
        lines.append("[[rule]]")
        lines += [f"{key} = {toml_value(value)}" for key, value in rule.items()]
        lines.append("")
    return "\n".join(lines)


def sections(model: str, params: dict[str, Any], **tuning: Any) -> dict[str, dict[str, Any]]:
    return {
        "engine": {"command": VLLM, "model": model, "port": free_port()},
        "engine.params": {**PARAMS, **params},
        "timeouts": {"startup_s": 400.0, "graceful_stop_s": 20.0, "health_interval_s": 1.0},
        "backoff": {"initial_s": 1.0, "max_s": 5.0, "known_good_after_s": 5.0, "max_failures": 3},
        "door": {"enabled": True, "port": free_port(), "hold_timeout_s": 600.0},
        "observe": {"window_s": 10.0},
        "tuning": {
            "warmup_s": WARMUP_S,
            "window_s": WINDOW_S,
            "max_extend_s": 0.0,
            "max_starts": 1,
            "min_serving_s": 0.0,
            "restarts_per_hour": 100,
            "restarts_per_day": 100,
            **tuning,
        },
        "probe": {"prompt_tokens": 256, "max_tokens": 128, "requests": 16, "concurrency": 8, "interval_s": 0},
        "export": {"port": 0},
        "logging": {"format": "json"},
    }


def tunerd(daemon: Daemon, *args: str, timeout: float = 900) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tunerd", *args, "--config", str(daemon.config_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.stdout + done.stderr


def show(record: dict[str, Any]) -> None:
    keep = {k: v for k, v in record.items() if k not in ("time", "why", "before", "after", "plan", "action")}
    say(f"  {record['time'][11:19]} {json.dumps(keep)[:400]}")


def follow(daemon: Daemon, after: int) -> int:
    """Print the journal's decisions after seq `after`; the last seq seen."""
    for record in daemon.records():
        if record["seq"] > after:
            after = record["seq"]
            if record["event"].startswith(SHOWN):
                show(record)
    return after


def keep(daemon: Daemon, out: Path, name: str) -> None:
    """The daemon's journal, stderr and vLLM logs into `out`/name-*."""
    shutil.copy(daemon.journal_path, out / f"{name}-journal.jsonl")
    shutil.copy(daemon.stderr_path, out / f"{name}-tunerd.log")
    logs = daemon.state_dir / "engine-logs"
    if logs.is_dir():
        with open(out / f"{name}-vllm.log", "w") as merged:
            for log in sorted(logs.iterdir()):
                merged.write(f"==> {log.name}\n{log.read_text(errors='replace')}\n")


def story(args: argparse.Namespace) -> dict[str, Any]:
    work = args.out / "story-work"
    work.mkdir(parents=True)
    (work / "rules.toml").write_text(shortened_rules())
    daemon = Daemon(work, sections(args.model, {}))
    began = time.monotonic()
    daemon.start()
    try:
        daemon.wait_state("RUNNING", timeout=450)
        say(f"tunerd: vLLM serving after {time.monotonic() - began:.1f} s; load {LOAD} through the door")
        door = f"http://127.0.0.1:{daemon.sections['door']['port']}"
        seen = 0
        with ClosedLoopLoad(door, args.model, seed=11, **LOAD) as load:
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                seen = follow(daemon, seen)
                time.sleep(1.0)
        stats = load.stats
        follow(daemon, seen)
        trials = tunerd(daemon, "trials")
        status = tunerd(daemon, "status", "--json")
        say(f"$ tunerd trials\n{trials}")
        (args.out / "story-trials.txt").write_text(trials)
        (args.out / "story-status.json").write_text(status)
        (args.out / "story-journal.txt").write_text(tunerd(daemon, "journal"))
        figures = {"ok": stats.ok, "errors": stats.errors[:20], "error_count": len(stats.errors)}
        say(f"load: {stats.ok} answered, {len(stats.errors)} errors {stats.errors[:5]}")
        return figures
    finally:
        daemon.stop(timeout=120)
        keep(daemon, args.out, "story")


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    wanted = ("vllm:generation_tokens_total", "vllm:num_preemptions_total")
    found = dict.fromkeys(wanted, 0.0)
    for line in client.get(f"{url}/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found


def measure(url: str, seconds: float) -> dict[str, float]:
    """Median per-second generation tokens/s over `seconds`, and preemptions/s over the whole span."""
    rates: list[float] = []
    with httpx.Client(timeout=5, trust_env=False) as client:
        first = previous = scrape(client, url)
        t0 = t_prev = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(1.0)
            now, values = time.monotonic(), scrape(client, url)
            rates.append(
                (values["vllm:generation_tokens_total"] - previous["vllm:generation_tokens_total"])
                / (now - t_prev)
            )
            previous, t_prev = values, now
        span = t_prev - t0
    preempted = previous["vllm:num_preemptions_total"] - first["vllm:num_preemptions_total"]
    return {"tokens_per_s": statistics.median(rates), "preemptions_per_s": preempted / span}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for value in args.values.split(","):
        port = free_port()
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in PARAMS.items()]
        if value != "default":
            flags.append(f"--max-num-seqs={value}")
        log = open(args.out / f"sweep-{value}.log", "wb")  # noqa: SIM115 - lives as long as vLLM
        cmd = [*VLLM, "--model", args.model, "--host", "127.0.0.1", "--port", str(port), *flags]
        began = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited with {proc.returncode}: see sweep-{value}.log")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        start_s = time.monotonic() - began
        with ClosedLoopLoad(url, args.model, seed=11, **LOAD) as load:
            time.sleep(WARMUP_S)
            figures = measure(url, WINDOW_S)
        stopping = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        stop_s = time.monotonic() - stopping
        rows[value] = {**figures, "start_s": start_s, "stop_s": stop_s, "errors": len(load.stats.errors)}
        say(
            f"  max_num_seqs {value}: {figures['tokens_per_s']:.0f} tok/s, "
            f"{figures['preemptions_per_s']:.2f} preemptions/s; start {start_s:.1f} s, stop {stop_s:.2f} s"
        )
    return rows


def explore(args: argparse.Namespace) -> dict[str, Any]:
    work = args.out / "explore-work"
    work.mkdir(parents=True)
    low, high = (int(v) for v in args.bounds.split(","))
    daemon = Daemon(work, sections(args.model, {"max_num_seqs": 16}, bounds={"max_num_seqs": [low, high]}))
    figures: dict[str, Any] = {}
    began = time.monotonic()
    daemon.start()
    try:
        daemon.wait_state("RUNNING", timeout=450)
        say(f"tunerd: vLLM serving after {time.monotonic() - began:.1f} s")
        door = f"http://127.0.0.1:{daemon.sections['door']['port']}"
        with ClosedLoopLoad(door, args.model, seed=11, **LOAD) as load:
            time.sleep(WARMUP_S + WINDOW_S)  # the live window of the value in force fills
            started = time.monotonic()
            say(f"$ tunerd explore max_num_seqs\n{tunerd(daemon, 'explore', 'max_num_seqs')}")
            figures["explore_minutes"] = (time.monotonic() - started) / 60
        figures["load"] = {"ok": load.stats.ok, "errors": len(load.stats.errors)}
        follow(daemon, 0)
        engine = f"http://127.0.0.1:{daemon.sections['engine']['port']}"
        if time.monotonic() - began > args.extras_before_s:
            say("no time left in this command for the door's latency and the rejected value: not run")
            return figures
        say("== the door's added latency, against this vLLM (bench/front_door.py)")
        bench = [sys.executable, str(REPO / "bench" / "front_door.py"), "--upstream", engine]
        bench += ["--model", args.model, "--repeats", "2", "--requests", "60", "--null-requests", "200"]
        done = subprocess.run(bench, capture_output=True, text=True, timeout=240)
        say(done.stdout[-6000:] + done.stderr[-2000:])
        (args.out / "explore-front-door.txt").write_text(done.stdout + done.stderr)
        if time.monotonic() - began > args.extras_before_s + 60:
            say("no time left in this command for the rejected value: not run")
            return figures
        say("== a restart to a value vLLM rejects: max_model_len 100000 (the model's is 40960)")
        mark, asked = daemon.last_seq(), time.monotonic()
        answer = tunerd(daemon, "restart", "--set", "max_model_len=100000")
        say(answer)
        if "refuses" not in answer:  # it went to a start: until tunerd serves again
            back = daemon.wait_record(lambda r: r["event"] == "engine.ready", after_seq=mark, timeout=400)
            say(f"serving again ({back['params']}) {time.monotonic() - asked:.1f} s after the restart")
        figures["rejected_value_s"] = time.monotonic() - asked
        follow(daemon, mark)
        return figures
    finally:
        daemon.stop(timeout=120)
        keep(daemon, args.out, "explore")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("story", "sweep", "explore"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--seconds", type=float, default=380.0, help="story: seconds of load")
    parser.add_argument("--values", default="default,16,8", help="sweep: max_num_seqs values")
    parser.add_argument("--bounds", default="8,32", help="explore: max_num_seqs bounds, from 16")
    parser.add_argument(
        "--extras-before-s",
        type=float,
        default=470.0,
        help="explore: the door and rejected-value parts "
        "run only if the exploration ended this soon after the daemon's start (one command's limit)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "daemon"), str(REPO), os.environ.get("PYTHONPATH", "")]
    )
    say(f"{args.part}: model {args.model}, params {PARAMS}, load {LOAD}")
    part = {"story": story, "sweep": sweep, "explore": explore}[args.part]
    figures = part(args)
    (args.out / f"{args.part}.json").write_text(json.dumps(figures, indent=2))
    say(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
