#!/usr/bin/env python3
"""Exploration against a full sweep of the same values, under the same steady load: does
`tunerd explore max_num_seqs` end within tolerance of the best value a sweep finds, with fewer restarts?

    .venv/bin/python bench/explore_vs_sweep.py [--start 4] [--tolerance 0.05] [--window 30]

Side by side in one run, on the same machine and real vLLM (CPU build), each half with a fresh state
dir (the tuning memory of one must not help the other): the "small" random-weight model of the engine
tier, a 1,952-token KV cache, and a steady closed-loop load of 16 clients (16 cache-cold prompt tokens
→ 96 generated) that saturates vLLM at every value. So the exploration scores its points on the live
window (`objective_source` "live": the median per-second generation throughput over `--window` seconds
after the warm-up), and the sweep measures each value the same way from vLLM's /metrics: restart
(`tunerd restart --set`), the same warm-up, then `--window` seconds of per-second scrapes.
The values: max_num_seqs on the ladder 1, 2, 4, 8, 16 and the midpoints an exploration may shrink to
(3, 6, 11). Prints each point, the sweep's best, the exploration's choice, what the sweep measured at
that choice (the ratio to its best), and the restarts and minutes each spent. ~25 min on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.engine.conftest import cache_env, make_small_model, real_sections  # noqa: E402
from tests.harness import Daemon  # noqa: E402
from tests.load import ClosedLoopLoad  # noqa: E402

VALUES = (1, 2, 3, 4, 6, 8, 11, 16)
WARMUP_S = 5.0
PROBE = {"prompt_tokens": 32, "max_tokens": 32, "requests": 8, "concurrency": 4, "timeout_s": 300.0}
LOAD = {"clients": 16, "prompt_tokens": 16, "max_tokens": 96}


def sections(model: Path, cache: dict[str, str], start: int, tolerance: float, window: float) -> dict:
    return real_sections(
        model,
        cache,
        engine__params={"max_num_seqs": start, "kv_cache_memory_bytes": 32_000_000},  # float32: 1,952 tokens
        observe={"window_s": 10.0},
        tuning={
            "warmup_s": WARMUP_S,
            "window_s": window,
            "min_serving_s": 0.0,
            "explore_tolerance": tolerance,
            "restarts_per_hour": 100,
            "restarts_per_day": 100,
            "bounds": {"max_num_seqs": [1, 16]},
        },
        probe={**PROBE, "interval_s": 0},
    )


def generation_rate(url: str, seconds: float) -> float:
    """The median per-second rise of vllm:generation_tokens_total over `seconds` (what the
    exploration's live window measures)."""
    rates: list[float] = []
    previous: tuple[float, float] | None = None
    with httpx.Client(timeout=5, trust_env=False) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            text = client.get(f"{url}/metrics").text
            now = time.monotonic()
            value = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:generation_tokens_total")
            )
            if previous is not None and now > previous[0]:
                rates.append((value - previous[1]) / (now - previous[0]))
            previous = (now, value)
            time.sleep(1.0)
    return statistics.median(rates)


def load(daemon: Daemon, model: Path, seed: int) -> ClosedLoopLoad:
    url = f"http://127.0.0.1:{daemon.sections['engine']['port']}"
    return ClosedLoopLoad(url, str(model), seed=seed, **LOAD)


def explore(model: Path, cache: dict[str, str], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    daemon = Daemon(work, sections(model, cache, args.start, args.tolerance, args.window))
    daemon.start()
    try:
        daemon.wait_state("RUNNING", timeout=900)
        with load(daemon, model, seed=3):
            time.sleep(WARMUP_S + args.window)  # the live window of the configuration in force fills
            began = time.monotonic()
            print(daemon.cli("explore", "max_num_seqs"), flush=True)
            minutes = (time.monotonic() - began) / 60
        started = [r for r in daemon.records() if r["event"] == "explore.started"][-1]
        finished = [r for r in daemon.records() if r["event"] == "explore.finished"][-1]
        return {**finished, "source": started["objective_source"], "minutes": minutes}
    finally:
        daemon.stop(timeout=120)
        daemon.cleanup()


def sweep(model: Path, cache: dict[str, str], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    daemon = Daemon(work, sections(model, cache, args.start, args.tolerance, args.window))
    daemon.start()
    measured: dict[int, float] = {}
    restarts = 0
    try:
        daemon.wait_state("RUNNING", timeout=900)
        url = f"http://127.0.0.1:{daemon.sections['engine']['port']}"
        with load(daemon, model, seed=3):
            began = time.monotonic()
            for value in sorted(VALUES, key=lambda v: v != args.start):  # the one in force: no restart
                if value != args.start:
                    mark = daemon.last_seq()
                    daemon.cli("restart", "--set", f"max_num_seqs={value}")
                    daemon.wait_event("engine.ready", after_seq=mark, timeout=900)
                    restarts += 1
                time.sleep(WARMUP_S)
                measured[value] = generation_rate(url, args.window)
                print(f"  sweep max_num_seqs={value}: {measured[value]:.1f} tok/s", flush=True)
            minutes = (time.monotonic() - began) / 60
        return {"measured": measured, "restarts": restarts, "minutes": minutes}
    finally:
        daemon.stop(timeout=120)
        daemon.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=4, choices=VALUES)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured per point")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="explore-vs-sweep-"))
    model = make_small_model(root / "small", quiet=False)
    cache = cache_env(root / "cache")
    (root / "explore").mkdir()
    (root / "sweep").mkdir()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; work dir {root}")
    print(f"exploration of max_num_seqs from {args.start}, tolerance {args.tolerance:.0%}, load {LOAD}:")
    found = explore(model, cache, root / "explore", args)
    print(f"full sweep of {', '.join(map(str, VALUES))} from {args.start}, the same load:", flush=True)
    swept = sweep(model, cache, root / "sweep", args)
    measured = swept["measured"]
    best = max(measured, key=lambda v: measured[v])
    chosen = found["best"]["max_num_seqs"]
    ratio = measured[chosen] / measured[best]
    print(
        f"sweep: best max_num_seqs={best} at {measured[best]:.1f} tok/s; "
        f"{swept['restarts']} restarts, {swept['minutes']:.1f} min"
    )
    print(
        f"exploration ({found['source']} objective): best max_num_seqs={chosen} "
        f"({found['objective']:.1f} tok/s in its own window); {found['restarts']} restarts, "
        f"{found['points']} points, {found['minutes']:.1f} min"
    )
    print(
        f"the sweep measured the exploration's choice at {measured[chosen]:.1f} tok/s = {ratio:.2f}x its "
        f"best; within tolerance ({args.tolerance:.0%}): {'yes' if ratio >= 1 - args.tolerance else 'no'}; "
        f"restarts {found['restarts']} vs {swept['restarts']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
