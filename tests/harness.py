"""Run `tunerd run` as a real child process in a test, and look at what it did.

Used by tests/integration (with the fake vLLM) and tests/engine (with real vLLM). The daemon runs in
its own session so a test can SIGTERM or SIGKILL it like systemd would; everything it leaves behind is
found by its marker (`TUNERD_INSTANCE` in the environment) and checked, then cleaned up.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tunerd.procfs import processes as procfs

REPO = Path(__file__).resolve().parents[1]
FAKE_VLLM = REPO / "tests" / "fake_vllm" / "fake_vllm.py"
FIXTURES = REPO / "tests" / "fixtures"
# How long a wait gives a condition before it fails the test. A bound for a failure only: a passing test
# waits for its condition, never this long. Generous, because CI's 2-core boxes differ 2x in speed and run
# two tiers at once beside real vLLM (30 s lost races there: a daemon's first RUNNING under load).
WAIT_S = 180.0

Record = dict[str, Any]


_HANDED_OUT: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, for a server a test is about to start.

    Drawn below the kernel's ephemeral range, never from it: a port that bind(0) handed out and the test
    released can be handed again to any socket bound to port 0, or to any outgoing connection, before the
    test's server binds it. CI saw it: a daemon's export listener (port 0) took the port its vLLM was
    about to bind, and the start waited on "port … is held by" the daemon itself until FATAL. The xdist
    workers draw from separate slices, and one process never hands out the same port twice.
    """
    top = _ephemeral_start()
    bottom = max(1024, top - 12000)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (top - bottom) // max(workers, 1)
    first = bottom + size * (worker % max(workers, 1))
    for _ in range(size):
        port = random.randrange(first, first + size)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {first}..{first + size}")


def short_socket_path(workdir: Path) -> str:
    """A unix socket path for a daemon under `workdir` that fits the 107 bytes a socket path may have
    (pytest's temporary directories are often longer)."""
    candidate = workdir / "tunerd.sock"
    if len(os.fsencode(candidate)) <= 100:
        return str(candidate)
    import hashlib

    digest = hashlib.sha256(str(workdir).encode()).hexdigest()[:12]
    return f"/tmp/tunerd-test-{digest}.sock"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(type(value))


def render_config(sections: dict[str, dict[str, Any]]) -> str:
    """TOML text from {"engine": {...}, "engine.params": {...}, ...} (nested tables as dotted names)."""
    lines: list[str] = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


class Daemon:
    """One `tunerd run` child with its config, state dir and journal."""

    def __init__(self, workdir: Path, sections: dict[str, dict[str, Any]], env: dict[str, str] | None = None):
        self.workdir = workdir
        self.config_path = workdir / "tunerd.toml"
        self.state_dir = workdir / "state"
        self.journal_path = self.state_dir / "journal.jsonl"
        self.stderr_path = workdir / "tunerd.stderr"
        self.sections = sections
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.write_config(sections)

    # -- config --------------------------------------------------------------------------------

    def write_config(self, sections: dict[str, dict[str, Any]]) -> None:
        self.sections = sections
        paths = sections.setdefault("paths", {})
        paths["state_dir"] = str(self.state_dir)
        paths.setdefault("socket", short_socket_path(self.workdir))
        self.config_path.write_text(render_config(sections))

    @property
    def socket_path(self) -> str:
        return str(self.sections["paths"]["socket"])

    # -- life --------------------------------------------------------------------------------------

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tunerd", "run", "--config", str(self.config_path)],
                stdout=err,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = WAIT_S) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = WAIT_S) -> int:
        """SIGTERM like systemd; returns the exit status."""
        self.signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- what it did ---------------------------------------------------------------------------

    def records(self) -> list[Record]:
        if not self.journal_path.exists():
            return []
        out = []
        for line in self.journal_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def events(self) -> list[str]:
        return [r["event"] for r in self.records()]

    def wait_record(
        self, predicate: Callable[[Record], bool], timeout: float = WAIT_S, after_seq: int = 0
    ) -> Record:
        """The first journal record after `after_seq` matching `predicate`; fails the test on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.records():
                if record["seq"] > after_seq and predicate(record):
                    return record
            self._check_alive()
            time.sleep(0.05)
        raise AssertionError(f"no matching journal record in {timeout} s; journal:\n{self.dump()}")

    def wait_event(self, event: str, timeout: float = WAIT_S, after_seq: int = 0, **fields: Any) -> Record:
        return self.wait_record(
            lambda r: r["event"] == event and all(r.get(k) == v for k, v in fields.items()),
            timeout,
            after_seq,
        )

    def last_seq(self) -> int:
        records = self.records()
        return records[-1]["seq"] if records else 0

    def status(self) -> dict[str, Any]:
        address = (self.state_dir / "export.addr").read_text().strip()
        return httpx.get(f"http://{address}/status", timeout=5, trust_env=False).json()

    def command(self, name: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """POST an operator command over the daemon's unix socket, as `tunerd restart` does."""
        transport = httpx.HTTPTransport(uds=self.socket_path)
        with httpx.Client(transport=transport, timeout=5, trust_env=False) as client:
            return client.post(f"http://tunerd/{name}", json=body or {})

    def cli(self, *args: str, timeout: float = 3600) -> str:
        """`tunerd ARGS --config <this daemon's>`; its stdout. Exits with its output when it fails (the
        bench scripts' operator commands)."""
        done = subprocess.run(
            [sys.executable, "-m", "tunerd", *args, "--config", str(self.config_path)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise SystemExit(f"tunerd {' '.join(args)} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def metrics_text(self) -> str:
        address = (self.state_dir / "export.addr").read_text().strip()
        return httpx.get(f"http://{address}/metrics", timeout=5, trust_env=False).text

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one sample of the daemon's /metrics (`name` as exposed, e.g. with `_total`), or
        None when the daemon does not expose it."""
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None

    def uptime(self) -> float | None:
        """The daemon's own uptime, as its loop last published it (None while it cannot be read)."""
        try:
            return float(self.status()["daemon"]["uptime_s"])
        except (OSError, httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def signals_snapshot(self) -> dict[str, Any] | None:
        try:
            return self.status()["signals"]
        except (OSError, httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def observe(self, seconds: float, samples: int = 0, timeout: float = 120) -> None:
        """Let the daemon watch for `seconds` of its own time and fold at least `samples` more polls.

        For assertions that something does NOT happen (no restart, no spawn, no wedge verdict): the
        window is measured by the daemon's published uptime, not by a sleep in the test, so a daemon
        starved of CPU does not make the window pass unobserved; a new poll is seen as a change of the
        signals document (host rates and memory move with every poll).
        """
        start = None
        seen = 0
        last = self.signals_snapshot()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = self.uptime()
            if start is None:
                start = up
            snapshot = self.signals_snapshot()
            if snapshot is not None and snapshot != last:
                seen, last = seen + 1, snapshot
            if start is not None and up is not None and up >= start + seconds and seen >= samples:
                return
            self._check_alive()
            time.sleep(0.05)
        raise AssertionError(
            f"the daemon did not watch for {seconds} s of its time with {samples} polls in {timeout} s "
            f"(saw {seen} polls); journal:\n{self.dump()}"
        )

    def wait_state(self, state: str, timeout: float = WAIT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                last = self.status()
                if last.get("engine", {}).get("state") == state:
                    return last
            except (OSError, httpx.HTTPError, ValueError):
                pass
            self._check_alive()
            time.sleep(0.1)
        raise AssertionError(
            f"engine not {state} in {timeout} s; last status {last}; journal:\n{self.dump()}"
        )

    def wait_running(self, pid: int, timeout: float = WAIT_S) -> dict[str, Any]:
        """The status once it shows engine `pid` RUNNING (the status document may lag the journal by a
        fraction of a second: a plain wait_state right after an action can see the old engine)."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                last = self.status()
                engine = last.get("engine", {})
                if engine.get("state") == "RUNNING" and engine.get("pid") == pid:
                    return last
            except (OSError, httpx.HTTPError, ValueError):
                pass
            self._check_alive()
            time.sleep(0.1)
        raise AssertionError(
            f"engine {pid} not RUNNING in {timeout} s; last status {last}; journal:\n{self.dump()}"
        )

    def instance_id(self) -> str:
        return json.loads((self.state_dir / "state.json").read_text())["instance_id"]

    def marked_pids(self) -> list[int]:
        """Live processes carrying this daemon's marker (vLLM's whole tree while it runs)."""
        try:
            marker = self.instance_id()
        except (OSError, KeyError, ValueError):
            return []
        return [p for p in procfs.pids_with_env("TUNERD_INSTANCE", marker) if alive(p)]

    def dump(self) -> str:
        text = "\n".join(json.dumps(r) for r in self.records()[-40:])
        if self.stderr_path.exists():
            text += "\n--- tunerd stderr (tail) ---\n" + "\n".join(
                self.stderr_path.read_text().splitlines()[-30:]
            )
        return text

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None and self.proc.returncode != 0:
            raise AssertionError(f"tunerd exited with {self.proc.returncode}:\n{self.dump()}")

    def cleanup(self) -> list[int]:
        """Kill the daemon and anything it left; return the pids that were still there."""
        leftovers = self.marked_pids()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        return leftovers


def assert_in_order(events: list[str], expected: list[str]) -> None:
    """`expected` occurs in `events` in this order (other events may come between)."""
    position = 0
    for name in expected:
        try:
            position = events.index(name, position) + 1
        except ValueError:
            raise AssertionError(f"{name!r} missing after position {position} in {events}") from None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no memory, port or GPU)."""
    stat = procfs.read_stat(pid)
    return stat is not None and stat.state != "Z"


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def holds_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """`condition` stays true, looked at every 0.05 s, for `seconds`: an observation window for a claim
    that something does NOT happen (a process that must not exit, a port that must not answer), used
    only once a condition wait has shown the moment it would otherwise have happened has come."""
    deadline = time.monotonic() + seconds
    while True:
        if not condition():
            raise AssertionError(f"{what}: stopped holding within {seconds} s")
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def wait_record_with_pids_dead(
    daemon: Daemon,
    pids: list[int],
    predicate: Callable[[Record], bool],
    timeout: float = WAIT_S,
    after_seq: int = 0,
) -> Record:
    """The first journal record after `after_seq` matching `predicate`; fails unless every process in
    `pids` was already dead (zombies count as dead: `alive`) when the record was written.

    Each round looks at the pids first and reads the journal second. A record first seen in round k was
    written after round k-1's read; if round k-1's look found every pid dead, they died before the
    record was written. A record present at the first read, or first seen in a round after a look that
    found one alive, cannot be shown to come after the deaths: that fails too (callers leave a gap, such
    as a backoff delay, between the deaths and the record in a correct daemon).
    """
    dead_before_last_read = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        living = [pid for pid in pids if alive(pid)]
        for record in daemon.records():
            if record["seq"] > after_seq and predicate(record):
                if not dead_before_last_read:
                    raise AssertionError(
                        f"{record['event']} (seq {record['seq']}) was journaled before all of {pids} were "
                        f"seen dead (alive at the last look: {living}); journal:\n{daemon.dump()}"
                    )
                return record
        dead_before_last_read = not living
        daemon._check_alive()
        time.sleep(0.05)
    raise AssertionError(f"no matching journal record in {timeout} s; journal:\n{daemon.dump()}")


@contextmanager
def running_daemon(
    workdir: Path,
    sections: dict[str, dict[str, Any]],
    env: dict[str, str] | None = None,
    *,
    stop_timeout: float = 60,
) -> Iterator[Daemon]:
    """A started daemon; on exit it is stopped (SIGTERM, `stop_timeout`), killed if need be, and the test
    fails if it left any process behind."""
    daemon = Daemon(workdir, sections, env)
    daemon.start()
    try:
        yield daemon
        if daemon.running:
            assert daemon.stop(timeout=stop_timeout) == 0, daemon.dump()
        assert not daemon.marked_pids(), f"processes left behind: {daemon.marked_pids()}\n{daemon.dump()}"
    finally:
        daemon.cleanup()
