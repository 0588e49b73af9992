"""`tunerd probe`, `tunerd explore` and `tunerd cache-reset`: the benchmark probe, the exploration and
the prefix-cache reset, for operators.

Each asks the running daemon over the operator socket, then reads the journal for what it did: the
probe's `probe.result` (or why it did not run), the exploration's plan (`explore.started`), each point
(`explore.point`, and the restart before it) and its end (`explore.finished`), the reset's
`cache_reset.done` / `.failed` / `.skipped`. A request carries a token as its reason, so the records
that answer it are told from any others.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from tunerd.records.journal import Record

if TYPE_CHECKING:
    from tunerd.config import Config

PROBE_EXTRA_S = 60.0  # beyond the probe's own bound: the queue of a probe already running, the journal


def add_commands(sub: Any, config_option: Callable[[argparse.ArgumentParser], None]) -> None:
    probe = sub.add_parser(
        "probe", help="run the benchmark probe on the running daemon now, print its figures"
    )
    config_option(probe)
    probe.add_argument("--baseline", action="store_true", help="and compare them with the baseline")
    probe.add_argument("--json", action="store_true", help="the probe.result record as JSON")
    probe.set_defaults(func=cmd_probe)

    explore = sub.add_parser(
        "explore", help="search better values of parameters (coordinate search, the probe as objective)"
    )
    config_option(explore)
    explore.add_argument("params", help="PARAM[,PARAM…], e.g. max_num_seqs,block_size")
    explore.add_argument("--no-follow", action="store_true", help="start it and return (tunerd journal -f)")
    explore.set_defaults(func=cmd_explore)

    reset = sub.add_parser(
        "cache-reset",
        help="reset vLLM's prefix cache now ([cache_reset]'s checks and retries; dev mode, idle vLLM)",
    )
    config_option(reset)
    reset.add_argument("--json", action="store_true", help="the cache_reset record as JSON")
    reset.set_defaults(func=cmd_cache_reset)


def _token(command: str) -> str:
    return f"operator {command} {os.getpid()}-{time.time_ns()}"


class _Requested(NamedTuple):
    """A command the daemon accepted: its config, the token it carries as its reason, and where the
    journal ended before it was asked (its records come after `offset`)."""

    config: Config
    token: str
    journal: str
    offset: int


def _request(args: argparse.Namespace, command: str, body: dict[str, Any]) -> _Requested | int:
    """Load the config once, note where the journal ends, then POST `/<command>` with a fresh token as its
    reason. An exit code, after printing why, when the config does not load or the daemon refuses."""
    from tunerd.cli.common import EX_CONFIG, ask_daemon, load_or_report
    from tunerd.cli.journal import journal_size
    from tunerd.config import default_config_path

    config = load_or_report(args.config or default_config_path())
    if config is None:
        return EX_CONFIG
    token = _token(command)
    journal = str(config.paths.journal_path)
    offset = journal_size(journal)
    answer = ask_daemon(args, "POST", f"/{command}", {**body, "reason": token})
    if isinstance(answer, int):
        return answer
    code, document = answer
    if code != 202:
        error = document.get("error") if isinstance(document, dict) else document
        print(f"tunerd {command}: the daemon refused: {error}", file=sys.stderr)
        return 1
    return _Requested(config, token, journal, offset)


def _records_until(path: str, offset: int, deadline: float) -> Iterator[Record]:
    from tunerd.cli.journal import tail_records

    yield from tail_records(path, offset=offset, keep_going=lambda: time.monotonic() < deadline)


# -- tunerd probe --------------------------------------------------------------------------------------


def cmd_probe(args: argparse.Namespace) -> int:
    from tunerd.cli.common import ask_daemon as _ask_daemon
    from tunerd.cli.status import probe_line

    requested = _request(args, "probe", {})
    if isinstance(requested, int):
        return requested
    config, token, journal, offset = requested
    cfg = config.probe
    rounds = math.ceil(cfg.requests / cfg.concurrency)
    bound = cfg.timeout_s * rounds + PROBE_EXTRA_S
    if not args.json:
        print(
            f"probe: {cfg.requests} requests of {cfg.prompt_tokens} cache-cold prompt tokens → "
            f"{cfg.max_tokens} tokens, {cfg.concurrency} at a time; waiting for its figures…",
            file=sys.stderr,
        )
    for record in _records_until(journal, offset, time.monotonic() + bound):
        if token not in (record.get("triggers") or [record.get("trigger")]):
            continue
        if record.get("event") == "probe.skipped":
            print(f"tunerd probe: it did not run: {record.get('reason')}", file=sys.stderr)
            return 1
        if record.get("event") != "probe.result":
            continue
        if args.json:
            print(json.dumps(record))
        else:
            print(probe_line(record))
        if args.baseline:
            answer = _ask_daemon(args, "GET", "/status", lenient=True)
            document = answer[1] if not isinstance(answer, int) else {}
            baseline = (
                ((document or {}).get("tuning") or {}).get("baseline") if isinstance(document, dict) else None
            )
            print(compare_with_baseline(record, baseline or {}))
        return 0 if not record.get("errors") else 1
    print(f"tunerd probe: no result within {bound:.0f} s; see `tunerd journal`", file=sys.stderr)
    return 1


BASELINE_FIGURES = (
    ("throughput", "probe.throughput", "tok/s", 1.0),
    ("ttft_p95", "probe.ttft_p95", "ms", 1000.0),
    ("itl_p95", "probe.itl_p95", "ms", 1000.0),
)


def compare_with_baseline(result: Record, baseline: dict[str, Any]) -> str:
    """The probe's figures against the baseline's probe figures, as ratios (1.00: unchanged). A ratio
    only against a baseline figure above zero: a zero, missing or unreadable one is named, never
    divided by; values keep three significant digits, so a small one never prints as 0.0."""
    if not any(key in baseline for _, key, _, _ in BASELINE_FIGURES):
        return "baseline: none with probe figures yet (recorded at the first start and after each kept trial)"
    parts = []
    for field, key, unit, scale in BASELINE_FIGURES:
        now, then = _finite(result.get(field)), _finite(baseline.get(key))
        shown = "?" if now is None else f"{_figure(now * scale)} {unit}"
        if then is None:
            parts.append(f"{field} {shown} (no baseline figure)")
        elif now is None or then <= 0:
            parts.append(f"{field} {shown} (baseline {_figure(then * scale)} {unit}: no ratio)")
        else:
            parts.append(f"{field} {shown} = {now / then:.2f}× the baseline's {_figure(then * scale)}")
    return "against the baseline: " + "; ".join(parts)


def _finite(value: Any) -> float | None:
    """A number to compare, or None (absent, not a number, infinite)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _figure(value: float) -> str:
    """One decimal from 1 up (978.3, 4.6), three significant digits below (0.0174, 0.5)."""
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.3g}"


# -- tunerd explore ------------------------------------------------------------------------------------


def cmd_explore(args: argparse.Namespace) -> int:

    names = [name.strip() for name in args.params.split(",") if name.strip()]
    if not names:
        print("tunerd explore: name at least one parameter, e.g. max_num_seqs", file=sys.stderr)
        return 64
    requested = _request(args, "explore", {"names": names})
    if isinstance(requested, int):
        return requested
    _, token, journal, offset = requested
    if args.no_follow:
        print("exploration requested; follow it with `tunerd journal -f`")
        return 0
    print(f"exploration of {', '.join(names)} requested; measuring the configuration in force first…")
    explore_id: int | None = None

    def progress(record: Record) -> tuple[str | None, int | None]:
        nonlocal explore_id
        line, explore_id, finished = explore_progress(record, token, explore_id)
        return line, finished

    return follow(journal, offset, progress, "the exploration")


def follow(
    journal: str, offset: int, progress: Callable[[Record], tuple[str | None, int | None]], what: str
) -> int:
    """Print what `progress` makes of each journal record from `offset` until it gives an exit code
    (`tunerd explore`, `tunerd door --curve`); Ctrl-C leaves `what` running in the daemon (130)."""
    try:
        for record in _records_until(journal, offset, math.inf):
            line, code = progress(record)
            if line:
                print(line, flush=True)
            if code is not None:
                return code
    except KeyboardInterrupt:
        print(f"\n{what} goes on in the daemon; follow it with `tunerd journal -f`", file=sys.stderr)
        return 130
    return 1


def explore_progress(
    record: Record, token: str, explore_id: int | None
) -> tuple[str | None, int | None, int | None]:
    """One journal record seen by `tunerd explore`: (a line to print or None, the exploration's id once
    known, the exit code once it is over or refused, else None)."""
    event = record.get("event")
    if event == "explore.refused" and record.get("trigger") == token:
        return f"the daemon refused: {record.get('reason')}", explore_id, 1
    if event == "explore.started" and record.get("trigger") == token:
        return _plan(record), record.get("explore"), None
    if event == "explore.finished" and record.get("trigger") == token:
        return _finished(record), record.get("explore"), 0
    if explore_id is None or record.get("explore", record.get("trial")) != explore_id:
        return None, explore_id, None
    if event == "intent":
        return f"  restart: {record.get('reason')}", explore_id, None
    if event == "explore.point":
        return _point(record), explore_id, None
    if event == "explore.budget_spent":
        return "  the restart budget is spent: going to the best point", explore_id, None
    return None, explore_id, None


def _plan(record: Record) -> str:
    objective = record.get("objective")
    source = (
        "live traffic's generation throughput: it saturates the engine"
        if record.get("objective_source") == "live"
        else "the probe's generation throughput"
    )
    lines = [
        f"exploration {record.get('explore')}: the configuration in force measures "
        f"{_rate(objective, record.get('limit_excess'))} ({source})"
    ]
    if record.get("recall"):
        lines.append(f"  trying the tuning memory's best configuration: {record['recall']}")
    for name, values in (record.get("ladders") or {}).items():
        lines.append(f"  {name}: values {', '.join(str(v) for v in values)}")
    lines.append(
        f"  at most {record.get('at_most_restarts')} restarts; restart budget left "
        f"{record.get('budget_left')}; {record.get('known_points', 0)} points known from the tuning memory"
    )
    return "\n".join(lines)


def _point(record: Record) -> str:
    if "recall" in record:
        verdict = "kept" if record.get("kept") else "lost"
        return f"  recalled configuration: {_rate(record.get('objective'))} ({verdict})"
    return (
        f"  {record.get('param')} = {record.get('value')}: "
        f"{_rate(record.get('objective'), record.get('limit_excess'))}; "
        f"best so far {record.get('best')}"
    )


def _finished(record: Record) -> str:
    return (
        f"exploration {record.get('explore')} finished ({record.get('reason')}): best "
        f"{record.get('best')} at {_rate(record.get('objective'), record.get('limit_excess'))}; "
        f"{record.get('points')} points measured, "
        f"{record.get('restarts')} restarts"
    )


def _rate(value: Any, excess: Any = None) -> str:
    if value is not None:
        return f"{value:.1f} tok/s"
    if excess is not None:
        return f"infeasible ({excess:.2f}× its latency limit)"
    return "infeasible (failed or over a latency limit)"


# -- tunerd cache-reset --------------------------------------------------------------------------------


def cache_reset_bound_s(retries: int, retry_after_s: float) -> float:
    """How long `tunerd cache-reset` waits for its record: every attempt may take the reset's whole
    timeout, with the retry delays between them, plus the journal's margin."""
    from tunerd.engine.admin import RESET_TIMEOUT

    attempt_s = (RESET_TIMEOUT.connect or 0.0) + (RESET_TIMEOUT.read or 0.0)
    return (retries + 1) * attempt_s + retries * retry_after_s + PROBE_EXTRA_S


def cache_reset_answer(record: Record) -> tuple[str, int]:
    """A `cache_reset.*` record as (the line to print, the exit code): 0 only when vLLM reset it."""
    event = record.get("event")
    if event == "cache_reset.skipped":
        return f"tunerd cache-reset: it did not run: {record.get('reason')}", 1
    if event == "cache_reset.failed":
        return (
            f"tunerd cache-reset: failed after {record.get('attempts')} attempts: {record.get('detail')}",
            1,
        )
    before, after = record.get("before") or {}, record.get("after") or {}
    figures = [
        f"{name} {before.get(name)} → {after.get(name)}"
        for name in ("kv_cache.usage", "host.mem_available_bytes", "prefix_cache.hit_ratio")
        if before.get(name) is not None or after.get(name) is not None
    ]
    attempts = record.get("attempts")
    line = f"cache reset: done ({attempts} attempt{'s' if attempts != 1 else ''}, {record.get('seconds')} s)"
    return line + (f"; {', '.join(figures)}" if figures else ""), 0


def cmd_cache_reset(args: argparse.Namespace) -> int:

    requested = _request(args, "cache-reset", {})
    if isinstance(requested, int):
        return requested
    config, token, journal, offset = requested
    bound = cache_reset_bound_s(config.cache_reset.retries, config.cache_reset.retry_after_s)
    for record in _records_until(journal, offset, time.monotonic() + bound):
        if record.get("trigger") != token or not str(record.get("event")).startswith("cache_reset."):
            continue
        line, code = cache_reset_answer(record)
        if args.json:
            print(json.dumps(record))
        else:
            print(line, file=sys.stdout if code == 0 else sys.stderr)
        return code
    print(f"tunerd cache-reset: no answer within {bound:.0f} s; see `tunerd journal`", file=sys.stderr)
    return 1
