"""A Debian root booted with systemd as PID 1 in a `systemd-nspawn` container, for the system tier.

- `ensure_prerequisites()`: `systemd-container` of the host's systemd version and `debootstrap`, installed
  with apt when missing (`apt-get update` only when the install needs it).
- `cached_root()`: a `debootstrap --variant=minbase` root of the host's Debian release from the mirror apt
  already uses, built once per machine under /var/cache/tunerd-system-tests (~60 s) and copied per run.
- `Container`: boots a copy of it (`--register=no --keep-unit`: no machined or host systemd needed), shares
  the host's network, binds the host's CA certificates and pip configuration read-only (so pip inside
  reaches the package index the way the host does), and runs commands inside with `nsenter`.

Everything raises `Unavailable` with the reason when this machine cannot do it; the conftest turns that
into a skip, or a failure under TUNERD_REQUIRE_SYSTEM=1.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

CACHE = Path(os.environ.get("TUNERD_SYSTEM_CACHE", "/var/cache/tunerd-system-tests"))
RUNS = Path("/var/tmp/tunerd-system-tests")
# What the root holds beyond minbase: systemd as init, dbus (systemd-run), Python for tunerd's venv.
ROOT_PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "ca-certificates", "procps")
# Timers that would start apt or scans in the middle of a test.
MASKED_UNITS = (
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
    "systemd-tmpfiles-clean.timer",
)
ROOT_FORMAT = 1  # change when the preparation of the cached root changes: a new cache entry is built
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Host environment pip (and the tools it runs) reads: passed on to commands inside.
PASSED_ENV = re.compile(
    r"^(PIP_\w+|SSL_CERT_FILE|SSL_CERT_DIR|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|(?i:https?_proxy|no_proxy))$"
)


class Unavailable(Exception):
    """This machine cannot run the system tier; the message says why."""


Log = Callable[[str], None]


def _stderr_log(message: str) -> None:
    print(f"[system tier] {message}", file=sys.stderr, flush=True)


def _run(argv: list[str], timeout: float = 600, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, **kwargs)


# -- prerequisites --------------------------------------------------------------------------------


def os_release() -> dict[str, str]:
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                fields[key] = value.strip().strip('"')
    return fields


def package_version(name: str) -> str | None:
    result = _run(["dpkg-query", "-W", "-f=${Status}\t${Version}", name], timeout=60)
    status, _, version = result.stdout.partition("\t")
    return version if result.returncode == 0 and status.endswith(" installed") else None


def ensure_prerequisites(log: Log = _stderr_log) -> None:
    """systemd-nspawn of the host's systemd version, debootstrap and nsenter, installed if missing."""
    if os.geteuid() != 0:
        raise Unavailable("needs root: systemd-nspawn boots a container with systemd as its PID 1")
    if os_release().get("ID") != "debian" or shutil.which("dpkg-query") is None:
        raise Unavailable(
            "no container support here: the tier builds a Debian root with debootstrap on Debian"
        )
    systemd = package_version("systemd")
    if systemd is None:
        raise Unavailable("no container support here: the host has no systemd package to match")
    wanted = []
    if package_version("systemd-container") != systemd:
        wanted.append(f"systemd-container={systemd}")
    if package_version("debootstrap") is None:
        wanted.append("debootstrap")
    if wanted:
        log(f"installing {' '.join(wanted)}")
        apt = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300"]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        result = _run([*apt, *wanted], env=env)
        if result.returncode != 0:  # a fresh machine: no package lists yet, or old ones
            log("apt-get install failed; apt-get update, then again")
            update = _run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=300"], env=env)
            result = _run([*apt, *wanted], env=env)
            if result.returncode != 0:
                raise Unavailable(
                    f"cannot install {' '.join(wanted)}: {update.stderr[-800:]}{result.stdout[-1500:]}"
                    f"{result.stderr[-1500:]}"
                )
    for tool in ("systemd-nspawn", "debootstrap", "nsenter"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} is missing after installing the prerequisites")


def apt_mirror(codename: str) -> str:
    """The Debian mirror apt uses here for `codename` main (deb822 .sources or one-line lists)."""
    sources = Path("/etc/apt/sources.list.d")
    for path in sorted(sources.glob("*.sources")) if sources.is_dir() else []:
        for stanza in path.read_text().split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                key, sep, value = line.partition(":")
                if sep and not line.startswith((" ", "#")):
                    fields[key.strip().lower()] = value.strip()
            if (
                "deb" in fields.get("types", "").split()
                and codename in fields.get("suites", "").split()
                and "main" in fields.get("components", "").split()
                and fields.get("enabled", "yes") != "no"
            ):
                return fields["uris"].split()[0]
    lists = [Path("/etc/apt/sources.list")] + (sorted(sources.glob("*.list")) if sources.is_dir() else [])
    for path in lists:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(words) >= 4 and words[0] == "deb" and words[2] == codename and "main" in words[3:]:
                    return words[1]
    return "http://deb.debian.org/debian"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_root(log: Log = _stderr_log) -> Path:
    """A debootstrapped root of the host's Debian release, built once and kept under CACHE."""
    codename = os_release().get("VERSION_CODENAME") or "bookworm"
    mirror = apt_mirror(codename)
    key = hashlib.sha256(f"{ROOT_FORMAT} {codename} {' '.join(ROOT_PACKAGES)}".encode()).hexdigest()[:12]
    root = CACHE / f"debian-{codename}-{key}"
    done = root.with_name(root.name + ".complete")
    with _locked(CACHE / ".lock"):
        if done.exists() and (root / "usr" / "lib" / "systemd" / "systemd").exists():
            log(f"cached root {root}")
            return root
        building = root.with_name(root.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        log(f"debootstrap {codename} from {mirror} into {root} (about a minute)")
        started = time.monotonic()
        result = _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(ROOT_PACKAGES)}",
                codename,
                str(building),
                mirror,
            ],
            timeout=900,
        )
        if result.returncode != 0:
            log_file = building / "debootstrap" / "debootstrap.log"
            detail = log_file.read_text()[-2000:] if log_file.exists() else result.stderr[-2000:]
            shutil.rmtree(building, ignore_errors=True)
            raise Unavailable(f"debootstrap {codename} from {mirror} failed: {detail}")
        _prepare_root(building)
        building.rename(root)
        done.write_text(f"{codename} {mirror} {' '.join(ROOT_PACKAGES)}\n")
        log(f"root built in {time.monotonic() - started:.0f} s")
        return root


def _prepare_root(root: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (root / "etc" / "hostname").unlink()  # debootstrap copies the host's: let nspawn name it
    units = root / "etc" / "systemd" / "system"
    for unit in MASKED_UNITS:
        with contextlib.suppress(FileNotFoundError):
            (units / unit).unlink()
        (units / unit).symlink_to("/dev/null")
    shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    (root / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True)


# -- what the container gets from the host ------------------------------------------------------------


def pip_host_paths() -> list[Path]:
    """Files and folders pip's configuration on this host names (config files, certificates, wheel
    folders, file:// indexes, constraint files) and the CA certificates: bound read-only at the same
    paths inside, so that pip there resolves packages exactly as here."""
    paths: set[Path] = set()
    for candidate in ("/etc/ssl/certs", "/usr/local/share/ca-certificates", "/usr/share/ca-certificates"):
        if Path(candidate).is_dir():
            paths.add(Path(candidate))
    debug = _run([sys.executable, "-m", "pip", "config", "debug"], timeout=120).stdout
    for match in re.finditer(r"^\s*(/\S+), exists: True$", debug, re.M):
        paths.add(Path(match.group(1)))
    values = _run([sys.executable, "-m", "pip", "config", "list"], timeout=120).stdout
    texts = [m.group(1) for m in re.finditer(r"^\S+='(.*)'$", values, re.M)]
    texts += [value for key, value in os.environ.items() if PASSED_ENV.match(key)]
    for text in texts:
        for token in text.split():
            path = urlparse(token).path if token.startswith("file:") else token
            if not path.startswith("/") or not Path(path).exists():
                continue
            if token.startswith("file:") and Path(path).name == "simple":
                path = str(Path(path).parent)  # a local index: its pages link to ../../files/…
            paths.add(Path(path))
    # Inside a folder already bound: not again; the container's venv and caches: never.
    ordered = sorted(paths, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in ordered:
        if not any(path.is_relative_to(parent) for parent in kept):
            kept.append(path)
    return kept


def passed_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if PASSED_ENV.match(key)}


def copy_checkout(repo: Path, target: Path) -> None:
    """The checkout as an operator's clone would have it: tracked and untracked-not-ignored files."""
    listing = _run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    if listing.returncode == 0:
        names = [name for name in listing.stdout.split("\0") if name]
    else:  # not a git checkout (a tarball): everything but the usual build and tool output
        skip = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
        names = [
            str(path.relative_to(repo))
            for path in repo.rglob("*")
            if path.is_file() and not skip.intersection(path.relative_to(repo).parts)
        ]
    for name in names:
        source = repo / name
        if not source.is_file() or source.is_symlink():
            continue
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination)


# -- the container ----------------------------------------------------------------------------------


def _halt_with_parent() -> None:
    """In the forked nspawn: SIGTERM (an orderly halt of the container) when the test process dies,
    however it dies, so that no container outlives a killed test run."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class Container:
    """One booted container. `run()` executes inside it; the host path of its root is `self.root`."""

    def __init__(self, name: str, root: Path, log: Log = _stderr_log) -> None:
        self.name = name
        self.root = root
        self.log = log
        self.run_dir = root.parent
        self.console_log = self.run_dir / "console.log"
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.leader: int | None = None
        self.env = {
            "PATH": PATH,
            "LANG": "C.UTF-8",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
            "TERM": "dumb",
        }
        self.env.update(passed_env())

    @classmethod
    def create(cls, base: Path, log: Log = _stderr_log) -> Container:
        name = f"tunerd-tier-{os.getpid()}"
        for stale in RUNS.glob("tunerd-tier-*") if RUNS.is_dir() else []:  # of runs killed before their end
            owner = stale.name.removeprefix("tunerd-tier-")
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                shutil.rmtree(stale, ignore_errors=True)
        run_dir = RUNS / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        root = run_dir / "root"
        copied = _run(["cp", "-a", "--reflink=auto", str(base), str(root)], timeout=600)
        if copied.returncode != 0:
            raise Unavailable(f"cannot copy the cached root: {copied.stderr[-1000:]}")
        return cls(name, root, log)

    def boot(self, binds_ro: list[Path], binds_rw: dict[Path, str], timeout: float = 180) -> None:
        argv = [
            "systemd-nspawn",
            f"--directory={self.root}",
            f"--machine={self.name}",
            "--boot",
            "--register=no",  # no machined on the host
            "--keep-unit",  # no host systemd to make a scope
            "--console=read-only",
            "--link-journal=no",
            "--resolv-conf=copy-host",
            "--timezone=off",
        ]
        for path in binds_ro:
            argv.append(f"--bind-ro={path}")
        for source, target in binds_rw.items():
            argv.append(f"--bind={source}:{target}")
        self.log(f"booting {self.name}")
        with open(self.console_log, "wb") as console:
            self.nspawn = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_halt_with_parent,
            )
        deadline = time.monotonic() + timeout
        while self.leader is None:
            self._check_nspawn()
            self.leader = self._find_leader()
            if time.monotonic() > deadline:
                raise Unavailable(f"no container support: systemd-nspawn started no init:\n{self.console()}")
            time.sleep(0.1)
        while True:
            state = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=timeout)
            if state.stdout.strip() in ("running", "degraded"):
                break
            self._check_nspawn()
            if time.monotonic() > deadline:
                raise Unavailable(f"the container did not finish booting: {state.stdout}{state.stderr}")
            time.sleep(0.2)  # systemd is up but its socket is not yet: ask again
        if state.stdout.strip() == "degraded":
            failed = self.run(["systemctl", "--failed", "--no-legend"], check=False).stdout
            self.log(f"container booted degraded: {failed.strip()}")

    def _check_nspawn(self) -> None:
        assert self.nspawn is not None
        if self.nspawn.poll() is not None:
            code = self.nspawn.returncode
            raise Unavailable(f"no container support: systemd-nspawn exited with {code}:\n{self.console()}")

    def _find_leader(self) -> int | None:
        """The container's PID 1 as the host sees it: nspawn's child, in a pid namespace of its own."""
        assert self.nspawn is not None
        own_ns = os.readlink("/proc/self/ns/pid")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid != self.nspawn.pid or os.readlink(f"/proc/{entry}/ns/pid") == own_ns:
                    continue
                status = Path(f"/proc/{entry}/status").read_text()
            except (OSError, ValueError, IndexError):
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if nspid and nspid[-1] == "1":
                return int(entry)
        return None

    def console(self) -> str:
        try:
            return self.console_log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def run(
        self,
        command: str | list[str],
        *,
        user: str | None = None,
        check: bool = True,
        timeout: float = 120,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` (a shell line, or an argv) inside the container, as root or as `user` (with
        that user's groups, as a login would give them)."""
        assert self.leader is not None
        argv = command if isinstance(command, list) else ["/bin/sh", "-c", command]
        variables = {**self.env, "HOME": "/root" if user is None else f"/home/{user}", **(env or {})}
        if user is not None:
            variables |= {"USER": user, "LOGNAME": user}
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *argv]
        full = [
            "nsenter",
            f"--target={self.leader}",
            "--mount",
            "--uts",
            "--ipc",
            "--net",
            "--pid",
            "--cgroup",
            "--root",
            "--wd",
            "--",
            "/usr/bin/env",
            "-i",
            *[f"{key}={value}" for key, value in variables.items()],
            *argv,
        ]
        result = _run(full, timeout=timeout)
        if check and result.returncode != 0:
            shown = command if isinstance(command, str) else shlex.join(command)
            raise AssertionError(
                f"in the container{' as ' + user if user else ''}: {shown}\nexit {result.returncode}\n"
                f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
            )
        return result

    def json(self, command: str | list[str], **kwargs: Any) -> Any:
        return json.loads(self.run(command, **kwargs).stdout)

    def path(self, inside: str) -> Path:
        """The host's path of a file inside the container (its root is a folder here)."""
        return self.root / inside.lstrip("/")

    def write(self, inside: str, text: str, mode: int = 0o644) -> None:
        """Write a file inside atomically (a reader never sees half of it), owned by root."""
        target = self.path(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.tier-{os.getpid()}")
        temporary.write_text(text)
        temporary.chmod(mode)
        temporary.replace(target)

    def stop(self) -> None:
        """Halt the container (SIGTERM to nspawn = an orderly shutdown), then remove its folder."""
        if self.nspawn is not None and self.nspawn.poll() is None:
            self.nspawn.send_signal(signal.SIGTERM)
            try:
                self.nspawn.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.nspawn.pid, signal.SIGKILL)
                self.nspawn.wait(timeout=30)
        if os.environ.get("TUNERD_SYSTEM_KEEP") != "1":
            shutil.rmtree(self.run_dir, ignore_errors=True)
        else:
            self.log(f"kept {self.run_dir} (TUNERD_SYSTEM_KEEP=1)")
