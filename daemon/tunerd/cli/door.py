"""`tunerd door`: the front door on the running daemon — its state and limits, and its in-flight cap:
what its controller reads and did (door/limit.py: mode, value, bounds, the last step and why, the
interval's samples, attainment by target, the door's share of the clients' TTFT), a value pinned without a
restart (`--max-in-flight N`, `--max-in-flight none` for no cap), `--steer` to give the cap back to the
controller, and `--curve 2,4,8,16`: the concurrency curve through the cap, measured cap by cap on the
serving vLLM with no restart (tune/curve.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from tunerd.cli.common import ask_daemon


def add_commands(sub: Any, config_option: Callable[[argparse.ArgumentParser], None]) -> None:
    door = sub.add_parser("door", help="the front door: state, limits; change its in-flight cap at once")
    config_option(door)
    door.add_argument(
        "--max-in-flight", metavar="N|none", help="requests forwarded to vLLM at once (none: no cap)"
    )
    door.add_argument(
        "--steer",
        action="store_true",
        help="unpin: the door steers its cap toward the [objective] targets again",
    )
    door.add_argument(
        "--curve",
        metavar="CAPS",
        help="measure the concurrency curve: the cap at each of CAPS (e.g. 2,4,8,16) in turn, no restart, "
        "scored by the objective in force; then the cap is given back",
    )
    door.add_argument("--point-s", type=float, default=30.0, help="--curve: seconds measured per cap (30)")
    door.add_argument(
        "--settle-s", type=float, default=5.0, help="--curve: seconds after each change before measuring (5)"
    )
    door.add_argument("--json", action="store_true", help="the door's part of the status document")
    door.set_defaults(func=cmd_door)


def cmd_door(args: argparse.Namespace) -> int:
    if args.curve is not None:
        if args.steer or args.max_in_flight is not None:
            print("tunerd door: --curve alone (it gives the cap back when it is over)", file=sys.stderr)
            return 64
        return _curve(args)
    if args.steer and args.max_in_flight is not None:
        print("tunerd door: --steer or --max-in-flight, not both", file=sys.stderr)
        return 64
    if args.steer:
        return _post(args, {"steer": True}, "door: the cap is steered toward the targets (no restart)")
    if args.max_in_flight is not None:
        text = args.max_in_flight.strip().lower()
        try:
            cap = None if text in ("none", "null", "0") else int(text)
        except ValueError:
            print(
                f"tunerd door: --max-in-flight {args.max_in_flight!r}: a whole number or none",
                file=sys.stderr,
            )
            return 64
        shown = cap if cap is not None else "no cap"
        return _post(args, {"max_in_flight": cap}, f"door: max_in_flight pinned at {shown} (no restart)")
    answer = ask_daemon(args, "GET", "/status", lenient=True)
    if isinstance(answer, int):
        return answer
    _, document = answer
    door = document.get("door") if isinstance(document, dict) else None
    if not isinstance(door, dict):
        print("tunerd door: the front door is off ([door] enabled = false)", file=sys.stderr)
        return 1
    print(json.dumps(door, indent=2) if args.json else render_door(door))
    return 0


def _curve(args: argparse.Namespace) -> int:
    """`tunerd door --curve`: request it, then print its points from the journal as they come."""
    from tunerd.cli.probe import _request, follow

    body = {"params": {"caps": args.curve, "point_s": args.point_s, "settle_s": args.settle_s}}
    requested = _request(args, "curve", body)
    if isinstance(requested, int):
        return requested
    _, token, journal, offset = requested
    return follow(journal, offset, lambda record: curve_progress(record, token), "the curve")


def curve_progress(record: dict[str, Any], token: str) -> tuple[str | None, int | None]:
    """One journal record seen by `tunerd door --curve`: (a line to print or None, the exit code once
    the curve is over, refused or aborted)."""
    if record.get("trigger") != token:
        return None, None
    event = record.get("event")
    if event == "door.curve.refused":
        return f"the daemon refused: {record.get('reason')}", 1
    if event == "door.curve.started":
        caps = ", ".join(str(c) for c in record.get("caps") or [])
        return (
            f"concurrency curve through the door's cap: {caps}; {record.get('point_s'):g} s each after "
            f"{record.get('settle_s'):g} s to settle, by {record.get('objective_name')} "
            f"({record.get('objective_unit')})"
        ), None
    if event == "door.curve.point":
        return f"  {_curve_point(record)}", None
    if event == "door.curve.finished":
        lines = [f"best cap: {record.get('best')}"]
        lines += [f"  lost: {lost.get('why')}" for lost in record.get("lost") or []]
        lines.append("the cap is given back (pinned or steered as before)")
        return "\n".join(lines), 0
    if event == "door.curve.aborted":
        return f"aborted: {record.get('reason')}", 1
    return None, None


def _curve_point(point: dict[str, Any]) -> str:
    value, noise = point.get("objective"), point.get("noise")
    text = f"cap {point.get('cap')}: " + (f"{value:.4g}" if isinstance(value, int | float) else "unmeasured")
    if isinstance(noise, int | float):
        text += f" ±{noise:.0%}"
    if isinstance(point.get("attainment"), int | float):
        text += f", attainment {point['attainment']:.1%} of {point.get('requests'):.0f} requests"
    if isinstance(point.get("throughput"), int | float):
        text += f", {point['throughput']:.0f} tok/s"
    if isinstance(point.get("preemptions_per_s"), int | float):
        text += f", {point['preemptions_per_s']:.2f} preemptions/s"
    return text


def _post(args: argparse.Namespace, params: dict[str, Any], done: str) -> int:
    answer = ask_daemon(args, "POST", "/door", {"params": params})
    if isinstance(answer, int):
        return answer
    code, document = answer
    if code != 202:
        error = document.get("error") if isinstance(document, dict) else document
        print(f"tunerd door: the daemon refused: {error}", file=sys.stderr)
        return 1
    print(done)
    return 0


def _share(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "-"


def limit_brief(limit: dict[str, Any]) -> str:
    """The cap in one phrase: its value and who sets it (`tunerd status`, the head of `tunerd door`)."""
    cap = limit.get("limit")
    value = cap if cap is not None else "none"
    if limit.get("mode") == "steered":
        high = limit.get("high")
        return (
            f"cap {value} steered ({limit.get('low')}..{high if high is not None else '-'}; "
            f"{limit.get('verdict')}"
            + (", cannot meet the targets" if limit.get("cannot_meet") else "")
            + ")"
        )
    return f"cap {value} " + ("pinned (tunerd door --steer to steer it)" if limit.get("pinned") else "fixed")


def limit_lines(limit: dict[str, Any]) -> list[str]:
    """What the cap's controller reads and did (door/limit.py)."""
    lines = [f"  {limit_brief(limit)}"]
    if limit.get("mode") != "steered":
        return lines
    lines.append(
        f"    this interval ({limit.get('interval_s'):g} s): {limit.get('samples')} samples, "
        f"{limit.get('stale')} stale (forwarded before the last change)"
    )
    lines.append(
        f"    last judged: attainment {_share(limit.get('attainment'))} (target "
        f"{_share(limit.get('attainment_target'))}): ttft {_share(limit.get('attainment_ttft'))}, "
        f"tpot {_share(limit.get('attainment_tpot'))}, e2e {_share(limit.get('attainment_e2e'))}; "
        f"the door's wait {_share(limit.get('wait_share'))} of the clients' TTFT, "
        f"{_share(limit.get('door_miss_share'))} of the misses"
    )
    seen = [
        f"{name} {limit[key]}"
        for name, key in (
            ("missed upstream at", "too_high"),
            ("missed by the door's wait at", "too_low"),
            ("keeps up with the arrivals from", "keeps_up"),
        )
        if limit.get(key) is not None
    ]
    if seen:
        lines.append(f"    remembered: {', '.join(seen)}")
    if limit.get("last_why"):
        age = limit.get("last_age_s")
        lines.append(
            f"    last change ({limit.get('changes')} so far)"
            + (f", {age:.0f} s ago" if isinstance(age, int | float) else "")
            + f": {limit['last_why']}"
        )
    return lines


def render_door(door: dict[str, Any]) -> str:
    cap = door.get("max_in_flight")
    lines = [
        f"door {door.get('address')}: {door.get('state')}"
        + (f" ({door['reason']})" if door.get("reason") else ""),
        f"  in flight {door.get('in_flight')}, waiting {door.get('queued')}, "
        f"max_in_flight {cap if cap is not None else 'no cap'}",
        *limit_lines(door.get("limit") or {}),
        f"  prompt limit: max_model_len {door.get('max_model_len') or 'unknown'}, max_prompt_tokens "
        f"{door.get('max_prompt_tokens') or 'max_model_len'}, tokenizer "
        f"{'loaded' if door.get('tokenizer_loaded') else 'not loaded (prompt lengths are left to vLLM)'}",
    ]
    return "\n".join(lines)
