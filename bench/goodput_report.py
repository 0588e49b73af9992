"""docs/benchmarks.md's goodput section and its two plots, from bench/goodput_proof.py's results.

`section(data, out, link)` returns the markdown lines: the workloads and their targets, a table per
workload with every contender's figures as the clients measured them, each of issue 23's targets with
PASS or MISS and by how much. Plots (PNG, in `out`): `goodput_by_config.png` — goodput of every grid
point and every static cap on the same axes, tunerd's configurations marked; `goodput_run.png` (the
busiest open loop; `goodput_run-NAME.png` the others) — a tunerd run over time: attainment, goodput,
throughput and the door's cap, restarts marked, the held caps' attainment beside it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CONTENDERS = (
    ("defaults", "vLLM's defaults"),
    ("sweep", "grid sweep, best"),
    ("static_cap", "static door cap, best"),
    ("tunerd", "tunerd (goodput)"),
)
ONE_THIRD = 1 / 3
WITHIN = 0.95


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:,.0f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _row(label: str, f: dict[str, Any], extra: str = "") -> str:
    return (
        f"| {label} | {f['goodput']:.2f} | {_pct(f['attainment'])} | {f['throughput']:.0f} | "
        f"{_ms(f['ttft_p50'])} / {_ms(f['ttft_p95'])} | {_ms(f['tpot_p50'])} / {_ms(f['tpot_p95'])} | "
        f"{f['preemptions_per_s']:.2f} | {extra} |"
    )


def _where(name: str, f: dict[str, Any], run: dict[str, Any] | None) -> str:
    if name == "sweep":
        return f"{f['point']}; {f['restarts']} starts"
    if name == "static_cap":
        return f"cap {f['cap']}; 0 restarts"
    if name == "tunerd" and run:
        feasible = run.get("minutes_to_feasible")
        first = "never feasible" if feasible is None else f"feasible after {feasible:.1f} min"
        params = ", ".join(f"{k} {v}" for k, v in sorted(run["params"].items()) if "num" in k) or "defaults"
        mean = run_mean(run)
        over = f"; {mean:.2f}/s over the run" if mean is not None else ""
        return f"{params}; {run['restarts']} restarts; {first}; {run['minutes']:.1f} min{over}"
    return ""


def _cap(cap: str) -> str:
    return "no cap: vLLM's defaults" if cap == "None" else f"cap {cap}"


def run_mean(run: dict[str, Any] | None) -> float | None:
    """Mean goodput of a run on one load (tunerd's or a held cap's) over its 30 s windows that do not
    overlap, from its first minute on (a run's start is the controller's walk, or vLLM's warm-up)."""
    if not run or not run.get("series"):
        return None
    windows = [g for t, _, g, _ in run["series"] if t >= 60 and round(t) % 30 == 0]
    return sum(windows) / len(windows) if windows else None


def _targets(
    name: str, row: dict[str, Any], run: dict[str, Any] | None, held_run: dict[str, Any] | None = None
) -> list[str]:
    """Issue 23's targets for one workload, PASS or MISS with the margin."""
    tunerd = row.get("tunerd")
    if not tunerd:
        return [f"- {name}: no tunerd run measured."]
    lines = []
    rivals = [(row[c]["goodput"], label) for c, label in CONTENDERS[:3] if row.get(c)]
    if rivals:
        best, label = max(rivals)
        ratio = tunerd["goodput"] / best if best else float("nan")
        verdict = "PASS" if ratio >= WITHIN else "MISS"
        lines.append(
            f"- {name}: tunerd's goodput {tunerd['goodput']:.2f}/s is {ratio:.2f}× the best contender's "
            f"({label}, {best:.2f}/s), target ≥ {WITHIN}: **{verdict}**."
        )
    sweep = row.get("sweep")
    if sweep:
        verdict = "PASS" if tunerd["restarts"] <= sweep["restarts"] * ONE_THIRD else "MISS"
        lines.append(
            f"- {name}: {tunerd['restarts']} restarts against the sweep's {sweep['restarts']} starts, target "
            f"≤ a third ({sweep['restarts'] * ONE_THIRD:.1f}): **{verdict}**."
        )
    rand = row.get("random")
    if rand:
        verdict = "PASS" if tunerd["goodput"] > rand["expected_best"] else "MISS"
        lines.append(
            f"- {name}: random search with {rand['n']} restart(s), expected best "
            f"{rand['expected_best']:.2f}/s (beats tunerd with chance {rand['chance_beats_tunerd']:.0%}): "
            f"**{verdict}**."
        )
    held = row.get("held_cap")
    if held:
        mine, theirs = run_mean(run), run_mean(held_run)
        alike = (
            f"- {name}: judged alike, the best static cap ({_cap(held['cap'])}) held on one load as long as "
            f"tunerd ran ({held['minutes']:.1f} min): its last window {held['goodput']:.2f}/s "
            f"({_pct(held['attainment'])}) against tunerd's {tunerd['goodput']:.2f}/s; "
        )
        if mine is not None and theirs:
            ratio = mine / theirs
            verdict = "PASS" if ratio >= WITHIN else "MISS"
            lines.append(
                f"{alike}over the run (30 s windows from its first minute on) {theirs:.2f}/s against "
                f"tunerd's {mine:.2f}/s: tunerd {ratio:.2f}× that, target ≥ {WITHIN}: **{verdict}**."
            )
        else:
            lines.append(
                f"{alike}over the run {theirs or 0:.2f}/s against {mine or 0:.2f}/s: no ratio to take."
            )
    cap = row.get("static_cap")
    sustained = held is None or (held["attainment"] or 0) >= WITHIN
    if cap and cap["attainment"] is not None and cap["attainment"] >= WITHIN and run and not sustained:
        lines.append(
            f"- {name}: the cap alone met the targets in a window from an empty queue (cap {cap['cap']}) but "
            f"not held on one load ({_pct(held['attainment'] if held else None)}): no configuration measured "
            "here sustains them, so the target of '< 2 min, 0 restarts' has nothing to reach."
        )
    elif cap and cap["attainment"] is not None and cap["attainment"] >= WITHIN and run:
        feasible = run.get("minutes_to_feasible")
        ok = feasible is not None and feasible < 2 and run["restarts"] == 0
        when = "never" if feasible is None else f"{feasible:.1f} min"
        lines.append(
            f"- {name}: the cap alone meets the targets (cap {cap['cap']}); tunerd feasible after {when} "
            f"with {run['restarts']} restarts, target < 2 min and 0 restarts: **{'PASS' if ok else 'MISS'}**."
        )
    return lines


def section(data: dict[str, Any], out: Path, link: str) -> list[str]:
    """The goodput section's markdown; draws its plots into `out`."""
    m, s = data["machine"], data["settings"]
    quick = " (**--quick**: a check of the paths, not a result)" if data.get("quick") else ""
    lines = [
        f"## Goodput under latency targets (`bench/goodput_proof.py`){quick}",
        "",
        f"{m['date']}, {m['cpu']} ({m['cpus']} CPUs, {m['memory_gib']} GiB), vLLM {m['vllm']}, the small "
        f"model in float32 with a {data['engine']['kv_cache_bytes'] / 1e6:.0f} MB KV cache. Every figure "
        f"is the clients' own (the load generator's clock): a request is good when it met both targets; "
        f"goodput = good answers a second over a {s['window_s']:.0f} s window after "
        f"{s['warmup_s']:.0f} s of warm-up; feasible = attainment ≥ {s['attainment']:.0%}; the door's "
        f"queue order: {data.get('door_order', 'arrival').replace('_', ' ')}.",
        "",
        "| workload | load | TTFT target | TPOT target |",
        "|---|---|---|---|",
    ]
    for w in data["workloads"]:
        shape = {
            "open": f"Poisson, {w['rate_per_s']:g} req/s",
            "closed": f"{w['clients']} closed-loop clients",
            "interactive": f"{w['clients']} clients, think ~{w['think_s']:g} s",
        }[w["kind"]]
        lines.append(f"| {w['name']} | {shape} | {w['ttft_s']:g} s | {w['tpot_s'] * 1e3:g} ms |")
    cal = data.get("calibration")
    if cal:
        lines += [
            "",
            f"The targets and rates, by the rule fixed before the run ({cal['rule']}), from this box "
            f"measured at vLLM's defaults on the run's first start: one stream's TPOT p50 T1 = "
            f"{cal['tpot_1_s'] * 1e3:.0f} ms, R = {cal['closed_answers_per_s']:.2f} answers/s under the "
            "closed workload.",
        ]
    first = data["workloads"][0]
    lines += [
        "",
        f"Prompts {first['prompt_tokens']} tokens, answers {first['output_tokens']}, drawn per request "
        f"from seed {s['seed']}.",
        "",
    ]
    summary = data.get("summary", {})
    for name in [w["name"] for w in data["workloads"] if w["name"] in summary]:
        row = summary[name]
        run = data.get("tunerd", {}).get(name)
        lines += [
            f"### {name}",
            "",
            "| contender | goodput (req/s) | attainment | tok/s | TTFT p50 / p95 (ms) | TPOT p50 / p95 (ms) "
            "| preempt/s | configuration, cost |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for contender, label in CONTENDERS:
            f = row.get(contender)
            if f:
                lines.append(_row(label, f, _where(contender, f, run)))
        if run and run.get("fresh"):  # the same configuration on a fresh load: no backlog carried in
            lines.append(_row("tunerd (goodput), its end on a fresh load", run["fresh"], "not ranked"))
        for key in ("held_defaults", "held_cap"):
            if held := row.get(key):
                label = f"{_cap(held['cap'])}, held {held['minutes']:.1f} min"
                mean = run_mean(data.get(key, {}).get(name))
                extra = "one load as long as tunerd's run, its last window" + (
                    f"; {mean:.2f}/s over the run" if mean is not None else ""
                )
                lines.append(_row(label, held, extra))
        throughput_run = data.get("tunerd", {}).get(f"{name} (throughput)")
        if throughput_run and throughput_run.get("final"):
            lines.append(
                _row("tunerd (throughput)", throughput_run["final"], _where("tunerd", {}, throughput_run))
            )
        if row.get("random"):
            r = row["random"]
            lines.append(
                f"| random search, {r['n']} restart(s) | {r['expected_best']:.2f} (expected best) "
                "| | | | | | computed from the grid |"
            )
        lines += ["", *_targets(name, row, run, data.get("held_cap", {}).get(name)), ""]
    plot_by_config(data, out / "goodput_by_config.png")
    lines += [f"![goodput by configuration]({link}/goodput_by_config.png)", ""]
    for name in runs_to_plot(data):  # the busiest workload's as goodput_run.png, the others' beside it
        file = "goodput_run.png" if name == runs_to_plot(data)[-1] else f"goodput_run-{name}.png"
        plot_run(data, name, out / file)
        lines += [f"![tunerd's run under {name} over time]({link}/{file})", ""]
    return lines


def order_section(data: dict[str, Any], main: dict[str, Any] | None, out: Path, link: str) -> list[str]:
    """A run of `bench/goodput_proof.py --order on_time_first --only …` (its results beside goodput.json):
    tunerd and the held cap under each workload it measured, beside the same contenders in arrival order
    (`main`), and its run plots."""
    main = main or {}
    names = [
        w["name"] for w in data["workloads"] if (data.get("tunerd", {}).get(w["name"]) or {}).get("final")
    ]
    began = min(data["tunerd"][n]["began"] for n in names) if names else None
    when = datetime.fromtimestamp(began, UTC).strftime("%Y-%m-%d %H:%M UTC") if began else "not run"
    lines = [
        "## The door's queue order: on time first (`bench/goodput_proof.py --order on_time_first`)",
        "",
        f"{when}; the same box, calibration, targets and workloads as above. tunerd and the best static cap, "
        'each on a start of its own, with `[door] order = "on_time_first"`: a request that has waited its '
        "TTFT target goes after those that can still meet it. The rows in arrival order are the tables' "
        "above. Every figure is the last 20 s window of one load that ran all along, but the last "
        "column's: the mean goodput of its 30 s windows from the first minute on.",
        "",
    ]
    for name in names:
        lines += [
            f"### {name}",
            "",
            "| contender | order | goodput (req/s) | attainment | tok/s | TTFT p50 / p95 (ms) "
            "| TPOT p50 / p95 (ms) | preempt/s | held for; goodput over the run |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        orders = (("on time first", data), ("arrival", main))
        for order, source in orders:
            run = (source.get("tunerd") or {}).get(name) or {}
            if run.get("final"):
                extra = f"{run['minutes']:.1f} min; {run_mean(run) or 0:.2f}/s"
                lines.append(_row(f"tunerd (goodput) | {order}", run["final"], extra))
        for order, source in orders:
            if held := (source.get("held_cap") or {}).get(name):
                extra = f"{held['minutes']:.1f} min; {run_mean(held) or 0:.2f}/s"
                lines.append(_row(f"{_cap(held['cap'])} | {order}", held["final"], extra))
        file = f"goodput_run-{name}-on-time-first.png"
        plot_run(data, name, out / file)
        lines += ["", f"![tunerd's run under {name}, on time first]({link}/{file})", ""]
    return lines


def plot_by_config(data: dict[str, Any], path: Path) -> None:
    """Per workload: the grid's goodput by max_num_seqs (a line per max_num_batched_tokens), the static
    caps' goodput by cap on the same axis (concurrency), the best cap held on a continuing load as a hollow
    square, tunerd's final configuration as a star (at the door's cap when it bound)."""
    names = [w["name"] for w in data["workloads"]]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4), sharey=False, squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        by_batched: dict[int, list[tuple[int, float]]] = {}
        for point in data.get("grid", {}).values():
            if name in point:
                p = point["params"]
                by_batched.setdefault(p["max_num_batched_tokens"], []).append(
                    (p["max_num_seqs"], point[name]["goodput"])
                )
        for batched, pts in sorted(by_batched.items()):
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", linewidth=1, label=f"grid, batched {batched}")
        caps = data.get("caps", {}).get(name, {})
        capped = sorted((int(c), f["goodput"]) for c, f in caps.items() if c != "None")
        if capped:
            xs, ys = zip(*capped, strict=True)
            ax.plot(xs, ys, color="black", linestyle="--", marker="s", label="door cap, one start")
        if "None" in caps:
            ax.axhline(caps["None"]["goodput"], color="grey", linewidth=0.8, label="no cap")
        run = data.get("tunerd", {}).get(name)
        if held := data.get("held_cap", {}).get(name):
            ax.plot([int(held["cap"]) if held["cap"] != "None" else 128], [held["final"]["goodput"]],
                    marker="s", markersize=9, markerfacecolor="none", color="black", linestyle="",
                    label=f"cap held {held['minutes']:.0f} min")  # fmt: skip
        if run and run.get("final"):
            # Where it ended: the door's cap when it bound below max_num_seqs, else max_num_seqs.
            seqs = run["params"].get("max_num_seqs", data["vllm_defaults"]["max_num_seqs"])
            cap = run["caps"][-1][1] if run.get("caps") else None
            ax.plot([min(seqs, cap or seqs)], [run["final"]["goodput"]], marker="*", markersize=14,
                    color="red", linestyle="", label=f"tunerd ({run['restarts']} restarts)")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_seqs (grid) / cap (door)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("goodput (good answers/s, clients' clock)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def runs_to_plot(data: dict[str, Any]) -> list[str]:
    """The workloads of tunerd's goodput runs on open loops, in the page's order (the busiest last): their
    backlogs are what the held caps are compared on."""
    kinds = {w["name"]: w["kind"] for w in data["workloads"]}
    runs = data.get("tunerd", {})
    return [n for n in kinds if kinds[n] == "open" and (runs.get(n) or {}).get("series")]


def plot_run(data: dict[str, Any], name: str, path: Path) -> None:
    """tunerd's goodput run under `name`: attainment, goodput and throughput (rolling), the door's cap;
    restarts dashed; beside tunerd's attainment, the best static cap and vLLM's defaults held under the
    same load, when measured."""
    run = data["tunerd"][name]
    series = run["series"]
    t = [p[0] / 60 for p in series]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(11, 7), sharex=True)
    top.plot(t, [p[1] if p[1] is not None else float("nan") for p in series], color="C0")
    top.axhline(data["settings"]["attainment"], color="grey", linestyle=":", linewidth=0.8)
    for key, color in (("held_cap", "black"), ("held_defaults", "grey")):
        if held := data.get(key, {}).get(name):  # under the same load, as long, on a start of its own
            top.plot([p[0] / 60 for p in held["series"]], [p[1] if p[1] is not None else float("nan")
                     for p in held["series"]], color=color, linestyle="-.", linewidth=0.9,
                     label=f"{_cap(held['cap'])}, held (a start of its own)")  # fmt: skip
            top.legend(fontsize=7, loc="upper right")
    top.set_ylabel("attainment")
    middle.plot(t, [p[2] for p in series], color="C2", label="goodput")
    middle.set_ylabel("goodput (req/s)")
    tokens = middle.twinx()  # throughput beside goodput: a run can serve more tokens and fewer people
    tokens.plot(t, [p[3] for p in series], color="C1", linewidth=0.9, label="throughput")
    tokens.set_ylabel("throughput (tok/s)", color="C1")
    began = run["began"]
    moves = [(at / 60, cap) for at, cap in run["caps"]]  # polled: (seconds since the load began, cap)
    if moves:
        xs = [x for x, _ in moves if x >= 0] + [t[-1] if t else 0]
        ys = [y if y is not None else float("nan") for x, y in moves if x >= 0]
        if ys:
            bottom.step(xs, [*ys, ys[-1]], where="post", color="C3")
    bottom.set_ylabel("door cap")
    bottom.set_xlabel(f"minutes since the load began ({data['settings']['rolling_s']:.0f} s rolling windows)")
    for at in run["restarts_at"]:
        x = (datetime.fromisoformat(at).timestamp() - began) / 60
        for ax in (top, middle, bottom):
            ax.axvline(x, color="grey", linestyle="--", linewidth=0.8)
    top.set_title(f"tunerd from vLLM's defaults under {name}: dashed = serving again after a restart")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def scaling_section(data: dict[str, Any]) -> list[str]:
    """bench/restart_scaling.py's table: the restarts of the sweep and of tunerd's search, 2 and 3
    parameters, on simulated landscapes."""
    lines = [
        "## Restarts as the tuned parameters go from 2 to 3 (`bench/restart_scaling.py`, a simulation)",
        "",
        f"{data['landscapes']} seeded landscapes with this box's noise (those of",
        "tests/unit/test_explore_vs_random.py; a third factor over `block_size` for 3 parameters); tunerd's",
        "own search against a sweep of one start a point, each measured once with the same noise. Not",
        "measured on vLLM: a 3-parameter sweep of this box's engine would take several hours.",
        "",
        "| parameters | sweep: restarts | sweep: its choice / true best | tunerd: restarts (median, range) "
        "| tunerd: its choice / true best |",
        "|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        r = row["search_restarts"]
        lines.append(
            f"| {', '.join(row['params'])} | {row['sweep_restarts']} | "
            f"{row['sweep_of_true_best_median']:.0%} | {row['search_restarts_median']:g} "
            f"({min(r)}–{max(r)}) | {row['search_of_true_best_median']:.0%} |"
        )
    two, three = data["rows"]
    lines += [
        "",
        f"From 2 to 3 parameters the sweep's restarts multiply by "
        f"{three['sweep_restarts'] / two['sweep_restarts']:.0f} and tunerd's grow by "
        f"{three['search_restarts_median'] - two['search_restarts_median']:g} (median); its choice is "
        "further from the true best than the sweep's, which pays "
        + "–".join(f"{r['sweep_restarts'] / r['search_restarts_median']:.0f}×" for r in data["rows"])
        + " tunerd's restarts for the difference.",
        "",
    ]
    return lines
