#!/usr/bin/env python3
"""The benchmark probe's spread against real vLLM, its cache-coldness, and the prefix-cache reset.

    .venv/bin/python bench/probe_spread.py [--model DIR] [--runs 5] [--requests 8] [--concurrency 4]
        [--prompt-tokens 128] [--max-tokens 128] [--url URL --served-name NAME --vocab N]

Starts real vLLM with VLLM_SERVER_DEV_MODE=1 (`python -m vllm.entrypoints.openai.api_server --model DIR
--port P --max-model-len 512 --kv-cache-memory-bytes 100000000 --block-size 32`; a tiny model made by
scripts/make-tiny-model.py unless --model is given; never --enforce-eager), or uses `--url`. Then:
1. one warm-up probe (printed, not counted), then `--runs` probes (`tunerd.observe.probe.run_probe`,
   seeds 1001..1000+N), each with vLLM's prefix-cache hits over it (`vllm:prefix_cache_hits_total`
   before and after); printed per run, then the median and (min..max) and the spread (max − min) /
   median of each figure;
2. the control: the last run's seed once more, its prompts now in the prefix cache: the hits it gets and
   its throughput against the cold runs' median (what a fixed prompt would flatter);
3. `POST /reset_prefix_cache` (`tunerd.engine.admin.reset_prefix_cache`) idle; while 32 long
   streamed completions run (retried every 0.25 s while vLLM answers that blocks are in use); after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "daemon"))

from tunerd.config import ProbeConfig  # noqa: E402
from tunerd.engine.admin import reset_prefix_cache  # noqa: E402
from tunerd.observe.probe import ProbeResult, run_probe  # noqa: E402
from tunerd.observe.vllm_metrics import scrape  # noqa: E402

FIGURES = (
    ("throughput", "tok/s", 1.0),
    ("ttft_p50", "ms", 1e3),
    ("ttft_p95", "ms", 1e3),
    ("itl_p50", "ms", 1e3),
    ("itl_p95", "ms", 1e3),
)


def say(text: str) -> None:
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefix_hits(client: httpx.Client, url: str) -> float | None:
    sample = scrape(client, f"{url}/metrics").sample
    return None if sample is None else sample.prefix_cache_hits_total


def row(label: str, result: ProbeResult, hits: float | None) -> str:
    cells = [f"{label:>8}"]
    for name, unit, scale in FIGURES:
        value = getattr(result, name)
        cells.append(f"{name} {'-' if value is None else f'{value * scale:.1f}'} {unit}")
    errors = f"  errors {list(result.errors)}" if result.errors else ""
    return (
        "  ".join(cells) + f"  tokens {result.tokens} in {result.seconds:.2f} s  prefix hits {hits}{errors}"
    )


def stream_one(url: str, name: str, vocab: int, index: int, streaming: threading.Event) -> None:
    """One long streamed completion (the load under which the reset is tried); sets `streaming` at its
    first event."""
    body = {
        "model": name,
        "prompt": [10 + (index * 7 + i) % (vocab - 10) for i in range(64)],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300, trust_env=False) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                streaming.set()


def start_vllm(work: Path, model: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CACHE_ROOT", str(work / "cache" / "vllm"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "cache" / "inductor"))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512"]
    cmd += ["--kv-cache-memory-bytes", "100000000", "--block-size", "32"]
    log = open(work / "vllm.log", "wb")  # noqa: SIM115 - lives as long as the child
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url, started = f"http://127.0.0.1:{port}", time.monotonic()
    say(f"starting vLLM on port {port} (45-90 s on a CPU); log {work / 'vllm.log'}")
    while time.monotonic() - started < 900:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited {proc.returncode}; see {work / 'vllm.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                say(f"vLLM serving after {time.monotonic() - started:.0f} s")
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit("vLLM did not answer /health within 900 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def spread_lines(results: list[ProbeResult]) -> list[str]:
    lines = []
    for name, unit, scale in FIGURES:
        values = [getattr(r, name) * scale for r in results if getattr(r, name) is not None]
        if not values:
            lines.append(f"  {name:>10}: no data")
            continue
        median = statistics.median(values)
        spread = (max(values) - min(values)) / median if median else float("nan")
        lines.append(
            f"  {name:>10}: median {median:.2f} {unit} ({min(values):.2f}..{max(values):.2f}), "
            f"spread {spread:.1%} of the median over {len(values)} runs"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--url", help="a vLLM already serving (with VLLM_SERVER_DEV_MODE=1 for the reset)")
    parser.add_argument("--served-name", help="the model's name in the API (default: --model)")
    parser.add_argument("--vocab", type=int, help="the model's vocab_size (default: its config.json)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="probe-spread-"))
    say(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start")
    model = args.model or work / "tiny"
    if args.model is None and args.url is None:
        script = str(REPO / "scripts" / "make-tiny-model.py")
        subprocess.run([sys.executable, script, str(model)], check=True, capture_output=True)
    vocab = args.vocab or json.loads((model / "config.json").read_text())["vocab_size"]
    proc, url = (None, args.url.rstrip("/")) if args.url else start_vllm(work, model)
    name = args.served_name or str(model)
    cfg = ProbeConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
    )
    say(
        f"probe: {cfg.requests} requests, {cfg.concurrency} at a time, {cfg.prompt_tokens} prompt tokens, "
        f"{cfg.max_tokens} generated (ignore_eos), vocab {vocab}"
    )
    client = httpx.Client(trust_env=False, timeout=5)
    try:
        results = []
        for run in range(args.runs + 1):
            before = prefix_hits(client, url)
            result = run_probe(run, url, name, cfg, seed=1000 + run, vocab=vocab)
            after = prefix_hits(client, url)
            hits = None if before is None or after is None else after - before
            say(row("warm-up" if run == 0 else f"run {run}", result, hits))
            if run:
                results.append(result)
        say(f"over the {len(results)} runs (warm-up left out):")
        for line in spread_lines(results):
            say(line)

        before = prefix_hits(client, url)
        again = run_probe(99, url, name, cfg, seed=1000 + args.runs, vocab=vocab)
        after = prefix_hits(client, url)
        say(row("repeat", again, None if before is None or after is None else after - before))
        cold = statistics.median(r.throughput for r in results if r.throughput)
        if again.throughput:
            say(f"  the repeated prompts' throughput is {again.throughput / cold:.2f}x the cold runs' median")

        idle = reset_prefix_cache(url, retries=0, retry_after_s=0.25)
        say(f"reset, idle: {idle}")
        streaming = threading.Event()  # set once a load request has streamed its first token
        loads = [
            threading.Thread(target=stream_one, args=(url, name, vocab, i, streaming)) for i in range(32)
        ]
        for load in loads:
            load.start()
        deadline, sample = time.monotonic() + 120, None
        while time.monotonic() < deadline and not streaming.is_set():  # until the load holds KV blocks
            sample = scrape(client, f"{url}/metrics").sample
            if sample is not None and (sample.kv_cache_usage or 0.0) > 0:
                break
            time.sleep(0.05)
        say(f"  resetting under load: KV cache usage {sample.kv_cache_usage if sample else None}")
        busy = reset_prefix_cache(url, retries=200, retry_after_s=0.25)
        say(f"reset, under load: {busy}")
        for load in loads:
            load.join()
        say(f"reset, after the load: {reset_prefix_cache(url, retries=0, retry_after_s=0.25)}")
    finally:
        client.close()
        if proc is not None:
            stop(proc)


if __name__ == "__main__":
    main()
