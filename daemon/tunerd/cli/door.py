"""`tunerd door`: the front door on the running daemon — its state and limits, and its in-flight cap,
which changes without a restart (`--max-in-flight N`, `--max-in-flight none` for no cap)."""

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
    door.add_argument("--json", action="store_true", help="the door's part of the status document")
    door.set_defaults(func=cmd_door)


def cmd_door(args: argparse.Namespace) -> int:
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
        answer = ask_daemon(args, "POST", "/door", {"params": {"max_in_flight": cap}})
        if isinstance(answer, int):
            return answer
        code, document = answer
        if code != 202:
            error = document.get("error") if isinstance(document, dict) else document
            print(f"tunerd door: the daemon refused: {error}", file=sys.stderr)
            return 1
        print(f"door: max_in_flight → {cap if cap is not None else 'no cap'} (no restart)")
        return 0
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


def render_door(door: dict[str, Any]) -> str:
    cap = door.get("max_in_flight")
    lines = [
        f"door {door.get('address')}: {door.get('state')}"
        + (f" ({door['reason']})" if door.get("reason") else ""),
        f"  in flight {door.get('in_flight')}, waiting {door.get('queued')}, "
        f"max_in_flight {cap if cap is not None else 'no cap'}",
        f"  prompt limit: max_model_len {door.get('max_model_len') or 'unknown'}, max_prompt_tokens "
        f"{door.get('max_prompt_tokens') or 'max_model_len'}, tokenizer "
        f"{'loaded' if door.get('tokenizer_loaded') else 'not loaded (prompt lengths are left to vLLM)'}",
    ]
    return "\n".join(lines)
