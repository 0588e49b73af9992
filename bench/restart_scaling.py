#!/usr/bin/env python3
"""How the restarts of a search grow as the tuned parameters go from 2 to 3 (issue 23: "the sweep's
multiply, tunerd's add"), on simulated landscapes with this box's noise.

    .venv/bin/python bench/restart_scaling.py [--landscapes 100] [--out docs/benchmarks/restart_scaling.json]

A simulation, not a run of vLLM: the seeded landscapes and noise of tests/unit/test_explore_vs_random.py
(generation throughput over `max_num_seqs` × `max_num_batched_tokens`, a product of unimodal bumps in log2
of each value; between-start noise σ 0.10, between-probe noise σ 0.42), and for three parameters a third
factor over `block_size` (the CPU backend's choices; a bump of 1–3 octaves, peak anywhere). The search is
tunerd's own (`policy/explore.Search`, driven probe by probe as tune/explorer.py drives it); the grid
sweep is one start per point of the same ladders. Measuring the 2→3 step on real vLLM would take two more
tunerd runs and a 3-parameter sweep of ~100 starts (several hours on this box): not done.

Printed per parameter count: the sweep's restarts (the product of the ladders) and the true value of its
choice (each point one start, one probe, with the same noise) over the landscape's true best; the
search's restarts (median and range over the landscapes) and the true value of its choice — so that
fewer restarts are not read as a free lunch.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "daemon")]

from tests.unit.test_explore_vs_random import (  # noqa: E402
    FLOOR,
    PROBE_NOISE,
    PROBES,
    SEQS,
    START_NOISE,
    TOKENS,
    Engine,
    bump,
    explore,
    landscape,
)
from tunerd.policy.explore import ladder  # noqa: E402

BLOCKS = ladder("block_size", 32, backend="cpu")


def run(count: int, landscapes: int) -> dict:
    params = ["max_num_seqs", "max_num_batched_tokens", "block_size"][:count]
    ladders = {"max_num_seqs": SEQS, "max_num_batched_tokens": TOKENS, "block_size": BLOCKS}
    restarts, quality, swept = [], [], []
    for seed in range(landscapes):
        two, current = landscape(seed)
        rng = random.Random(5000 + seed)
        blocks = bump(rng, math.log2(BLOCKS[0]), math.log2(BLOCKS[-1]), (1.0, 3.0), (1.0, 3.0))

        def truth(config: dict, two=two, blocks=blocks) -> float:
            return two(config) * (blocks(config["block_size"]) if count == 3 else 1.0)

        current = {**current, "block_size": rng.choice(BLOCKS)}
        choice, spent, _ = explore(truth, current, rng, {p: ladders[p] for p in params})
        blocks_swept = BLOCKS if count == 3 else (current["block_size"],)
        grid = [
            {"max_num_seqs": a, "max_num_batched_tokens": b, "block_size": c}
            for a in SEQS
            for b in TOKENS
            for c in blocks_swept
        ]
        engine = Engine(truth, rng)  # the sweep: one start and one probe a point, the best measured wins
        measured = []
        for g in grid:
            engine.restart()
            measured.append((engine.probe(g), g))
        best = max(truth(g) for g in grid)
        restarts.append(spent)
        quality.append(truth(choice) / best)
        swept.append(truth(max(measured, key=lambda m: m[0])[1]) / best)
    sweep = math.prod(len(ladders[p]) for p in params)
    return {
        "params": params,
        "ladders": {p: list(ladders[p]) for p in params},
        "sweep_restarts": sweep,
        "search_restarts": restarts,
        "search_restarts_median": statistics.median(restarts),
        "search_of_true_best_median": statistics.median(quality),
        "sweep_of_true_best_median": statistics.median(swept),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--landscapes", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(
        f"simulated landscapes: {args.landscapes}; start noise σ {START_NOISE}, probe noise σ {PROBE_NOISE}, "
        f"{PROBES} probes, floor {FLOOR}"
    )
    rows = [run(2, args.landscapes), run(3, args.landscapes)]
    for row in rows:
        r = row["search_restarts"]
        print(
            f"{len(row['params'])} parameters ({' × '.join(f'{len(v)}' for v in row['ladders'].values())}): "
            f"sweep {row['sweep_restarts']} restarts, its choice at "
            f"{row['sweep_of_true_best_median']:.0%} of the true best; tunerd's search "
            f"{row['search_restarts_median']:g} ({min(r)}..{max(r)}), its choice at "
            f"{row['search_of_true_best_median']:.0%} (medians)"
        )
    two, three = rows
    print(
        f"2 → 3 parameters: the sweep's restarts ×{three['sweep_restarts'] / two['sweep_restarts']:.1f}, "
        f"tunerd's +{three['search_restarts_median'] - two['search_restarts_median']:g} (median)"
    )
    if args.out is not None:
        args.out.write_text(json.dumps({"landscapes": args.landscapes, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
