"""`tunerd status`: the daemon's status document as a readable page."""

from __future__ import annotations

from typing import Any

from tunerd.cli.door import limit_brief


def render_status(doc: dict[str, Any]) -> str:
    """Engine state and parameters, uptime, last journal record, and the signals as a table."""
    daemon, engine = doc.get("daemon", {}), doc.get("engine", {})
    uptime = _duration(daemon.get("uptime_s"))
    lines = [
        f"tunerd {daemon.get('version', '?')}  pid {daemon.get('pid', '?')}  up {uptime}",
        f"engine: {engine.get('state', '?')}" + (f" (pid {engine['pid']})" if engine.get("pid") else ""),
    ]
    if engine.get("uptime_s") is not None:
        lines.append(f"  serving for {_duration(engine['uptime_s'])}")
    for key, label in (("fatal_reason", "FATAL"), ("waiting_reason", "start delayed"), ("log", "log")):
        if engine.get(key):
            lines.append(f"  {label}: {engine[key]}")
    if engine.get("next_start_in_s") is not None:
        lines.append(f"  next start in {engine['next_start_in_s']} s")
    if engine.get("consecutive_failures"):
        lines.append(f"  consecutive failures: {engine['consecutive_failures']}")
    if engine.get("restarts"):
        lines.append("  restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(engine["restarts"].items())))
    lines.append("parameters:")
    known_good = engine.get("known_good") or {}
    for name, value in sorted((engine.get("params") or {}).items()):
        mark = "" if known_good.get(name) == value else "  (not yet known-good)"
        lines.append(f"  {name:<26} {value}{mark}")
    tuning = doc.get("tuning")
    if isinstance(tuning, dict):
        mode = tuning.get("mode", "?") + ("  PAUSED (tunerd resume)" if tuning.get("paused") else "")
        budget = tuning.get("budget") or {}
        lines.append(
            f"tuning: {mode}; restart budget left {budget.get('hour_left', '?')} this hour, "
            f"{budget.get('day_left', '?')} today; rules: {len(tuning.get('rules') or [])} (tunerd rules)"
        )
        trial = tuning.get("trial")
        if trial:
            lines.append(
                f"  trial #{trial['trial']} ({trial['rule']}): {trial['param']} {trial['old']} → "
                f"{trial['new']}, {trial['phase']} for {trial['phase_s']} s"
            )
        ex = tuning.get("exploration")
        if ex:
            lines.append(
                f"  exploration #{ex['explore']} of {', '.join(ex['params'])}: {ex['step']} for "
                f"{ex['step_s']} s, point {ex['point']}, best {ex['best']} ({ex['best_objective']}), "
                f"{ex['points']} points, {ex['restarts']} restarts"
            )
        if tuning.get("baseline"):
            figures = ", ".join(f"{k} {v:.4g}" for k, v in sorted(tuning["baseline"].items()))
            lines.append(f"  baseline: {figures}")
            if tuning.get("baseline_why"):
                lines.append(f"    from: {tuning['baseline_why']}")
        noise = tuning.get("noise")
        if isinstance(noise, dict):
            lines.append(noise_line(noise))
        probe = tuning.get("probe") or {}
        if probe.get("last"):
            lines.append(f"  last probe ({probe['age_s']:.0f} s ago): {probe_line(probe['last'])}")
        if probe.get("running"):
            lines.append("  a probe is running")
    objective = doc.get("objective")
    if isinstance(objective, dict):
        lines.extend(objective_lines(objective))
    door = doc.get("door")
    if isinstance(door, dict):
        cap = door.get("max_in_flight")
        limit = door.get("limit")
        brief = limit_brief(limit) if isinstance(limit, dict) else f"cap {cap if cap is not None else 'none'}"
        lines.append(
            f"door {door.get('address')}: {door.get('state')}, {door.get('in_flight')} in flight, "
            f"{door.get('queued')} waiting, {brief} (tunerd door)"
        )
    if daemon.get("journal_error"):
        lines.append(f"journal: NOT WRITABLE: {daemon['journal_error']} (tuning frozen)")
    last = doc.get("last_journal")
    if last:
        lines.append(f"last journal record: #{last.get('seq')} {last.get('time')} {last.get('event')}")
    signals = doc.get("signals") or {}
    if signals:
        lines.append("signals:")
        lines.extend(_signal_lines(signals))
    return "\n".join(lines)


def noise_line(noise: dict[str, Any]) -> str:
    """The noise meter: the objective's spread over the last trial window, what such a window can tell
    within one vLLM start (the door's cap) and across a restart (a trial, with the spread between starts)."""
    need = noise.get("window_for_tolerance_s")
    needed = f"{_duration(need)} windows would detect {noise['tolerance']:.0%}" if need else "no window would"
    line = (
        f"  noise: {noise['objective']} known to ±{noise['relative_noise']:.1%} over {noise['window_s']:g} s "
        f"({noise['effective_samples']:g} effective of {noise['samples']} polls); within one start a window "
        f"of that length detects ≥ {noise['min_detectable_effect']:.1%}; {needed}"
    )
    across = noise.get("min_detectable_effect_across_starts")
    if across is None:
        return line
    need_across = noise.get("window_for_tolerance_across_starts_s")
    then = (
        f"{_duration(need_across)} windows would detect {noise['tolerance']:.0%}"
        if need_across
        else f"no window would: {noise.get('starts_per_arm_for_tolerance')} starts a side would"
    )
    return (
        f"{line}\n  across a restart (start_noise {noise.get('start_noise', 0):.0%} a start): "
        f"≥ {across:.1%}; {then}"
    )


def _signal_lines(signals: dict[str, Any]) -> list[str]:
    """One line per signal; a histogram percentile carries the bucket it falls in on its own line
    ("ttft.p95  2.02  s  (bucket 1–2.5 s)") instead of its `.lo`/`.hi` edge signals."""

    def value_of(name: str) -> Any:
        entry = signals.get(name)
        return entry.get("value") if isinstance(entry, dict) else entry

    edges = {n for n in signals if n.endswith((".lo", ".hi")) and n.rsplit(".", 1)[0] in signals}
    names = sorted(n for n in signals if n not in edges)
    width = max(len(name) for name in names) if names else 0
    lines = []
    for name in names:
        entry = signals[name]
        unit = entry.get("unit", "") if isinstance(entry, dict) else ""
        line = f"  {name:<{width}}  {_number(value_of(name)):>14}  {unit}"
        lo = value_of(name + ".lo")
        if value_of(name) is not None and lo is not None:
            line += f"  (bucket {bucket_text([lo, value_of(name + '.hi')], unit)})"
        lines.append(line)
    return lines


def bucket_text(bucket: list[Any], unit: str = "s") -> str:
    """A histogram bucket `(lo, hi]` as "1–2.5 s" ("above 60 s" for the +Inf bucket: hi None)."""
    lo, hi = bucket
    if hi is None:
        return f"above {_number(lo)} {unit}".rstrip()
    return f"{_number(lo)}–{_number(hi)} {unit}".rstrip()


def objective_lines(objective: dict[str, Any]) -> list[str]:
    """The objective in force and why, then the window's attainment and goodput beside throughput."""
    kind, applies = objective.get("kind"), objective.get("in_force")
    head = f"objective: {applies}" + (f" (configured: {kind})" if kind != applies else "")
    targets = objective.get("targets") or {}
    set_ = [f"{k.removesuffix('_s')} ≤ {_seconds(v)}" for k, v in targets.items() if v is not None]
    if set_:
        head += f"; targets {', '.join(set_)}, attainment ≥ {objective.get('attainment_target', 0):.0%}"
    lines = [head]
    if objective.get("why"):
        lines.append(f"  {objective['why']}")
    w = objective.get("window") or {}
    unit = "tok/s" if objective.get("count") == "tokens" else "req/s"
    attainment, goodput, throughput = (
        w.get("slo.attainment"),
        w.get("slo.goodput"),
        w.get("throughput.generation"),
    )
    parts = [
        f"attainment {_share(attainment)}"
        + (
            " (feasible)"
            if objective.get("feasible")
            else " (NOT feasible)"
            if objective.get("feasible") is False
            else ""
        ),
        f"goodput {_number(goodput)} {unit}" if goodput is not None else "goodput —",
        f"throughput {_number(throughput)} tok/s" if throughput is not None else "throughput —",
    ]
    lines.append("  window: " + ", ".join(parts) + f" over {_number(w.get('slo.requests'))} requests")
    per = [(t, w.get(f"slo.attainment.{t}")) for t in ("ttft", "tpot", "e2e")]
    if any(v is not None for _, v in per):
        lines.append("  per target: " + ", ".join(f"{t} {_share(v)}" for t, v in per if v is not None))
    lines += _histogram_lines(objective.get("histograms"))
    if w.get("door.ttft.p95") is not None or w.get("door.tpot.p95") is not None:
        lines.append(
            f"  clients (at the door): TTFT p50/p95 {_seconds(w.get('door.ttft.p50'))}/"
            f"{_seconds(w.get('door.ttft.p95'))}, TPOT p50/p95 {_seconds(w.get('door.tpot.p50'))}/"
            f"{_seconds(w.get('door.tpot.p95'))}, door wait p95 {_seconds(w.get('door.wait.p95'))}"
        )
    return lines


def _histogram_lines(estimate: Any) -> list[str]:
    """The attainment vLLM's histograms allow (core/slo_estimate.py): the joint share only between
    Fréchet bounds, each target's share exact at a bucket edge, else between the edges around it."""
    if not isinstance(estimate, dict):
        return []
    low, high = estimate.get("low"), estimate.get("high")
    marginals = estimate.get("marginals") or {}
    if low == high:
        head = f"  estimated from vLLM's histograms: {_share(low)}"
    else:
        head = f"  estimated from vLLM's histograms: between {_share(low)} and {_share(high)}"
    head += " (marginals only)" if len(marginals) > 1 else ""
    parts = []
    for name, m in marginals.items():
        within = _share(m.get("low")) if m.get("exact") else f"{_share(m.get('low'))}–{_share(m.get('high'))}"
        parts.append(f"{name} {within}" + ("" if m.get("exact") else " (target inside a bucket)"))
    missing = estimate.get("missing") or []
    if missing:
        parts.append("no histogram data: " + ", ".join(missing))
    return [head, "    per target: " + ", ".join(parts)] if parts else [head]


def _share(value: Any) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value:.1%}"


def _seconds(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "—"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def _number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def probe_line(figures: dict[str, Any]) -> str:
    """One probe's figures on a line: tokens/s, TTFT and ITL p50/p95, errors, and the share of its
    requests within the [objective] targets when they are set."""

    def ms(key: str, decimals: int = 0) -> str:
        value = figures.get(key)
        return "?" if value is None else f"{value * 1000:.{decimals}f}"

    throughput = figures.get("throughput")
    rate = "?" if throughput is None else f"{throughput:.1f}"
    attainment = figures.get("attainment")
    return (
        f"{rate} tok/s, TTFT p50/p95 {ms('ttft_p50')}/{ms('ttft_p95')} ms, "
        f"ITL p50/p95 {ms('itl_p50', 1)}/{ms('itl_p95', 1)} ms, {len(figures.get('errors') or [])} errors "
        f"of {figures.get('requests', '?')} requests"
        + ("" if attainment is None else f", {_share(attainment)} within the targets")
    )
