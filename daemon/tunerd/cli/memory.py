"""`tunerd memory show|export|import`: the tuning memory (`records.experience`) for operators.

The memory is the file `paths.state_dir/experience.json` of the config (`-c`, `$TUNERD_CONFIG`,
/etc/tunerd/tunerd.toml). `show` prints what it knows per model, hardware, vLLM version and workload:
entries, the best configuration by each objective the entries measured (ranked in that objective's
direction: the highest throughput, the lowest latency; values of different objectives never compare),
the values known to be bad, where each entry came from (local, an import, a box of the fleet) and,
with `[memory] url`, the other boxes' entries in the shared database (what they kept, what lost there);
`export FILE` writes it to FILE (`-`: stdout) to carry to another box; `import FILE` merges such a file
in (no duplicates), beside a running daemon too (the file is locked while it changes). Exit status: 0
done; 1 a file could not be read or written, or is not a memory of this format version; 78 the config
does not load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tunerd.config import Config, ConfigError, default_config_path, load_config
from tunerd.config.memory import redact
from tunerd.policy.objective import direction_of
from tunerd.records.experience import (
    MAX_ENTRIES,
    Entry,
    Experience,
    ExperienceFormatError,
    experience_path,
)

EX_OK, EX_FAILED, EX_CONFIG = 0, 1, 78


def add_commands(sub: Any, config_option: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `memory show|export|import` on the `tunerd` subparsers `sub`."""
    memory = sub.add_parser("memory", help="the tuning memory: what was measured, per model and load")
    actions = memory.add_subparsers(metavar="ACTION")
    memory.set_defaults(func=lambda _args: _usage(memory))

    show = actions.add_parser("show", help="per model, hardware, vLLM and load: best settings, bad values")
    config_option(show)
    show.add_argument("--json", action="store_true", help="the same as JSON, for scripts")
    show.set_defaults(func=cmd_memory_show)

    export = actions.add_parser("export", help="write the memory to FILE (- for stdout), for another box")
    config_option(export)
    export.add_argument("file", metavar="FILE")
    export.set_defaults(func=cmd_memory_export)

    imp = actions.add_parser("import", help="merge FILE (a `tunerd memory export`) in, without duplicates")
    config_option(imp)
    imp.add_argument("file", metavar="FILE")
    imp.set_defaults(func=cmd_memory_import)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _open(args: argparse.Namespace, command: str) -> tuple[Experience, Config] | int:
    """The memory of the config's state dir, or EX_CONFIG after printing the config's problems."""
    try:
        config = load_config(args.config or default_config_path())
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EX_CONFIG
    memory = Experience(experience_path(config.paths.state_dir))
    if memory.load_error:
        print(f"tunerd memory {command}: {memory.load_error}", file=sys.stderr)
    return memory, config


def summary(memory: Experience, objective: str | None = None) -> list[dict[str, Any]]:
    """One dict per key: entries (how many, unverified among them), the best entry of each objective
    its entries have values of — ranked in that objective's direction, the configured `objective`'s
    first — and the bad values. Values of an objective this tunerd does not know, and of entries that
    name none (trials written before entries named their objective), are not ranked."""
    rows = []
    for key in memory.known_keys():
        entries = memory.entries(key)
        names = sorted(memory.objectives(key), key=lambda name: name != objective)
        bests = []
        for name in names:
            direction = direction_of(name)
            if direction is None:
                continue
            for unit in memory.units(key, name):  # goodput in req/s and in tok/s never compare
                best = memory.best_entry(key, objective=name, maximize=direction == "higher", unit=unit)
                if best is not None:
                    bests.append(_entry_row(best))
        rows.append(
            {
                "key": asdict(key),
                "text": key.text,
                "entries": len(entries),
                "unverified": sum(not e.verified for e in entries),
                "last": _when(entries[-1].at),
                "best": bests,
                "bad_values": [{"param": p, "value": v, "why": why} for p, v, why in memory.bad_values(key)],
                "from": sources(entries),
            }
        )
    return rows


def source(entry: Entry) -> str:
    """Where an entry came from: "local" (measured here), "import FILE", or "fleet HOST"."""
    if entry.host is not None:
        return f"fleet {entry.host}"
    return f"import {entry.origin}" if entry.origin is not None else "local"


def sources(entries: list[Entry]) -> dict[str, int]:
    """How many of `entries` came from where (`source`), in the order first seen."""
    counts: dict[str, int] = {}
    for entry in entries:
        counts[source(entry)] = counts.get(source(entry), 0) + 1
    return counts


def fleet_rows(snapshot: tuple[Entry, ...]) -> list[dict[str, Any]]:
    """Per key of the other boxes' entries: how many from which host, the values that lost there, the
    values kept there (what a box takes before its first trial of a parameter: tune/fleet.py)."""
    from tunerd.tune.fleet import fleet_bad_values

    rows = []
    for key in dict.fromkeys(e.key for e in snapshot):
        entries = [e for e in snapshot if e.key == key]
        kept = [
            {"param": e.figures["param"], "value": e.params.get(e.figures["param"]), "host": e.host}
            for e in entries
            if e.kind == "trial" and e.decision == "keep" and isinstance(e.figures.get("param"), str)
        ]
        bad = [{"param": b.param, "value": b.value, "why": b.why} for b in fleet_bad_values(entries, key)]
        rows.append(
            {"key": asdict(key), "text": key.text, "from": sources(entries), "kept": kept, "bad_values": bad}
        )
    return rows


def render_summary(path: Path, rows: list[dict[str, Any]]) -> str:
    total = sum(row["entries"] for row in rows)
    lines = [f"{path}: {total} entries (the last {MAX_ENTRIES} are kept), {len(rows)} model/load keys"]
    if not rows:
        lines.append("nothing measured yet")
    for row in rows:
        unverified = f", {row['unverified']} unverified (an upgrade since)" if row["unverified"] else ""
        lines += ["", row["text"], f"  entries: {row['entries']}{unverified}; last {row['last']}"]
        if not row["best"]:
            lines.append("  best: none verified yet")
        for best in row["best"]:
            value = " ".join(
                part
                for part in (best["objective_name"], f"{best['objective']:.4g}", best["objective_unit"])
                if part
            )
            source = f", {best['objective_source']}" if best["objective_source"] else ""
            lines.append(
                f"  best: {_params(best['params'])}  ({value}{source}; "
                f"{best['kind']} {best['decision']} {best['at']})"
            )
        for bad in row["bad_values"]:
            lines.append(f"  bad:  {bad['param']}={bad['value']}  ({bad['why']})")
        lines.append(f"  from: {_from(row['from'])}")
    return "\n".join(lines)


def render_fleet(url: str | None, rows: list[dict[str, Any]] | None, error: str | None) -> str:
    """The other boxes' entries (`fleet_rows`), or why they could not be read."""
    if error is not None:
        return f"\nfleet {url}: not read ({error})"
    assert rows is not None
    lines = ["", f"fleet {url}: {sum(sum(r['from'].values()) for r in rows)} entries of other boxes"]
    for row in rows:
        lines += ["", row["text"], f"  from: {_from(row['from'])}"]
        for kept in row["kept"]:
            lines.append(f"  kept: {kept['param']}={kept['value']}  (fleet {kept['host']})")
        for bad in row["bad_values"]:
            lines.append(f"  bad:  {bad['param']}={bad['value']}  ({bad['why']})")
    return "\n".join(lines)


def _from(counts: dict[str, int]) -> str:
    return ", ".join(f"{where} {count}" for where, count in counts.items())


def read_fleet(config: Config) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The fleet's rows when `[memory] url` is set: (rows, None), or (None, why not)."""
    import socket

    from tunerd.records.fleet_store import FleetError, FleetStore

    memory = config.memory
    assert memory.url is not None
    try:
        snapshot = FleetStore(memory, memory.host or socket.gethostname()).fetch()
    except FleetError as exc:
        return None, str(exc)
    return fleet_rows(snapshot), None


def cmd_memory_show(args: argparse.Namespace) -> int:
    opened = _open(args, "show")
    if isinstance(opened, int):
        return opened
    memory, config = opened
    objective = config.tuning.objective
    rows = summary(memory, objective)
    fleet, fleet_error, url = None, None, redact(config.memory.url)
    if config.memory.url is not None:
        fleet, fleet_error = read_fleet(config)
    if args.json:
        document = {"path": str(memory.path), "objective": objective, "keys": rows}
        if url is not None:
            document["fleet"] = {"url": url, "keys": fleet, "error": fleet_error}
        print(json.dumps(document, indent=2, ensure_ascii=False))
    else:
        print(render_summary(memory.path, rows))
        if url is not None:
            print(render_fleet(url, fleet, fleet_error))
    return EX_OK if memory.load_error is None else EX_FAILED


def cmd_memory_export(args: argparse.Namespace) -> int:
    opened = _open(args, "export")
    if isinstance(opened, int):
        return opened
    memory, _ = opened
    if memory.load_error is not None:
        print("tunerd memory export: not exporting a memory that did not read whole", file=sys.stderr)
        return EX_FAILED
    if args.file == "-":
        sys.stdout.write(memory.text())
        return EX_OK
    try:
        count = memory.export(args.file)
    except OSError as exc:
        print(f"tunerd memory export: {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return EX_FAILED
    print(f"{count} entries written to {args.file}")
    return EX_OK


def cmd_memory_import(args: argparse.Namespace) -> int:
    opened = _open(args, "import")
    if isinstance(opened, int):
        return opened
    memory, _ = opened
    try:
        report = memory.import_(args.file)
    except ExperienceFormatError as exc:
        print(f"tunerd memory import: {exc}", file=sys.stderr)
        return EX_FAILED
    except OSError as exc:
        where = exc.filename or args.file
        hint = ""
        if isinstance(exc, PermissionError) and os.fspath(where) != os.fspath(args.file):
            hint = " (the state dir is the daemon's: run it as the daemon's user, e.g. sudo -u tunerd)"
        print(f"tunerd memory import: {where}: {exc.strerror or exc}{hint}", file=sys.stderr)
        return EX_FAILED
    for reason in report.skipped:
        print(f"tunerd memory import: {args.file}: skipped {reason}", file=sys.stderr)
    dropped = ""
    if report.dropped:
        dropped = f"; the oldest {report.dropped} dropped (the last {MAX_ENTRIES} are kept)"
    print(
        f"imported {args.file}: {report.added} entries added, {report.duplicates} already known; "
        f"{report.total} in {memory.path}{dropped}"
    )
    return EX_OK


def _entry_row(entry: Entry) -> dict[str, Any]:
    return {
        "params": dict(entry.params),
        "objective": entry.objective,
        "objective_name": entry.objective_name,
        "objective_unit": entry.objective_unit,
        "objective_source": entry.objective_source,
        "kind": entry.kind,
        "decision": entry.decision,
        "at": _when(entry.at),
    }


def _params(params: dict[str, Any]) -> str:
    return " ".join(f"{name}={value}" for name, value in sorted(params.items())) or "(defaults)"


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
