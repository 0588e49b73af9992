"""What the `tunerd` subcommands share: the exit codes, the `-c/--config` option, loading the config or
printing why not (`file: key: reason`), and finding and asking the running daemon. Imported by `main` and
by each subcommand module; it imports none of them (no import circle through `main`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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


def config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        default=None,
        help="config file (default: $TUNERD_CONFIG or /etc/tunerd/tunerd.toml)",
    )


def report_problems(problems: Iterable[str]) -> None:
    """Print a config's problems on stderr, one `file: key: reason` a line, at journald's err priority
    when stderr is the journal (`tunerd run` at the unit's start, `tunerd check-config` as ExecReload=)."""
    from tunerd.faces.logs import print_error_lines  # structlog: only imported when there is an error

    for problem in problems:
        print_error_lines(problem)


def load_or_report(path: str) -> Config | None:
    try:
        return load_config(path)
    except ConfigError as exc:
        report_problems(exc.problems)
        return None


def load_all_or_report(path: str) -> Loaded | None:
    """The config and its rules file, or None after printing every problem as `file: key: reason`."""
    try:
        return load_all(path)
    except ConfigError as exc:
        report_problems(exc.problems)
        return None


@dataclass(frozen=True)
class DaemonPlace:
    """Where the running daemon's files and read-only endpoint are, and whether the config said so
    (`lenient`: the config on disk does not load, so they come from what of it validates, or the
    defaults, and the address the daemon recorded in its state dir is believed first)."""

    paths: PathsConfig
    export: ExportConfig
    lenient: bool = False


def daemon_place(config_path: str, command: str) -> DaemonPlace:
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


def recorded_address(paths: PathsConfig) -> tuple[str, int] | None:
    """host:port the running daemon wrote to state_dir/export.addr when it started."""
    try:
        host, _, text = paths.export_address_file.read_text().strip().rpartition(":")
        return host, int(text)
    except (OSError, ValueError):
        return None


def daemon_url(place: DaemonPlace) -> str:
    """Where the running daemon listens: the config's export address, or the one it wrote at start (that
    one first when the config did not load: the daemon may run on a different one)."""
    host, port = place.export.host, place.export.port
    if port == 0 or place.lenient:
        recorded = recorded_address(place.paths)
        if recorded is not None:
            host, port = recorded
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def journal_path(config_path: str) -> str:
    """The journal `tunerd journal` reads: the config's; when the config does not load, the one the
    running daemon reports in its status (it writes there whatever the file says now), else the
    fallback paths' (see daemon_place)."""
    place = daemon_place(config_path, "journal")
    if not place.lenient:
        return str(place.paths.journal_path)
    import httpx

    try:
        document = httpx.get(daemon_url(place) + "/status", timeout=5.0, trust_env=False).json()
        journal = document["daemon"]["journal"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        journal = None
    if isinstance(journal, str) and journal:
        print(f"tunerd journal: reading {journal}, the running daemon's journal", file=sys.stderr)
        return journal
    path = str(place.paths.journal_path)
    print(f"tunerd journal: no running daemon answered; reading {path}", file=sys.stderr)
    return path


def ask_daemon(
    args: argparse.Namespace, method: str, path: str, body: dict | None = None, lenient: bool = False
) -> tuple[int, object] | int:
    """(status code, decoded JSON) from the running daemon, or an exit code after printing why.

    Reading (`GET /status`) goes to the read-only TCP endpoint; commands (`POST`) go over the operator
    socket, whose permissions decide who may use them. `lenient`: a config that does not load is no
    reason to fail, the daemon is looked for where it recorded itself (see daemon_place).
    """
    import httpx

    config_path = args.config or default_config_path()
    if lenient:
        place = daemon_place(config_path, path.strip("/"))
    else:
        config = load_or_report(config_path)
        if config is None:
            return EX_CONFIG
        place = DaemonPlace(config.paths, config.export)
    if method == "GET":
        url, transport, where = daemon_url(place) + path, None, daemon_url(place)
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
