#!/usr/bin/env python3
"""Exploration against a full sweep of the same values: does `tunerd explore max_num_seqs` end within
tolerance of the best value a sweep finds, with fewer restarts?

    .venv/bin/python bench/explore_vs_sweep.py [--start 4] [--tolerance 0.05]

Side by side in one run, on the same machine and real vLLM (CPU build), each with a fresh state dir
(the tuning memory of one must not help the other): the "small" random-weight model of the engine tier,
a 1,952-token KV cache, the probe as objective (32 requests of 32 cache-cold prompt tokens → 32 tokens,
16 at a time). The exploration's values are max_num_seqs on the ladder 1, 2, 4, 8, 16 and the midpoints
it may shrink to (3, 6, 11); the sweep measures every one of them (`tunerd restart --set`, then
`tunerd probe`). Prints each point, the sweep's best, the exploration's best and what the sweep
measured there (the ratio), and the restarts each spent. One probe per point in both. ~15 min on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.engine.conftest import real_sections  # noqa: E402
from tests.harness import Daemon  # noqa: E402

VALUES = (1, 2, 3, 4, 6, 8, 11, 16)
PROBE = {"prompt_tokens": 32, "max_tokens": 32, "requests": 32, "concurrency": 16, "timeout_s": 300.0}


def tunerd(daemon: Daemon, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tunerd", *args, "--config", str(daemon.config_path)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise SystemExit(f"tunerd {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


def sections(model: Path, cache: dict[str, str], start: int, tolerance: float) -> dict[str, Any]:
    return real_sections(
        model,
        cache,
        engine__params={"max_num_seqs": start, "kv_cache_memory_bytes": 16_000_000},
        tuning={
            "warmup_s": 5.0,
            "explore_tolerance": tolerance,
            "restarts_per_hour": 100,
            "restarts_per_day": 100,
            "bounds": {"max_num_seqs": [1, 16]},
        },
        probe={**PROBE, "interval_s": 0},
    )


def explore(model: Path, cache: dict[str, str], work: Path, start: int, tolerance: float) -> dict[str, Any]:
    daemon = Daemon(work, sections(model, cache, start, tolerance))
    daemon.start()
    try:
        daemon.wait_state("RUNNING", timeout=900)
        print(tunerd(daemon, "explore", "max_num_seqs"), flush=True)
        finished = [r for r in daemon.records() if r["event"] == "explore.finished"][-1]
        return finished
    finally:
        daemon.stop(timeout=120)
        daemon.cleanup()


def sweep(model: Path, cache: dict[str, str], work: Path, start: int) -> tuple[dict[int, float], int]:
    daemon = Daemon(work, sections(model, cache, start, 0.05))
    daemon.start()
    measured: dict[int, float] = {}
    restarts = 0
    try:
        daemon.wait_state("RUNNING", timeout=900)
        for value in sorted(VALUES, key=lambda v: v != start):  # the one in force first: no restart
            if value != start:
                mark = daemon.last_seq()
                tunerd(daemon, "restart", "--set", f"max_num_seqs={value}")
                daemon.wait_event("engine.ready", after_seq=mark, timeout=900)
                restarts += 1
            result = json.loads(tunerd(daemon, "probe", "--json"))
            measured[value] = result["throughput"]
            print(f"  sweep max_num_seqs={value}: {measured[value]:.1f} tok/s", flush=True)
        return measured, restarts
    finally:
        daemon.stop(timeout=120)
        daemon.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=4, choices=VALUES)
    parser.add_argument("--tolerance", type=float, default=0.05)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="explore-vs-sweep-"))
    model = root / "small"
    shape = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--head-dim", "64"]
    script = str(REPO / "scripts" / "make-tiny-model.py")
    subprocess.run([sys.executable, script, str(model), *shape, "--intermediate", "2816"], check=True)
    cache = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(root / "cache" / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "cache" / "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
    }
    (root / "explore").mkdir()
    (root / "sweep").mkdir()
    print(f"exploration of max_num_seqs from {args.start}, tolerance {args.tolerance:.0%}:", flush=True)
    finished = explore(model, cache, root / "explore", args.start, args.tolerance)
    print(f"full sweep of {', '.join(map(str, VALUES))} from {args.start}:", flush=True)
    measured, sweep_restarts = sweep(model, cache, root / "sweep", args.start)
    best_value = max(measured, key=lambda v: measured[v])
    chosen = finished["best"]["max_num_seqs"]
    ratio = measured[chosen] / measured[best_value]
    print(
        f"sweep: best max_num_seqs={best_value} at {measured[best_value]:.1f} tok/s, "
        f"{sweep_restarts} restarts"
    )
    print(
        f"exploration: best max_num_seqs={chosen} ({finished['objective']:.1f} tok/s in its own probe), "
        f"{finished['restarts']} restarts, {finished['points']} points"
    )
    print(
        f"the sweep measured the exploration's choice at {measured[chosen]:.1f} tok/s = {ratio:.2f}x "
        "its best; "
        f"within tolerance ({args.tolerance:.0%}): {'yes' if ratio >= 1 - args.tolerance else 'no'}; "
        f"restarts {finished['restarts']} vs {sweep_restarts}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
