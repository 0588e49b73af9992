"""A real PostgreSQL for the tests: Debian's package (`apt-get install postgresql`; scripts/test.sh
installs it), a throwaway cluster in a temporary directory started by the test setup.

initdb refuses to run as root, so under root the cluster belongs to an unprivileged user (`postgres`,
which Debian's package creates, else `nobody`) and its commands run through `runuser -u`. It listens on
127.0.0.1 on a free port (password authentication, scram-sha-256: a wrong password is refused as on a
real server) and on a Unix socket in its own directory, never the system's /var/run/postgresql.

Missing binaries skip the tests, unless TUNERD_REQUIRE_POSTGRES=1 (scripts/test.sh) makes it a failure.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.harness import free_port

USER = "tunerd"
PASSWORD = "fleet-test-secret"


def bindir() -> Path | None:
    """The newest installed PostgreSQL's bin directory (Debian: /usr/lib/postgresql/N/bin), else the one
    of an `initdb` on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class Cluster:
    """One PostgreSQL cluster: `start`, `stop`, `url(database)`, `create_database`."""

    def __init__(self, bin_dir: Path, root: Path, owner: str | None) -> None:
        self.bin = bin_dir
        self.root = root
        self.data = root / "data"
        self.sockets = root / "sockets"
        self.log = root / "postgres.log"
        self.owner = owner  # run as this user (we are root), None: as ourselves
        self.port = free_port()

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if self.owner is not None:
            command = ["runuser", "-u", self.owner, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=self.root)
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stderr}\n{log}")
        return result

    def init(self) -> None:
        self.sockets.mkdir()
        password_file = self.root / "pw"
        password_file.write_text(PASSWORD)
        if self.owner is not None:
            uid, gid = pwd.getpwnam(self.owner).pw_uid, pwd.getpwnam(self.owner).pw_gid
            for path in (self.root, self.sockets, password_file):
                os.chown(path, uid, gid)
        self._run(
            "initdb", "-D", str(self.data), "-U", USER, "--auth=scram-sha-256", f"--pwfile={password_file}",
            "--no-sync", "-E", "UTF8", "--locale=C",
        )  # fmt: skip
        password_file.unlink()

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.sockets} -F"
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start"
        )

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def url(self, database: str = "postgres", *, password: str | None = None) -> str:
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{USER}{secret}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database; its URL (no password in it: the tests pass it by file or environment)."""
        import psycopg

        with psycopg.connect(self.url(), password=PASSWORD, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
        return self.url(name)


@contextmanager
def cluster() -> Iterator[Cluster]:
    """A started cluster in a temporary directory, stopped and removed at the end."""
    bin_dir = bindir()
    if bin_dir is None:
        if os.environ.get("TUNERD_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL is not installed (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    owner = None
    if os.geteuid() == 0:
        owner = "postgres" if _user_exists("postgres") else "nobody"
    # Not under pytest's tmp dir: it is root's (0700) and the cluster's user could not enter it.
    root = Path(tempfile.mkdtemp(prefix="tunerd-pg-"))
    pg = Cluster(bin_dir, root, owner)
    try:
        pg.init()
        pg.start()
        yield pg
    finally:
        with contextlib.suppress(RuntimeError):  # already stopped (a test stopped it, then failed)
            pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
