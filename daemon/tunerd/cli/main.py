"""The `tunerd` command: its parser and the dispatch to each subcommand (run, check-config, journal, status,
restart, plan, the tuner's, the probe's, the door's). The parser is one table of every subcommand's
arguments, read in one place; the subcommands' work lives in their own modules, and what they share
(config loading, finding and asking the daemon) in `common`, which imports none of them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tunerd import __version__
from tunerd.cli import door, memory, probe, tuning
from tunerd.cli.common import (
    EX_CONFIG,
    EX_USAGE,
    ask_daemon,
    config_option,
    journal_path,
    load_all_or_report,
    report_problems,
)
from tunerd.config import Config, default_config_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return EX_USAGE
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tunerd status | head`): end quietly, no traceback. Python flushes
        # stdout again at exit, so point it at /dev/null first (the recipe of Python's signal docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunerd", description="Supervise and tune a vLLM server.")
    parser.add_argument("--version", action="version", version=f"tunerd {__version__}")
    sub = parser.add_subparsers(metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon in the foreground (what the systemd unit runs)")
    config_option(run)
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("check-config", help="validate a config file; exit 0 if valid, 1 if not")
    check.add_argument(
        "path", nargs="?", help="config file (default: $TUNERD_CONFIG or /etc/tunerd/tunerd.toml)"
    )
    check.set_defaults(func=cmd_check_config)

    journal = sub.add_parser("journal", help="print the tuning journal")
    config_option(journal)
    journal.add_argument("--file", help="journal file to read (default: the config's paths.journal)")
    journal.add_argument("-f", "--follow", action="store_true", help="keep printing new records as they come")
    journal.add_argument("--json", action="store_true", help="raw JSON lines, one record per line")
    journal.add_argument("--since", help="only records since then: 10m, 2h, 1d or an ISO time")
    journal.add_argument("-n", "--lines", type=int, help="only the last N records (before following)")
    journal.set_defaults(func=cmd_journal)

    status = sub.add_parser("status", help="what the running daemon reports: engine, parameters, signals")
    config_option(status)
    status.add_argument("--json", action="store_true", help="the daemon's status document as JSON")
    status.set_defaults(func=cmd_status)

    resume = sub.add_parser("resume", help="leave FATAL: let the daemon start vLLM again")
    config_option(resume)
    resume.set_defaults(func=cmd_resume)

    restart = sub.add_parser(
        "restart", help="restart vLLM now, optionally with changed parameters (a trial, journaled)"
    )
    config_option(restart)
    restart.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change a parameter, e.g. --set max_num_seqs=8 (VALUE none: unset)",
    )
    restart.add_argument("--reason", help="why, for the journal")
    restart.set_defaults(func=cmd_restart)

    plan = sub.add_parser(
        "plan", help="what fits: weights, KV cache, budget, oversubscription; exit 0 if feasible, 1 if not"
    )
    config_option(plan)
    plan.add_argument(
        "--model", metavar="DIR", help="model directory (without -c: plan from this and the flags alone)"
    )
    plan.add_argument("--max-model-len", type=int, metavar="N")
    plan.add_argument("--max-num-seqs", type=int, metavar="N")
    plan.add_argument("--block-size", type=int, metavar="N")
    plan.add_argument("--gpu-memory-utilization", type=float, metavar="F")
    plan.add_argument("--kv-cache-memory-bytes", type=int, metavar="BYTES")
    plan.add_argument("--kv-cache-dtype", metavar="DTYPE")
    plan.add_argument("--max-num-batched-tokens", type=int, metavar="N")
    plan.add_argument(
        "--backend", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if NVML finds a GPU"
    )
    plan.add_argument("--force", action="store_true", help="accept the refuse band (1.5 < ratio < 2)")
    plan.add_argument("--json", action="store_true", help="the plan as JSON, for scripts")
    plan.set_defaults(func=cmd_plan)

    for module in (tuning, probe, memory, door):
        module.add_commands(sub, config_option)
    return parser


def cmd_check_config(args: argparse.Namespace) -> int:
    path = args.path or default_config_path()
    loaded = load_all_or_report(path)
    if loaded is None:
        return 1
    print(f"{path}: ok")
    if loaded.rules_path is not None and loaded.rules is not None:
        print(f"{loaded.rules_path}: ok ({len(loaded.rules.rules)} rules)")
    return _check_fleet(path, loaded.config)


def _check_fleet(path: str, config: Config) -> int:
    """`[memory] url`: connect once. A configuration problem (password, user, database, password file)
    fails the check; an outage is a warning (the daemon tunes alone until the database is back)."""
    import socket

    from tunerd.config.memory import redact
    from tunerd.records.fleet_store import FleetError, FleetStore

    memory = config.memory
    if memory.url is None:
        return 0
    url = redact(memory.url)
    try:
        schema = FleetStore(memory, memory.host or socket.gethostname()).check()
    except FleetError as exc:
        if exc.config:
            report_problems([f"{path}: memory.url: {url}: {exc}"])
            return 1
        print(f"{path}: memory.url: {url}: unreachable now ({exc}); tunerd tunes alone until it is back")
        return 0
    print(f"{url}: ok (schema version {schema or 'none yet: the daemon creates it'})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tunerd.faces.logs import configure_logging
    from tunerd.supervisor import DaemonSetupError, Supervisor

    path = args.config or default_config_path()
    loaded = load_all_or_report(path)
    if loaded is None:
        return EX_CONFIG
    config = loaded.config
    configure_logging(config.logging.level, config.logging.format)
    supervisor = Supervisor(config, path, rules=loaded.rules)
    try:
        supervisor.setup()
    except DaemonSetupError as exc:
        report_problems([f"{path}: {exc}"])
        return EX_CONFIG
    return supervisor.run()


def cmd_journal(args: argparse.Namespace) -> int:
    from tunerd.cli.journal import follow, parse_since, print_journal

    path = args.file or journal_path(args.config or default_config_path())
    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as exc:
        print(f"tunerd journal: {exc}", file=sys.stderr)
        return EX_USAGE
    try:
        offset = print_journal(path, sys.stdout, as_json=args.json, since=since, last=args.lines)
        if args.follow:
            follow(path, sys.stdout, as_json=args.json, since=since, offset=offset)
    except BrokenPipeError:
        pass
    except PermissionError as exc:
        print(f"tunerd journal: {path}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from tunerd.cli.status import render_status

    answer = ask_daemon(args, "GET", "/status", lenient=True)
    if isinstance(answer, int):
        return answer
    _, document = answer
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render_status(document if isinstance(document, dict) else {}))
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    answer = ask_daemon(args, "POST", "/resume")
    if isinstance(answer, int):
        return answer
    code, _ = answer
    print("resume requested" if code == 202 else f"the daemon refused: HTTP {code}")
    return 0 if code == 202 else 1


def parse_assignment(text: str) -> tuple[str, object]:
    """`max_num_seqs=8` → ("max_num_seqs", 8); true/false → bool, none → None, numbers → int/float."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--set {text!r}: use NAME=VALUE")
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return name.strip(), lowered == "true"
    if lowered in ("none", "null", ""):
        return name.strip(), None
    for convert in (int, float):
        try:
            return name.strip(), convert(raw)
        except ValueError:
            pass
    return name.strip(), raw


def cmd_restart(args: argparse.Namespace) -> int:
    try:
        changes = dict(parse_assignment(item) for item in args.set)
    except ValueError as exc:
        print(f"tunerd restart: {exc}", file=sys.stderr)
        return EX_USAGE
    answer = ask_daemon(args, "POST", "/restart", {"params": changes, "reason": args.reason})
    if isinstance(answer, int):
        return answer
    code, document = answer
    if code == 202:
        print("restart requested; follow it with `tunerd journal -f`")
        return 0
    error = document.get("error") if isinstance(document, dict) else document
    print(f"the daemon refused: {error}", file=sys.stderr)
    return 1


def cmd_plan(args: argparse.Namespace) -> int:
    from tunerd.cli.plan import run_plan

    return run_plan(args)
