#!/usr/bin/env python3
"""Planner accuracy against real vLLM (CPU build): predicted vs. vLLM-reported, per case, and the error.

Usage: .venv/bin/python bench/planner_accuracy.py [--quick] [--workdir DIR] [--json FILE]

Starts vLLM once per case, sequentially (see `tests/engine/planner_harness.py` for the cases: two tiny
shapes × three `--kv-cache-memory-bytes` values, one refusal per shape, and the `--gpu-memory-utilization`
path with one calibration start, one prediction at another utilization and one repeat of the calibration
start). Each start is read only until vLLM logs its KV cache size (or refuses), then killed. About 6–10
minutes on 2 cores (--quick: one explicit-KV case and one refusal). Exit status 1 if an exact case
(explicit KV bytes, refusal) is not exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "engine"))
sys.path.insert(0, str(REPO))  # planner_harness imports tests.harness

from planner_harness import DEFAULT_CASES, format_table, run_all  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="models, logs and compile caches (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="one explicit-KV case and one refusal")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="planner-accuracy-"))
    started = time.monotonic()
    quick = ("A-kv-2000000", "A-refuse-4096")
    results = run_all(workdir, [c for c in DEFAULT_CASES if c.name in quick] if args.quick else DEFAULT_CASES)
    elapsed = time.monotonic() - started
    print(format_table(results))
    print()
    for r in results:
        if "implied_non_kv_range" in r.extra:
            low, high = r.extra["implied_non_kv_range"]  # type: ignore[misc]
            print(f"{r.case.name}: worker RSS implied by the logged tokens: {low:,}–{high:,} bytes")
        if r.extra.get("kv_tokens_range"):
            print(f"{r.case.name}: predicted range {r.extra['kv_tokens_range']}")
    print(f"\n{len(results)} vLLM starts in {elapsed:.0f} s; logs under {workdir / 'logs'}")
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "case": r.case.name,
                        "kind": r.case.kind,
                        "metric": r.metric,
                        "predicted": r.predicted,
                        "reported": r.reported,
                        "error": r.error,
                        "seconds": round(r.outcome.seconds, 1),
                        "note": r.note,
                        "extra": {k: v for k, v in r.extra.items()},
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    exact_kinds = {"kv_bytes", "refusal"}
    return 0 if all(r.exact for r in results if r.case.kind in exact_kinds) else 1


if __name__ == "__main__":
    sys.exit(main())
