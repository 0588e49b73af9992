"""The `tunerd` command: its parser and the dispatch to each subcommand (run, check-config, journal, status,
restart, plan, the tuner's, the probe's, the door's). Just over 400 lines: the parser is one table of every
subcommand's arguments, read in one place; the subcommands' work lives in their own modules."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tunerd import __version__
from tunerd.config import (
    Config,
    ConfigError,
    ExportConfig,
    Loaded,
    PathsConfig,
    default_config_path,
    load_all,
    load_config,
)

EX_USAGE = 2
EX_CONFIG = 78


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
    _config_option(run)
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("check-config", help="validate a config file; exit 0 if valid, 1 if not")
    check.add_argument(
        "path", nargs="?", help="config file (default: $TUNERD_CONFIG or /etc/tunerd/tunerd.toml)"
    )
    check.set_defaults(func=cmd_check_config)

    journal = sub.add_parser("journal", help="print the tuning journal")
    _config_option(journal)
    journal.add_argument("--file", help="journal file to read (default: the config's paths.journal)")
    journal.add_argument("-f", "--follow", action="store_true", help="keep printing new records as they come")
    journal.add_argument("--json", action="store_true", help="raw JSON lines, one record per line")
    journal.add_argument("--since", help="only records since then: 10m, 2h, 1d or an ISO time")
    journal.add_argument("-n", "--lines", type=int, help="only the last N records (before following)")
    journal.set_defaults(func=cmd_journal)

    status = sub.add_parser("status", help="what the running daemon reports: engine, parameters, signals")
    _config_option(status)
    status.add_argument("--json", action="store_true", help="the daemon's status document as JSON")
    status.set_defaults(func=cmd_status)

    resume = sub.add_parser("resume", help="leave FATAL: let the daemon start vLLM again")
    _config_option(resume)
    resume.set_defaults(func=cmd_resume)

    restart = sub.add_parser(
        "restart", help="restart vLLM now, optionally with changed parameters (a trial, journaled)"
    )
    _config_option(restart)
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
    _config_option(plan)
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

    from tunerd.cli import door, memory, probe, tuning

    for module in (tuning, probe, memory, door):
        module.add_commands(sub, _config_option)
    return parser


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        default=None,
        help="config file (default: $TUNERD_CONFIG or /etc/tunerd/tunerd.toml)",
    )


def _load_or_report(path: str) -> Config | None:
    try:
        return load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None


def _load_all_or_report(path: str) -> Loaded | None:
    """The config and its rules file, or None after printing every problem as `file: key: reason`."""
    try:
        return load_all(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None


def cmd_check_config(args: argparse.Namespace) -> int:
    path = args.path or default_config_path()
    loaded = _load_all_or_report(path)
    if loaded is None:
        return 1
    print(f"{path}: ok")
    if loaded.rules_path is not None and loaded.rules is not None:
        print(f"{loaded.rules_path}: ok ({len(loaded.rules.rules)} rules)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tunerd.faces.logs import configure_logging
    from tunerd.supervisor import DaemonSetupError, Supervisor

    path = args.config or default_config_path()
    loaded = _load_all_or_report(path)
    if loaded is None:
        return EX_CONFIG
    config = loaded.config
    configure_logging(config.logging.level, config.logging.format)
    supervisor = Supervisor(config, path, rules=loaded.rules)
    try:
        supervisor.setup()
    except DaemonSetupError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return EX_CONFIG
    return supervisor.run()


def cmd_journal(args: argparse.Namespace) -> int:
    from tunerd.cli.journal import follow, parse_since, print_journal

    path = args.file or _journal_path(args.config or default_config_path())
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


@dataclass(frozen=True)
class DaemonPlace:
    """Where the running daemon's files and read-only endpoint are, and whether the config said so
    (`lenient`: the config on disk does not load, so they come from what of it validates, or the
    defaults, and the address the daemon recorded in its state dir is believed first)."""

    paths: PathsConfig
    export: ExportConfig
    lenient: bool = False


def _daemon_place(config_path: str, command: str) -> DaemonPlace:
    """The daemon's place from its config; when the file does not load — e.g. just after a reload the
    daemon rejected, while it runs on with the config it had — from the [paths] and [export] sections
    that still validate on their own, else the defaults, and say so on stderr."""
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        problems = exc.problems
    else:
        return DaemonPlace(config.paths, config.export)
    import tomllib

    from pydantic import ValidationError

    try:
        with open(config_path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        data = {}
    used: list[str] = []

    def section(model: type[PathsConfig] | type[ExportConfig], name: str) -> Any:
        raw = data.get(name)
        if isinstance(raw, dict):
            try:
                value = model.model_validate(raw)
            except ValidationError:
                pass
            else:
                used.append(f"its [{name}]")
                return value
        used.append(f"the default [{name}]")
        return model()

    paths, export = section(PathsConfig, "paths"), section(ExportConfig, "export")
    more = f" (and {len(problems) - 1} more: tunerd check-config lists them)" if len(problems) > 1 else ""
    print(
        f"tunerd {command}: the config does not load: {problems[0]}{more}; finding the running daemon "
        f"with {' and '.join(used)} and what it recorded in {paths.state_dir}",
        file=sys.stderr,
    )
    return DaemonPlace(paths, export, lenient=True)


def _recorded_address(paths: PathsConfig) -> tuple[str, int] | None:
    """host:port the running daemon wrote to state_dir/export.addr when it started."""
    try:
        host, _, text = paths.export_address_file.read_text().strip().rpartition(":")
        return host, int(text)
    except (OSError, ValueError):
        return None


def _daemon_url(place: DaemonPlace) -> str:
    """Where the running daemon listens: the config's export address, or the one it wrote at start (that
    one first when the config did not load: the daemon may run on a different one)."""
    host, port = place.export.host, place.export.port
    if port == 0 or place.lenient:
        recorded = _recorded_address(place.paths)
        if recorded is not None:
            host, port = recorded
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def _journal_path(config_path: str) -> str:
    """The journal `tunerd journal` reads: the config's; when the config does not load, the one the
    running daemon reports in its status (it writes there whatever the file says now), else the
    fallback paths' (see _daemon_place)."""
    place = _daemon_place(config_path, "journal")
    if not place.lenient:
        return str(place.paths.journal_path)
    import httpx

    try:
        document = httpx.get(_daemon_url(place) + "/status", timeout=5.0, trust_env=False).json()
        journal = document["daemon"]["journal"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        journal = None
    if isinstance(journal, str) and journal:
        print(f"tunerd journal: reading {journal}, the running daemon's journal", file=sys.stderr)
        return journal
    path = str(place.paths.journal_path)
    print(f"tunerd journal: no running daemon answered; reading {path}", file=sys.stderr)
    return path


def _ask_daemon(
    args: argparse.Namespace, method: str, path: str, body: dict | None = None, lenient: bool = False
) -> tuple[int, object] | int:
    """(status code, decoded JSON) from the running daemon, or an exit code after printing why.

    Reading (`GET /status`) goes to the read-only TCP endpoint; commands (`POST`) go over the operator
    socket, whose permissions decide who may use them. `lenient`: a config that does not load is no
    reason to fail, the daemon is looked for where it recorded itself (see _daemon_place).
    """
    import httpx

    config_path = args.config or default_config_path()
    if lenient:
        place = _daemon_place(config_path, path.strip("/"))
    else:
        config = _load_or_report(config_path)
        if config is None:
            return EX_CONFIG
        place = DaemonPlace(config.paths, config.export)
    if method == "GET":
        url, transport, where = _daemon_url(place) + path, None, _daemon_url(place)
    else:
        sock = str(place.paths.socket_path)
        url, transport, where = "http://tunerd" + path, httpx.HTTPTransport(uds=sock), sock
    try:
        with httpx.Client(transport=transport, timeout=5.0, trust_env=False) as client:
            response = client.request(method, url, json=body)
    except httpx.HTTPError as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, PermissionError):  # httpx wraps it twice
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, PermissionError):
            print(
                f"tunerd: {where}: permission denied (operators need membership of the daemon's group)",
                file=sys.stderr,
            )
            return 4
        print(
            f"tunerd: cannot reach the daemon at {where} ({type(exc).__name__}): is `tunerd run` running?",
            file=sys.stderr,
        )
        return 3
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from tunerd.cli.status import render_status

    answer = _ask_daemon(args, "GET", "/status", lenient=True)
    if isinstance(answer, int):
        return answer
    _, document = answer
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render_status(document if isinstance(document, dict) else {}))
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    answer = _ask_daemon(args, "POST", "/resume")
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
    answer = _ask_daemon(args, "POST", "/restart", {"params": changes, "reason": args.reason})
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
