"""The shared tuning memory's database: PostgreSQL through psycopg 3 (`[memory] url`).

Blocking I/O, called from a worker job only (tune/fleet.py submits it), never on the loop. One short
connection per exchange (every `sync_interval_s`): it sends the entries not yet sent and, when asked,
fetches what the other boxes measured. Sending is idempotent (`ON CONFLICT (id) DO NOTHING`): an entry
sent twice — an exchange cut after the commit, a daemon restart — is stored once.

The schema is versioned: `tunerd_schema_version` holds the versions applied, `MIGRATIONS` the ordered
SQL of each. A tunerd applies the migrations newer than the database's version, under an advisory lock
(two boxes starting at once apply each one once). A migration only adds (tables, nullable columns,
indexes), and a tunerd reads and writes only the columns it names, so an older tunerd goes on working
against a database a newer one migrated (during a rolling upgrade): it reports the newer version and
refuses nothing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # the `fleet` extra (pyproject.toml): a box without it tunes alone, and says why
    import psycopg
    from psycopg.types.json import Jsonb
except ImportError:  # pragma: no cover - the test extra installs it
    psycopg = None  # type: ignore[assignment]

from tunerd.config.memory import CREDENTIAL_NAME, MemoryConfig
from tunerd.records.experience import Entry

# (version, SQL), oldest first; never edit an applied one: add the next.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """CREATE TABLE tunerd_experiments (
            id text PRIMARY KEY,
            host text NOT NULL,
            at double precision NOT NULL,
            model text NOT NULL,
            hardware text NOT NULL,
            vllm text,
            workload text NOT NULL,
            kind text NOT NULL,
            param text,
            old_value jsonb,
            new_value jsonb,
            decision text NOT NULL,
            objective text,
            objective_value double precision,
            objective_unit text,
            objective_source text,
            params jsonb NOT NULL,
            figures jsonb NOT NULL,
            unverified text,
            stored_at timestamptz NOT NULL DEFAULT now()
        )""",
    ),
    (
        2,
        "CREATE INDEX tunerd_experiments_key ON tunerd_experiments (model, hardware, workload, param)",
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]
_LOCK = 0x74756E65  # pg_advisory_xact_lock key of the migrations ("tune")
FETCH_LIMIT = 5000  # the newest entries of other boxes in one snapshot

_COLUMNS = (
    "id, host, at, model, hardware, vllm, workload, kind, param, old_value, new_value, decision, "
    "objective, objective_value, objective_unit, objective_source, params, figures, unverified"
)


class FleetError(Exception):
    """The database could not be reached or used; the message says why (no password in it). `config`:
    the cause is tunerd's configuration (a wrong password, user or database, an unreadable password
    file, psycopg missing), not an outage."""

    def __init__(self, reason: str, *, config: bool = False) -> None:
        super().__init__(reason)
        self.config = config


# libpq's messages that name a configuration problem rather than an outage (its wording, libpq 15-17).
_CONFIG_MESSAGES = (
    "password authentication failed",
    "no password supplied",
    "does not exist",
    "invalid connection option",
    "invalid URI",
    "invalid integer value",
    "pg_hba.conf",
)


@dataclass(frozen=True)
class Exchange:
    """What one exchange did: the ids `sent` (stored now or already), the other boxes' entries
    (`snapshot`; None: not fetched this time), the database's schema version."""

    sent: tuple[str, ...]
    snapshot: tuple[Entry, ...] | None
    schema: int


def read_password(config: MemoryConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """`password_file`, else the systemd credential, else None (libpq then reads `PGPASSWORD`).
    Raises FleetError when the named file cannot be read."""
    if config.password_file is not None:
        try:
            return config.password_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise FleetError(
                f"memory.password_file: {config.password_file}: {exc.strerror or exc}", config=True
            ) from None
    directory = environ.get("CREDENTIALS_DIRECTORY")
    if directory:
        credential = Path(directory) / CREDENTIAL_NAME
        if credential.is_file():
            return credential.read_text(encoding="utf-8").strip()
    return None


class FleetStore:
    """The database of `config.url`, as `host`."""

    def __init__(self, config: MemoryConfig, host: str) -> None:
        assert config.url is not None
        self.config = config
        self.url = config.url
        self.host = host

    def exchange(self, entries: Sequence[Entry], *, fetch: bool) -> Exchange:
        """Migrate if needed, send `entries` (this box's), fetch the others' when `fetch`. Raises
        FleetError (why, redacted)."""
        password = self._password()
        try:
            with self._connect(password) as conn:
                schema = migrate(conn)
                send(conn, self.host, entries)
                snapshot = fetch_others(conn, self.host) if fetch else None
        except psycopg.Error as exc:
            raise _error(exc, password) from None
        return Exchange(tuple(e.entry_id() for e in entries), snapshot, schema)

    def fetch(self) -> tuple[Entry, ...]:
        """The other boxes' entries (`tunerd memory show`); nothing written. Raises FleetError."""
        password = self._password()
        try:
            with self._connect(password) as conn:
                exists = conn.execute("SELECT to_regclass('tunerd_experiments') IS NOT NULL").fetchone()
                return fetch_others(conn, self.host) if exists and exists[0] else ()
        except psycopg.Error as exc:
            raise _error(exc, password) from None

    def check(self) -> int:
        """Connect and read the schema's version (0: none yet) — `tunerd check-config`. Raises
        FleetError."""
        password = self._password()
        try:
            with self._connect(password) as conn:
                exists = conn.execute("SELECT to_regclass('tunerd_schema_version') IS NOT NULL").fetchone()
                if not exists or not exists[0]:
                    return 0
                row = conn.execute("SELECT coalesce(max(version), 0) FROM tunerd_schema_version").fetchone()
                return int(row[0]) if row else 0
        except psycopg.Error as exc:
            raise _error(exc, password) from None

    def _password(self) -> str | None:
        if psycopg is None:
            raise FleetError("psycopg is not installed (pip install 'vllm-tunerd[fleet]')", config=True)
        return read_password(self.config)

    def _connect(self, password: str | None) -> psycopg.Connection[Any]:
        options: dict[str, Any] = {
            "connect_timeout": max(2, math.ceil(self.config.connect_timeout_s)),  # libpq: whole seconds, ≥ 2
            "application_name": f"tunerd {self.host}",
            # A statement that hangs (a lock, a sick server) fails instead of holding the job forever.
            "options": f"-c statement_timeout={int(self.config.connect_timeout_s * 4000)}",
        }
        if password is not None:
            options["password"] = password
        return psycopg.connect(self.url, **options)


def migrate(conn: psycopg.Connection[Any]) -> int:
    """Apply the migrations newer than the database's version (under an advisory lock: once, when two
    boxes start at once); returns the database's version, which may be newer than `SCHEMA_VERSION`."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS tunerd_schema_version ("
            "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now(), by_host text)"
        )
        row = conn.execute("SELECT coalesce(max(version), 0) FROM tunerd_schema_version").fetchone()
        current = int(row[0]) if row else 0
        for version, sql in MIGRATIONS:
            if version > current:
                conn.execute(sql)  # type: ignore[arg-type]  # literal SQL of this module
                conn.execute(
                    "INSERT INTO tunerd_schema_version (version, by_host) VALUES (%s, %s)",
                    (version, os.uname().nodename),
                )
                current = version
    return current


def send(conn: psycopg.Connection[Any], host: str, entries: Sequence[Entry]) -> None:
    """Store `entries` (measured by `host`); one already stored (its id) is left as it is."""
    if not entries:
        return
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(
            f"INSERT INTO tunerd_experiments ({_COLUMNS}) VALUES "
            "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (id) DO NOTHING",
            [_row(entry, host) for entry in entries],
        )


def fetch_others(conn: psycopg.Connection[Any], host: str) -> tuple[Entry, ...]:
    """The newest `FETCH_LIMIT` entries measured by other boxes than `host`, oldest first."""
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM tunerd_experiments WHERE host <> %s ORDER BY at DESC LIMIT %s",
        (host, FETCH_LIMIT),
    ).fetchall()
    entries = []
    for row in reversed(rows):
        entry = _entry(row)
        if entry is not None:
            entries.append(entry)
    return tuple(entries)


def _row(entry: Entry, host: str) -> tuple[Any, ...]:
    param = entry.figures.get("param")
    param = param if isinstance(param, str) else None
    new = entry.params.get(param) if param is not None else None
    key = entry.key
    return (
        entry.entry_id(), host, entry.at, key.model, key.hardware, key.vllm, key.workload,
        entry.kind, param, Jsonb(entry.figures.get("old")), Jsonb(new), entry.decision,
        entry.objective_name, entry.objective, entry.objective_unit, entry.objective_source,
        Jsonb(dict(entry.params)), Jsonb(dict(entry.figures)), entry.unverified,
    )  # fmt: skip


def _entry(row: Sequence[Any]) -> Entry | None:
    """The entry of a row; None for one this tunerd cannot read (a kind of a newer tunerd)."""
    (id_, host, at, model, hardware, vllm, workload, kind, _param, _old, _new, decision,
     objective, value, unit, source, params, figures, unverified) = row  # fmt: skip
    try:
        return Entry.from_dict(
            {
                "key": {"model": model, "hardware": hardware, "vllm": vllm, "workload": workload},
                "kind": kind,
                "params": params,
                "objective": value,
                "decision": decision,
                "figures": figures,
                "at": at,
                "unverified": unverified,
                "objective_name": objective,
                "objective_unit": unit,
                "objective_source": source,
                "id": id_,
                "host": host,
            }
        )
    except (KeyError, TypeError, ValueError):
        return None


def _error(exc: Exception, password: str | None) -> FleetError:
    """libpq's message (its lines joined), without the password should it appear in it; `config` when
    it names a configuration problem."""
    text = "; ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    text = text or type(exc).__name__
    if password:
        text = text.replace(password, "***")
    return FleetError(text, config=any(marker in text for marker in _CONFIG_MESSAGES))
