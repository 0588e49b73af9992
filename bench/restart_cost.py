#!/usr/bin/env python3
"""What a restart costs under tunerd, against a bare stop-and-start of the same vLLM by a plain script.

    .venv/bin/python bench/restart_cost.py [--repeats 3] [--no-warm]

Real vLLM (CPU build, the engine tier's "small" random-weight model, a 1,920-token KV cache), idle.
tunerd runs one copy (door off, no rules: only the restarts asked here); this script runs another with
the argv and environment tunerd spawned (same compile caches), on a port of its own (tunerd's
`preflight.memory_tolerance_bytes` is raised to 4 GiB so that its memory-return gate does not wait for the
memory that copy holds). Each repeat, in alternating order:

- tunerd: `tunerd restart --set max_num_seqs=V` (8 and 16 in turn, so each is a change): from the
  decision (its `intent` in the journal) to the first `/health` 200 of the new vLLM, polled every 50 ms
  once the old one has stopped; the journal's split (drain, stop, preflight, start) is printed beside it;
- bare: SIGTERM to the running copy's process group, wait until the API server has exited and the rest
  of the group (vLLM's engine core) is gone as well — what tunerd waits for before a start —, `Popen`
  with the other value, first `/health` 200.

Prints every restart, the medians with min..max, and the overhead median(tunerd) / median(bare) - 1
against its target (≤ 5 %). vLLM's own start varies by several seconds between identical starts on a
loaded 2-core box: read the ranges before the ratio. Two unmeasured bare restarts first warm the compile
cache for both values (`--no-warm`: none; tunerd's copy starts at 8 and the bare one at 16, so both values
are compiled before anything is measured). ~2.5 min per repeat.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "daemon")]

from tests.engine.conftest import cache_env, make_small_model, real_sections  # noqa: E402
from tests.harness import Daemon, free_port  # noqa: E402
from tunerd.procfs.processes import pids_in_group  # noqa: E402
from tunerd.records.journal import parse_time  # noqa: E402

TARGET = 0.05


def wall(record: dict) -> float:
    return parse_time(record["time"]).timestamp()


def wait_health(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 600) -> float:
    """Wall time of the first /health 200 at `url`."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"vLLM exited with {proc.returncode}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return time.time()
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise SystemExit(f"{url} did not answer /health 200 in {timeout:.0f} s")


class Bare:
    """The plain script's vLLM: the argv tunerd spawned, on its own port."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv, self.env, self.log = argv, env, log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_s = self.group_gone_s = 0.0

    def start(self, seqs: int) -> None:
        argv = list(self.argv)
        argv[argv.index("--port") + 1] = str(self.port)
        argv[argv.index("--max-num-seqs") + 1] = str(seqs)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def stop(self) -> None:
        """SIGTERM to the process group; back when the API server has exited and every other process
        of the group (vLLM's engine core) is gone too, as tunerd waits before a start (`stop_s`,
        `group_gone_s`: the two moments, from the signal)."""
        if self.proc is not None and self.proc.poll() is None:
            began = time.monotonic()
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=120)
            self.stop_s = time.monotonic() - began
            # tunerd's own test for "the tree is gone" (zombies left out).
            while pids_in_group(self.proc.pid, include_zombies=False) and time.monotonic() - began < 120:
                time.sleep(0.02)
            self.group_gone_s = time.monotonic() - began

    def restart(self, seqs: int) -> float:
        began = time.time()
        self.stop()
        self.start(seqs)
        return wait_health(f"http://127.0.0.1:{self.port}", self.proc) - began


def tunerd_restart(daemon: Daemon, seqs: int) -> tuple[float, str]:
    mark = daemon.last_seq()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tunerd",
            "restart",
            "--set",
            f"max_num_seqs={seqs}",
            "--config",
            str(daemon.config_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise SystemExit(f"tunerd restart failed: {done.stdout}{done.stderr}")
    intent = daemon.wait_record(lambda r: r["event"] == "intent" and r["action"] == "change", after_seq=mark)
    stopped = daemon.wait_event("engine.stopped", after_seq=intent["seq"], timeout=120)
    serving = wait_health(f"http://127.0.0.1:{daemon.sections['engine']['port']}")
    ready = daemon.wait_event("engine.ready", after_seq=intent["seq"], timeout=600)
    spawned = daemon.wait_event("engine.spawned", after_seq=intent["seq"])
    split = (
        f"stop {stopped['seconds']:.2f} s, spawn {wall(spawned) - wall(stopped):.3f} s after it, "
        f"vLLM start {ready['seconds']:.1f} s"
    )
    return serving - wall(intent), split


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}..{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-warm",
        action="store_true",
        help="no warm-up starts (two fewer, run_all.sh --quick): tunerd's vLLM starts at 8, the bare copy at "
        "16, so each side's first restart goes to a value the other side's start compiled",
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="restart-cost-"))
    model = make_small_model(root / "small", quiet=False)
    cache = cache_env(root / "cache")
    first = {"tunerd": 8 if args.no_warm else 16, "bare": 16}
    sections = real_sections(
        model, cache, engine__params={"max_num_seqs": first["tunerd"], "kv_cache_memory_bytes": 16_000_000}
    )
    sections["tuning"] = {"mode": "off"}
    # The bare copy holds ~1.3 GiB that tunerd's memory-return gate, rightly, would wait for (it took its
    # baseline before that copy started: the first run of this bench waited out preflight.max_wait_s).
    sections["preflight"] = {"memory_tolerance_bytes": 4 << 30}
    sections["probe"] = {"enabled": False}
    (root / "tunerd").mkdir()
    daemon = Daemon(root / "tunerd", sections)
    print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; work dir {root}", flush=True
    )
    daemon.start()
    bare: Bare | None = None
    try:
        daemon.wait_state("RUNNING", timeout=900)
        spawned = [r for r in daemon.records() if r["event"] == "engine.spawned"][-1]
        bare = Bare(spawned["argv"], {**os.environ, **cache}, root / "bare.log")
        bare.start(first["bare"])
        wait_health(f"http://127.0.0.1:{bare.port}", bare.proc)
        # Both values' compile caches warm before anything is measured: the first start of a new
        # max_num_seqs compiles for its shapes (the first run of this bench measured tunerd's first
        # restart to 8 at 54 s against 43 s after), and it fell to whichever side restarted first.
        if args.no_warm:
            print(
                "  no warm-up: tunerd's vLLM started at 8 and the bare copy at 16 (both compiled)", flush=True
            )
        else:
            print("  warming the compile cache for max_num_seqs 8 and 16 (not measured)", flush=True)
            bare.restart(8)
            bare.restart(16)
        under, plain = [], []
        current = dict(first)
        for i in range(args.repeats):
            order = ("tunerd", "bare") if i % 2 == 0 else ("bare", "tunerd")
            for who in order:
                seqs = current[who] = {8: 16, 16: 8}[current[who]]  # each restart is a change
                if who == "tunerd":
                    cost, split = tunerd_restart(daemon, seqs)
                    under.append(cost)
                    print(f"  {i + 1} tunerd → max_num_seqs {seqs}: {cost:.2f} s ({split})", flush=True)
                else:
                    cost = bare.restart(seqs)
                    plain.append(cost)
                    print(
                        f"  {i + 1} bare   → max_num_seqs {seqs}: {cost:.2f} s (API server gone "
                        f"{bare.stop_s:.2f} s, its group {bare.group_gone_s:.2f} s after the SIGTERM)",
                        flush=True,
                    )
        overhead = statistics.median(under) / statistics.median(plain) - 1
        verdict = "PASS" if overhead <= TARGET else "MISS"
        print(f"decision → serving under tunerd: {spread(under)}")
        print(f"bare stop → serving:             {spread(plain)}")
        print(f"overhead {overhead:+.1%} (target ≤ {TARGET:.0%}: {verdict}); {args.repeats} repeats each")
        return 0
    finally:
        if bare is not None:
            bare.stop()
        daemon.stop(timeout=120)
        daemon.cleanup()


if __name__ == "__main__":
    sys.exit(main())
