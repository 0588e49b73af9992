#!/usr/bin/env python3
"""The goodput proof on this box (issue 23): requests answered within their targets, on the work people
do, for every contender measured in the same run on the same vLLM build and model.

    .venv/bin/python bench/goodput_proof.py [--quick] [--out docs/benchmarks/goodput.json] [--resume]
        [--order arrival|on_time_first] [--only WORKLOAD ...]

Real vLLM (CPU build), bench/tuner_vs_sweep.py's engine: the engine tier's "small" random-weight model in
float32, a 1,920-token KV cache (32 MB), max_model_len 512, so that the batch limits and the cache decide
what is served. Five seeded workloads (bench/workloads.py; `workloads`); their TTFT and TPOT targets and
the open loops' rates come from a rule fixed here before any run, applied to the box's speed as the run's
first vLLM start measures it (`calibrate`: absolute targets did not carry from an AVX-512 box to an
AVX2 one). Every figure is the clients' own (tests/load.py's clock).

Contenders:
- vLLM's defaults (no batch flag; the grid point (128, 2048));
- the grid sweep operators run: one bare vLLM start per `max_num_seqs` × `max_num_batched_tokens` point
  (5 × 4), all five workloads measured on each start one after the other, each scored by goodput;
- the best static door cap: one `tunerd run` with the defaults, tuning off, the door on, `tunerd door
  --max-in-flight N` for each cap in `CAPS` in turn, no restart (the oracle of the live knob);
- held on an open loop, for as long as tunerd ran there, each on a start of its own and judged at the end
  of that one load like tunerd: the best static cap, and vLLM's defaults (no cap) — the caps and the grid
  are judged on seconds 5–25 of a load from an empty queue, which flatters a configuration that serves
  about as fast as requests arrive;
- random search with tunerd's restarts, computed from the measured grid (the expected best of n points);
- tunerd from the defaults, `[objective] kind = "goodput"` at the workload's targets (the door steers its
  cap; the shipped rules, their `for_s` cut to 30 s, may start trials that restart vLLM) until it stops
  changing (no trial for `quiet_s`) or `tunerd_cap_s` passed; then measured for one window on the load
  that ran all along (its backlog included; once more on a fresh load like the others, `fresh`); on the
  closed loop also with `kind = "throughput"`.

Figures per contender and workload: goodput (good answers a second), attainment, throughput (answered
tokens a second), TTFT and TPOT p50/p95 as the clients measured them, preemptions a second (vLLM's
counter), vLLM restarts, minutes to the first feasible window (attainment ≥ `ATTAINMENT` over
`ROLLING_S` of answers) and minutes in all.

Results go to `--out` (JSON, saved after every point: `--resume` keeps what is there); bench/report.py
turns them into docs/benchmarks.md's goodput section and its plots. `--quick` (the defaults and one more
grid point, one cap, 5 s windows, each tunerd run cut to 40 s, one workload of each kind, shorter
answers) checks every path; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "daemon")]

from bench.tuner_vs_sweep import (  # noqa: E402
    DEFAULTS,
    EXTRA_ARGS,
    KV_BYTES,
    MAX_MODEL_LEN,
    Results,
    bare_vllm,
    bench_rules,
    machine,
    random_search,
    scrape,
)
from bench.workloads import Workload, rolling_attainment, window_figures  # noqa: E402
from tests.engine.conftest import cache_env, make_small_model, real_sections  # noqa: E402
from tests.harness import Daemon, free_port  # noqa: E402
from tests.load import ClosedLoopLoad, OpenLoopLoad  # noqa: E402

PROMPT_TOKENS = (16, 128)  # bench/tuner_vs_sweep.py's lengths: prompt + answer ≤ 320 of max_model_len 512
OUTPUT_TOKENS = (32, 192)
CLOSED_CLIENTS = 12
# The targets and the open loops' rates follow the box, by a rule fixed here before any run (2026-12-04):
# absolute targets fixed on one box do not carry to another. TTFT ≤ 4 s and TPOT ≤ 80 ms came from the
# 2026-12-02 sweep on an AVX-512 box (vLLM's ITL p95 0.05 s at 4 sequences, so one stream's TPOT at
# most about that; 12 closed-loop clients served 149-174 tok/s, about 1.3-1.6 answers/s at the answers'
# mean of 112 tokens). On the AVX2-only box of 2026-12-04 the same engine answered 18-37 tok/s through
# the door and no contender came near them (docs/benchmarks.md's notes). So the first vLLM start of a run
# measures the box (`calibrate`): one stream's TPOT p50 (T1) and the defaults' answers a second under the
# closed workload (R). Then, the factors giving the first targets at T1 = 40 ms and R = 1.3:
#   TPOT ≤ 2 × T1 (a batch may slow each stream to half its lone speed),
#   TTFT ≤ 100 × T1 (a whole answer of 192 tokens is ~190 × T1),
#   open-low at 0.3 × R and open-high at 0.85 × R: meant so that the defaults meet the light loads and
#   miss the heavy ones, as intended on the box the targets came from.
# Added 2026-12-05, after the rule's first full run (so not fixed before any run): open-mid at 0.55 × R.
# Open-high turned out to be about the capacity of the one configuration that meets the TPOT target
# (the door's cap 6 answered ~0.8/s held, 0.88 arriving), and held on one load for minutes neither it nor
# tunerd kept the targets: a rate with headroom for that configuration is where a cap can be judged.
TPOT_FACTOR, TTFT_FACTOR = 2.0, 100.0
OPEN_LOW, OPEN_MID, OPEN_HIGH = 0.3, 0.55, 0.85
CALIBRATION_S = 30.0  # each of the two calibration windows


def significant(value: float, digits: int = 2) -> float:
    """`value` rounded to `digits` significant digits: targets an operator would write."""
    return float(f"{value:.{digits}g}")


def workloads(calibration: dict[str, Any], s: Settings) -> tuple[Workload, ...]:
    """The five workloads with the targets and rates the calibration's rule gives, answers of
    `s.output_tokens`."""
    one = calibration["tpot_1_s"]
    shape: dict[str, Any] = {
        "ttft_s": significant(TTFT_FACTOR * one),
        "tpot_s": significant(TPOT_FACTOR * one),
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": s.output_tokens,
    }
    rate = calibration["closed_answers_per_s"]
    return (
        Workload("interactive", "interactive", clients=4, think_s=3.0, **shape),
        Workload("closed", "closed", clients=CLOSED_CLIENTS, **shape),
        Workload("open-low", "open", rate_per_s=significant(OPEN_LOW * rate), **shape),
        Workload("open-mid", "open", rate_per_s=significant(OPEN_MID * rate), **shape),
        Workload("open-high", "open", rate_per_s=significant(OPEN_HIGH * rate), **shape),
    )


THROUGHPUT_ON = "closed"  # the workload tunerd also tunes with kind = "throughput"
GRID = {"max_num_seqs": (4, 8, 12, 16, 128), "max_num_batched_tokens": (128, 256, 512, 2048)}
QUICK_GRID = {"max_num_seqs": (8, 128), "max_num_batched_tokens": (2048,)}
CAPS = (2, 4, 6, 8, 12, 16)
QUICK_CAPS = (8,)
ATTAINMENT = 0.95  # [objective] attainment's default: feasible at or above it
ROLLING_S = 30.0
SEED = 11


@dataclass(frozen=True)
class Settings:
    warmup_s: float  # after a start: compile and cache warm-up
    settle_s: float  # after a workload or a cap changes
    window_s: float
    grid: dict[str, tuple[int, ...]]
    caps: tuple[int, ...]
    tunerd_on: tuple[str, ...]  # workloads tunerd tunes for goodput
    quiet_s: float  # tunerd has stopped changing: no trial for this long …
    tunerd_cap_s: float  # … or this long since it served first
    held: tuple[str, ...]  # held beside tunerd's open loops: "held_cap" (the best cap), "held_defaults"
    order: str = "arrival"  # the door's queue order under a goodput objective ([door] order; `--order`)
    measured: tuple[str, ...] = ()  # the workloads measured (empty: all five)
    calibration_s: float = CALIBRATION_S
    output_tokens: tuple[int, int] = OUTPUT_TOKENS


# The full run's budget (issue 23: bench/run_all.sh under 2 hours on 2 cores): 20 s windows (one start's
# four workloads in ~2.5 minutes after it serves: ~3.5 min a grid point with its start, measured), tunerd
# on the workloads the defaults miss for up to 7 minutes each (the quick run took 18 min on a box that
# also ran the integration tests). With open-mid and the held contenders (2026-12-05) the full run
# outgrows the 2 hours: about 100 min for the first full run's parts, plus ~2 × 8 min of tunerd and
# ~4 × 7 min of holds. The quick run checks paths, not figures: it holds the best cap only, cuts tunerd's
# run to 40 s, measures one workload of each kind (each workload costs ~17 s on every start: settle,
# window, the load's drain), calibrates on 15 s windows and asks for answers of 16–64 tokens (a load stops
# after its requests in flight: up to 192 tokens at ~80 ms each). bench/run_all.sh --quick took 25:39
# with all five workloads, 90 s runs and full answers (the proof 17 min of it), 21:40 with three
# workloads and 60 s runs (13 min), against the 20 minutes for the whole (2026-12-05).
HELD = ("held_cap", "held_defaults")
FULL = Settings(15.0, 5.0, 20.0, GRID, CAPS, ("closed", "open-mid", "open-high"), 90.0, 420.0, HELD)
QUICK = Settings(
    10.0, 3.0, 5.0, QUICK_GRID, QUICK_CAPS, ("open-high",), 20.0, 40.0, HELD[:1],
    measured=("interactive", "closed", "open-high"), calibration_s=15.0, output_tokens=(16, 64),
)  # fmt: skip


def say(text: str) -> None:
    print(text, flush=True)


def key(point: dict[str, int] | None) -> str:
    point = point or {n: DEFAULTS[n] for n in GRID}
    return ",".join(f"{n}={point[n]}" for n in GRID)


# -- one measurement: a workload on a serving vLLM ------------------------------------------------------


def preemptions(url: str) -> float:
    with httpx.Client(timeout=10, trust_env=False) as client:
        return scrape(client, url).preemptions_total


def measure(
    base_url: str,
    metrics_url: str,
    model: str,
    workload: Workload,
    s: Settings,
    warmup_s: float,
    window_s: float | None = None,
) -> dict[str, Any]:
    """`workload` through `base_url` (vLLM or the door) for `warmup_s` then `window_s` (default
    `s.window_s`), judged on the clients' clock; preemptions from `metrics_url` (vLLM). The load is
    stopped and drained after."""
    load = workload.load(base_url, model, SEED).start()
    window = s.window_s if window_s is None else window_s
    return continuing_window(metrics_url, load, workload, window, after_s=warmup_s)[0]


def continuing_window(
    metrics_url: str,
    load: ClosedLoopLoad | OpenLoopLoad,
    workload: Workload,
    window_s: float,
    after_s: float = 0.0,
) -> tuple[dict[str, Any], list[Any], float]:
    """`window_s` more of `load` (which may have run all along), after `after_s` of it, then the load
    stopped and drained (also on an error): (the window's figures, judged on the clients' clock, with
    preemptions a second from `metrics_url`; every answer of the load; the window's end). A configuration
    that cannot drain the backlog its past let in is judged with it."""
    try:
        time.sleep(after_s)  # not a synchronisation: the measured window starts after it
        start, before = time.monotonic(), preemptions(metrics_url)
        time.sleep(window_s)
        end, after = time.monotonic(), preemptions(metrics_url)
    finally:
        stats = load.stop(timeout_s=300)
    figures = window_figures(stats.answers, workload, start, end)
    figures |= {"preemptions_per_s": (after - before) / (end - start), "errors": len(stats.errors)}
    return figures, stats.answers, end


def line(f: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1e3:.0f}"

    att = "n/a" if f["attainment"] is None else f"{f['attainment']:.0%}"
    return (
        f"goodput {f['goodput']:.2f}/s, attainment {att}, {f['throughput']:.0f} tok/s, TTFT p50/p95 "
        f"{ms(f['ttft_p50'])}/{ms(f['ttft_p95'])} ms, TPOT {ms(f['tpot_p50'])}/{ms(f['tpot_p95'])} ms, "
        f"{f['preemptions_per_s']:.2f} preempt/s"
    )


# -- the box, measured first: the targets' rule reads it ----------------------------------------------------


def calibrate(
    model: Path, cache: dict[str, str], s: Settings, results: Results, work: Path
) -> dict[str, Any]:
    """One bare start at vLLM's defaults: one stream's TPOT p50 and the closed workload's answers a second
    (`s.calibration_s` each, no targets), kept in the results (`--resume` reuses them). On the same start,
    when the grid holds vLLM's defaults and they are not measured yet, the grid's defaults point (one
    vLLM start fewer in the sweep)."""
    if "calibration" in results.data:
        return results.data["calibration"]
    say("calibration: one stream, then the closed workload, at vLLM's defaults (bare)")
    unjudged: dict[str, Any] = {
        "ttft_s": math.inf,
        "tpot_s": math.inf,
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": s.output_tokens,
    }
    lone = Workload("one stream", "closed", clients=1, **unjudged)
    busy = Workload("closed", "closed", clients=CLOSED_CLIENTS, **unjudged)
    began = time.monotonic()
    with bare_vllm(model, cache, None, work / "vllm-calibrate.log") as url:
        ready = time.monotonic() - began
        one = measure(url, url, str(model), lone, s, s.warmup_s, s.calibration_s)
        closed = measure(url, url, str(model), busy, s, s.settle_s, s.calibration_s)
        calibration = calibrated(one, closed)
        results.data["calibration"] = calibration
        results.save()
        defaults = {n: DEFAULTS[n] for n in GRID}
        if defaults in grid_points(s.grid) and key(defaults) not in results.data.get("grid", {}):
            # The grid's defaults point is this start's configuration: a start of its own would repeat it.
            say("the grid's defaults point, on the calibration's start")
            measure_point(
                url, model, defaults, ready, chosen(workloads(calibration, s), s), s, results, "defaults"
            )
    return calibration


def calibrated(one: dict[str, Any], closed: dict[str, Any]) -> dict[str, Any]:
    """The calibration from one stream's and the closed workload's windows (SystemExit: too few answers)."""
    if one["tpot_p50"] is None or not closed["answered"]:
        raise SystemExit(
            f"calibration: too few answers to measure the box (one stream {one}, closed {closed})"
        )
    calibration = {
        "tpot_1_s": one["tpot_p50"],
        "closed_answers_per_s": closed["answered"] / closed["seconds"],
        "one_stream": one,
        "closed": closed,
        "rule": (
            f"TPOT ≤ {TPOT_FACTOR:g} × T1, TTFT ≤ {TTFT_FACTOR:g} × T1, "
            f"open at {OPEN_LOW:g}, {OPEN_MID:g} and {OPEN_HIGH:g} × R"
        ),
    }
    say(f"  one stream: {line(one)}")
    say(f"  closed ({CLOSED_CLIENTS} clients): {line(closed)}")
    return calibration


def chosen(ws: tuple[Workload, ...], s: Settings) -> tuple[Workload, ...]:
    """The workloads `s` measures."""
    return tuple(w for w in ws if not s.measured or w.name in s.measured)


# -- the grid sweep (vLLM's defaults are its point (128, 2048), started without the flags) ----------------


def grid_points(grid: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    return [{"max_num_seqs": a, "max_num_batched_tokens": b} for a in grid["max_num_seqs"] for b in grid[
        "max_num_batched_tokens"]]  # fmt: skip


def sweep(
    model: Path, cache: dict[str, str], s: Settings, results: Results, work: Path, ws: tuple[Workload, ...]
) -> None:
    points = grid_points(s.grid)
    grid = results.data.setdefault("grid", {})
    say(f"the grid sweep: {len(points)} points, {len(ws)} workloads on each start")
    for number, point in enumerate(points, 1):
        if key(point) in grid:
            continue
        began = time.monotonic()
        flags = None if point == {n: DEFAULTS[n] for n in GRID} else point
        with bare_vllm(model, cache, flags, work / "vllm-grid.log") as url:
            ready = time.monotonic() - began
            measure_point(url, model, point, ready, ws, s, results, f"{number}/{len(points)}")


def measure_point(
    url: str, model: Path, point: dict[str, int], ready: float, ws: tuple[Workload, ...], s: Settings,
    results: Results, label: str,
) -> None:  # fmt: skip
    """Every workload of `ws` in turn on the bare vLLM at `url`, started with `point` `ready` seconds ago,
    kept as the grid's point (`point_s`: the start and the workloads, what the point costs a sweep)."""
    began = time.monotonic()
    figures = {}
    for index, w in enumerate(ws):
        figures[w.name] = measure(url, url, str(model), w, s, s.warmup_s if index == 0 else s.settle_s)
        say(f"  [{label}] {key(point)} {w.name}: {line(figures[w.name])}")
    point_s = ready + time.monotonic() - began
    point_figures = {"params": point, "start_s": ready, "point_s": point_s, **figures}
    results.data.setdefault("grid", {})[key(point)] = point_figures
    results.save()


# -- the static door cap on one start --------------------------------------------------------------------


def daemon_sections(
    model: Path, cache: dict[str, str], s: Settings, objective: dict[str, Any], tuning: dict[str, Any]
) -> dict[str, Any]:
    """tunerd on the grid's engine: vLLM's defaults (no batch flag), the door on."""
    bounds = {n: [min(v), max(v)] for n, v in s.grid.items()}
    sections = real_sections(
        model,
        cache,
        timeouts={"startup_s": 900.0},
        tuning={"warmup_s": s.warmup_s, "min_serving_s": 0.0, "bounds": bounds, **tuning},
        probe={"enabled": False},
        door={"enabled": True, "port": free_port()},
        objective=objective,
    )
    sections["engine.params"] = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_BYTES}
    sections["engine"]["extra_args"] = EXTRA_ARGS
    if objective.get("kind") == "goodput":  # the order judges lateness by the TTFT target
        sections["door"]["order"] = s.order
    return sections


def goodput_objective(w: Workload) -> dict[str, Any]:
    return {"kind": "goodput", "ttft_s": w.ttft_s, "tpot_s": w.tpot_s, "attainment": ATTAINMENT}


def urls(daemon: Daemon) -> tuple[str, str]:
    """(the door, vLLM)."""
    return (
        f"http://127.0.0.1:{daemon.sections['door']['port']}",
        f"http://127.0.0.1:{daemon.sections['engine']['port']}",
    )


def caps(
    model: Path, cache: dict[str, str], s: Settings, results: Results, work: Path, ws: tuple[Workload, ...]
) -> None:
    """Every cap of `s.caps` (and none) under every workload not measured yet, on one start: no restart."""
    done = results.data.setdefault("caps", {})
    ws = tuple(w for w in ws if w.name not in done)
    if not ws:
        return
    say(f"the static door cap on one start: caps {', '.join(map(str, s.caps))} and none")
    sections = daemon_sections(model, cache, s, goodput_objective(ws[0]), {"mode": "off"})
    sections["door"]["max_in_flight"] = max(s.caps)  # pinned from the start: the controller never steers
    (work / "caps").mkdir(parents=True, exist_ok=True)
    daemon = Daemon(work / "caps", sections)
    daemon.start()
    try:
        daemon.wait_state("RUNNING", timeout=900)
        door, vllm = urls(daemon)
        first = True
        for w in ws:
            rows: dict[str, Any] = {}
            for cap in (None, *s.caps):
                daemon.cli("door", "--max-in-flight", "none" if cap is None else str(cap))
                rows[str(cap)] = measure(door, vllm, str(model), w, s, s.warmup_s if first else s.settle_s)
                first = False
                say(f"  {w.name} cap {cap}: {line(rows[str(cap)])}")
            done[w.name] = rows
            results.save()
    finally:
        daemon.stop(timeout=120)
        daemon.cleanup()


# -- tunerd from the defaults ------------------------------------------------------------------------------


def engine_starts(daemon: Daemon) -> list[dict[str, Any]]:
    return [r for r in daemon.records() if r["event"] == "engine.ready"]


# A journal event that is a change tunerd made: the run has not stopped changing while they come.
CHANGES = ("trial.", "engine.ready", "door.curve.", "door.max_in_flight", "explore.")


def door_cap(daemon: Daemon) -> tuple[int | None, bool]:
    """(the door's cap now, a trial is running), from `tunerd status`."""
    status = daemon.status()
    return (status.get("door") or {}).get("max_in_flight"), bool((status.get("tuning") or {}).get("trial"))


def tunerd_run(
    model: Path,
    cache: dict[str, str],
    s: Settings,
    w: Workload,
    objective: dict[str, Any],
    work: Path,
    save: Callable[[dict[str, Any]], None],
) -> None:
    """tunerd from vLLM's defaults under `w` until it stops changing; then one window more of the same load
    (`final`), and `w` measured once more on a fresh load (`fresh`)."""
    work.mkdir(parents=True, exist_ok=True)
    # The shipped rules, their for_s cut to 30 s so that they act within the run, the TTFT rule's target
    # set to the workload's (as the rule's comment asks an operator to): bench/tuner_vs_sweep.py's.
    rules = bench_rules(work, w.ttft_s)
    daemon = Daemon(work, daemon_sections(model, cache, s, objective, {"mode": "auto", "rules": str(rules)}))
    daemon.start()
    load: ClosedLoopLoad | OpenLoopLoad | None = None
    result: dict[str, Any] = {"objective": objective}
    try:
        daemon.wait_state("RUNNING", timeout=900)
        door, vllm = urls(daemon)
        load = w.load(door, str(model), SEED).start()
        began, began_wall = time.monotonic(), time.time()
        last_change, seen, cap_trace = began, 0, []
        # Until nothing changed for quiet_s — no trial, restart, curve or cap move (the steered cap is
        # journaled at most every 30 s, so the cap is read from the status too) — or the cap of time.
        while (now := time.monotonic()) - began < s.tunerd_cap_s:
            for record in daemon.records():
                if record["seq"] > seen:
                    seen = record["seq"]
                    if record["event"].startswith(CHANGES):
                        last_change = now
            cap, trial = door_cap(daemon)
            if cap_trace and cap != cap_trace[-1][1]:
                last_change = now
            cap_trace.append((round(now - began, 1), cap))
            if not trial and now - last_change >= s.quiet_s:
                break
            time.sleep(2.0)  # a look at the daemon, not a synchronisation
        ended = time.monotonic()
        # The final window on the load that ran all along, backlog included. A fresh load (the `fresh`
        # figure, the only one before 2026-12-05) hid it: the re-measured proof's tunerd missed every
        # request from 1.5 min on and its fresh window scored 78 % (docs/benchmarks.md).
        daemon.wait_state("RUNNING", timeout=900)
        final, answers, end = continuing_window(vllm, load, w, s.window_s)
        load = None
        fresh = measure(door, vllm, str(model), w, s, s.settle_s)
        ready = engine_starts(daemon)
        series = rolling_attainment(answers, w, began, end, ROLLING_S, 5.0)
        feasible = next((t for t, a, _, _ in series if a is not None and a >= ATTAINMENT), None)
        result |= {
            "final": final,
            "fresh": fresh,
            "restarts": len(ready) - 1,
            "params": ready[-1]["params"],
            "minutes": (ended - began) / 60,
            "minutes_to_feasible": None if feasible is None else feasible / 60,
            "series": series,
            "caps": cap_trace,  # (seconds since the load began, the door's cap; None: no cap)
            "restarts_at": [r["time"] for r in ready[1:]],
            "began": began_wall,
            "trials": [r for r in daemon.records() if r["event"] in ("trial.started", "trial.ended")],
        }
        say(
            f"  tunerd {objective['kind']} on {w.name}: {len(ready) - 1} restarts, "
            f"{result['minutes']:.1f} min, feasible after {result['minutes_to_feasible']} min; {line(final)}"
            f"\n    on a fresh load: {line(fresh)}"
        )
    finally:
        if load is not None:
            load.stop(timeout_s=60)
        save(result)
        daemon.stop(timeout=120)
        daemon.cleanup()


def tunerd_all(
    model: Path, cache: dict[str, str], s: Settings, results: Results, root: Path, ws: tuple[Workload, ...]
) -> None:
    runs = results.data.setdefault("tunerd", {})
    todo = [(w, goodput_objective(w), w.name) for w in ws if w.name in s.tunerd_on]
    todo += [(w, {"kind": "throughput"}, f"{w.name} (throughput)") for w in ws if w.name == THROUGHPUT_ON]
    for w, objective, name in todo:
        if runs.get(name, {}).get("final"):
            continue
        say(f"tunerd from the defaults, {objective['kind']}, under {w.name}")

        def save(result: dict[str, Any], name: str = name) -> None:
            runs[name] = result
            results.save()

        tunerd_run(model, cache, s, w, objective, root / f"tunerd-{len(runs)}", save)


# -- the best static cap, held as long as tunerd ran ---------------------------------------------------------


def hold(
    model: Path, cache: dict[str, str], s: Settings, w: Workload, cap: str, seconds: float, work: Path
) -> dict[str, Any]:
    """The door's cap pinned at `cap` ("None": no cap, vLLM's defaults behind the door) on a start of its
    own, under one load of `w` for `seconds`, then judged like tunerd's end: one window more of the same
    load, with the backlog it carries."""
    work.mkdir(parents=True, exist_ok=True)
    sections = daemon_sections(model, cache, s, goodput_objective(w), {"mode": "off"})
    sections["door"]["max_in_flight"] = max(s.caps)  # pinned from the start, as in `caps`
    daemon = Daemon(work, sections)
    daemon.start()
    load: ClosedLoopLoad | OpenLoopLoad | None = None
    try:
        daemon.wait_state("RUNNING", timeout=900)
        daemon.cli("door", "--max-in-flight", "none" if cap == "None" else cap)
        door, vllm = urls(daemon)
        load = w.load(door, str(model), SEED).start()
        began = time.monotonic()
        time.sleep(seconds)  # as long as tunerd's run: not a synchronisation
        final, answers, end = continuing_window(vllm, load, w, s.window_s)
        load = None
        series = rolling_attainment(answers, w, began, end, ROLLING_S, 5.0)
        feasible = next((t for t, a, _, _ in series if a is not None and a >= ATTAINMENT), None)
        return {
            "cap": cap,
            "final": final,
            "minutes": seconds / 60,
            "minutes_to_feasible": None if feasible is None else feasible / 60,
            "series": series,
        }
    finally:
        if load is not None:
            load.stop(timeout_s=60)
        daemon.stop(timeout=120)
        daemon.cleanup()


def held_caps(
    model: Path, cache: dict[str, str], s: Settings, results: Results, root: Path, ws: tuple[Workload, ...]
) -> None:
    """Per open loop tunerd tuned for goodput: its best static cap (`caps`) and vLLM's defaults (no cap),
    each held (`hold`) for as long as tunerd's run. `caps` judges each cap on 25 s of a load started
    afresh, which flatters a cap that serves about as fast as requests arrive: a backlog builds over
    minutes, not seconds. (A closed loop builds none: its clients wait for their answers.)"""
    for w in [w for w in ws if w.kind == "open" and w.name in s.tunerd_on]:
        rows = results.data.get("caps", {}).get(w.name)
        run = results.data.get("tunerd", {}).get(w.name) or {}
        if not rows or not run.get("final"):
            continue
        best = max(rows, key=lambda c: rows[c]["goodput"])  # "None": no cap
        seconds = run["minutes"] * 60
        for name, cap in (("held_cap", best), ("held_defaults", "None")):
            held = results.data.setdefault(name, {})
            if name not in s.held or w.name in held or (name == "held_defaults" and best == "None"):
                continue
            if cap == "None" and s.order != "arrival":
                continue  # with no cap nothing waits in the door: the order changes nothing
            say(f"{w.name}: cap {cap} held for {seconds / 60:.1f} min (tunerd's run) on a start of its own")
            held[w.name] = hold(model, cache, s, w, cap, seconds, root / f"{name}-{w.name}")
            results.save()
            say(f"  cap {cap} held on {w.name}: {line(held[w.name]['final'])}")


# -- the comparison --------------------------------------------------------------------------------------


def compare(results: Results, ws: tuple[Workload, ...]) -> dict[str, Any]:
    """Per workload: the best of each contender and tunerd's ratio to the best."""
    data = results.data
    summary: dict[str, Any] = {}
    for w in ws:
        grid = {k: p[w.name] for k, p in data.get("grid", {}).items() if w.name in p}
        caps = data.get("caps", {}).get(w.name, {})
        run = data.get("tunerd", {}).get(w.name, {})
        row: dict[str, Any] = {"defaults": grid.get(key(None))}
        if grid:
            best = max(grid, key=lambda k: grid[k]["goodput"])
            row["sweep"] = {"point": best, "restarts": len(grid), **grid[best]}
        if caps:
            best_cap = max(caps, key=lambda c: caps[c]["goodput"])
            row["static_cap"] = {"cap": best_cap, "restarts": 0, **caps[best_cap]}
        for name in ("held_cap", "held_defaults"):
            if held := data.get(name, {}).get(w.name):
                row[name] = {"cap": held["cap"], "restarts": 0, "minutes": held["minutes"], **held["final"]}
        if run.get("final"):
            row["tunerd"] = {**run["final"], "restarts": run["restarts"], "params": run["params"]}
            if grid:
                scores = [g["goodput"] for g in grid.values()]
                row["random"] = random_search(scores, max(1, run["restarts"]), run["final"]["goodput"])
        summary[w.name] = row
    data["summary"] = summary
    results.save()
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every path, in minutes (not for docs/)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "goodput.json")
    parser.add_argument("--resume", action="store_true", help="keep the points already in --out")
    parser.add_argument(
        "--order",
        choices=("arrival", "on_time_first"),
        default="arrival",
        help="the door's queue order under the goodput objective ([door] order) in every tunerd run and cap",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="WORKLOAD",
        help="measure tunerd, the caps and the holds under these workloads only, and no grid (with --resume)",
    )
    args = parser.parse_args()
    s = replace(QUICK if args.quick else FULL, order=args.order)
    root = Path(tempfile.mkdtemp(prefix="goodput-proof-"))
    model = make_small_model(root / "small", quiet=True)
    cache = cache_env(root / "cache")
    results = Results(
        args.out,
        {
            "resume": args.resume,
            "quick": args.quick,
            "machine": machine(),
            "settings": {**s.__dict__, "attainment": ATTAINMENT, "rolling_s": ROLLING_S, "seed": SEED},
            "engine": {"kv_cache_bytes": KV_BYTES, "max_model_len": MAX_MODEL_LEN, "extra_args": EXTRA_ARGS},
            "vllm_defaults": {n: DEFAULTS[n] for n in GRID},
        },
    )
    if results.data.setdefault("door_order", s.order) != s.order:
        raise SystemExit(
            f"{args.out}: measured with --order {results.data['door_order']}: not mixed with {s.order}"
        )
    say(f"{results.data['machine']}; work dir {root}")
    began = time.monotonic()
    ws = chosen(workloads(calibrate(model, cache, s, results, root), s), s)
    results.data["workloads"] = [w.as_dict() for w in ws]
    for w in ws:
        say(f"  {w.name}: {w.describe()}")
    measured = tuple(w for w in ws if not args.only or w.name in args.only)
    tunerd_all(model, cache, s, results, root, measured)  # first after the box: the most likely to fail
    caps(model, cache, s, results, root, measured)
    held_caps(model, cache, s, results, root, measured)
    if not args.only:  # a grid start measures every workload
        sweep(model, cache, s, results, root, ws)
    summary = compare(results, ws)
    for name, row in summary.items():
        say(f"{name}:")
        for contender in ("defaults", "sweep", "static_cap", "held_defaults", "held_cap", "tunerd"):
            if row.get(contender):
                say(f"  {contender}: {line(row[contender])}")
        if row.get("random"):
            r = row["random"]
            say(f"  random search at {r['n']} restarts: expected best goodput {r['expected_best']:.2f}/s")
    say(f"done in {(time.monotonic() - began) / 60:.0f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
