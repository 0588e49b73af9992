"""tunerd.service inside the test container, driven the way an operator drives it: systemctl, journalctl,
the `tunerd` command (as root or as another user), /etc/tunerd/tunerd.toml edited in place.

The engine is the fake vLLM (tests/fake_vllm), copied to /opt/fake-vllm inside with the fixtures it
replays; it listens on a port of its own (the container shares the host's network).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from tests.harness import render_config
from tests.system.container import Container

CHECKOUT = "/root/tunerd"  # where the operator's clone of the repository lies inside
UNIT = "tunerd.service"
CONFIG = "/etc/tunerd/tunerd.toml"
STATE_DIR = "/var/lib/tunerd"
JOURNAL = f"{STATE_DIR}/journal.jsonl"
MODEL = "/srv/models/tiny"
FAKE_VLLM = "/opt/fake-vllm/tests/fake_vllm/fake_vllm.py"
PROBE = "/opt/tier/probe.py"
DROP_IN = "/etc/systemd/system/tunerd.service.d/ci.conf"
OPERATOR = "opsuser"  # an operator: in group tunerd (and systemd-journal)
OUTSIDER = "visitor"  # another user: in neither
RUNNING = re.compile(r"^engine RUNNING \(pid (\d+)\)$")

T = TypeVar("T")
Record = dict[str, Any]


class Service:
    def __init__(self, box: Container, engine_port: int, export_port: int) -> None:
        self.box = box
        self.engine_port = engine_port
        self.export_port = export_port

    # -- the config ---------------------------------------------------------------------------------

    def sections(self, **overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The operator's config: the fake vLLM, quick timeouts; `overrides` (engine__env=...) replace
        keys of a section."""
        sections: dict[str, dict[str, Any]] = {
            "engine": {"command": ["/usr/bin/python3", FAKE_VLLM], "model": MODEL, "port": self.engine_port},
            "engine.env": {"FAKE_VLLM_STARTUP_S": "0.5"},
            "engine.params": {"max_model_len": 512, "kv_cache_memory_bytes": 1_000_000, "block_size": 32},
            "timeouts": {
                "startup_s": 60.0,
                "graceful_stop_s": 4.0,
                "unready_stop_s": 2.0,
                "health_interval_s": 0.5,
                "health_timeout_s": 1.0,
                "health_failures": 2,
            },
            # 3 s of BACKOFF: long enough to read STATUS= during it.
            "backoff": {"initial_s": 3.0, "max_s": 6.0, "known_good_after_s": 2.0, "max_failures": 3},
            "export": {"host": "127.0.0.1", "port": self.export_port},
            "logging": {"format": "json", "level": "info"},
        }
        for section, values in overrides.items():
            sections.setdefault(section.replace("__", "."), {}).update(values)
        return sections

    def config_text(self, **overrides: dict[str, Any]) -> str:
        return "# written by tests/system as an operator would\n" + render_config(self.sections(**overrides))

    def write_config(self, text: str) -> None:
        self.box.write(CONFIG, text)

    def current_config(self) -> str:
        return self.box.path(CONFIG).read_text()

    # -- systemd ------------------------------------------------------------------------------------

    def systemctl(self, *args: str, check: bool = True, timeout: float = 180) -> Any:
        return self.box.run(["systemctl", *args], check=check, timeout=timeout)

    def show(self) -> dict[str, str]:
        props = (
            "ActiveState,SubState,Result,MainPID,StatusText,NRestarts,ExecMainStatus,ExecMainCode,"
            "ActiveEnterTimestampMonotonic,ExecMainStartTimestampMonotonic,ControlGroup,ReloadResult"
        )
        text = self.box.run(["systemctl", "show", UNIT, f"--property={props}"]).stdout
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def main_pid(self) -> int:
        return int(self.show()["MainPID"])

    def journal_cursor(self) -> str:
        out = self.box.run(["journalctl", "--show-cursor", "-n", "0", "-q"]).stdout
        match = re.search(r"-- cursor: (\S+)", out)
        assert match, out
        return match.group(1)

    def journal_entries(
        self, cursor: str | None, *args: str, user: str | None = None
    ) -> list[dict[str, Any]]:
        """journalctl -u tunerd [args] as JSON entries, those after `cursor` only.

        `--cursor` and not `--after-cursor`: with a filter such as `-p err`, journalctl seeks to the
        first matching entry at or after the cursor and `--after-cursor` then skips that one as well.
        """
        argv = ["journalctl", "-u", UNIT, "--no-pager", "-q", "-o", "json"]
        argv += ["--cursor", cursor] if cursor else []
        out = self.box.run([*argv, *args], user=user, check=False).stdout
        entries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return [e for e in entries if e.get("__CURSOR") != cursor]

    def journal(self, cursor: str | None, *args: str, user: str | None = None) -> str:
        """The messages of `journal_entries`, one a line."""
        return "\n".join(str(e.get("MESSAGE", "")) for e in self.journal_entries(cursor, *args, user=user))

    # -- tunerd and its engine ---------------------------------------------------------------------

    def as_unit_user(self, engine_pid: int, argv: list[str], check: bool = True) -> Any:
        """Run `argv` as the unit's user inside the service's own mount namespace (that of the engine:
        ProtectSystem=strict, PrivateTmp= and the rest of the unit's sandbox)."""
        sandbox = ["nsenter", f"--target={engine_pid}", "--mount", "--"]
        sandbox += ["setpriv", "--reuid=tunerd", "--regid=tunerd", "--init-groups", "--"]
        return self.box.run([*sandbox, *argv], check=check)

    def tunerd(self, *args: str, user: str | None = None, check: bool = True) -> Any:
        return self.box.run(["tunerd", *args], user=user, check=check)

    def status_document(self) -> dict[str, Any] | None:
        """The daemon's /status, read from here (the container shares this host's network)."""
        try:
            url = f"http://127.0.0.1:{self.export_port}/status"
            return httpx.get(url, timeout=10, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            return None

    def status_text(self) -> str:
        return self.show()["StatusText"]

    def procs(self) -> list[dict[str, Any]]:
        return self.box.json(["python3", PROBE, "procs"])

    def environ(self, pid: int) -> dict[str, str]:
        return self.box.json(["python3", PROBE, "environ", str(pid)])

    def engine_group(self, engine_pid: int) -> list[dict[str, Any]]:
        """The engine's process group (the fake's API server, engine core and worker share it)."""
        return [p for p in self.procs() if p["pgid"] == engine_pid]

    def survivors(self, snapshot: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Which processes of an earlier snapshot still exist (same pid and start time: not a reuse)."""
        now = {(p["pid"], p["start"]) for p in self.procs() if p["state"] != "Z"}
        return [p for p in snapshot if (p["pid"], p["start"]) in now]

    def records(self) -> list[Record]:
        path = self.box.path(JOURNAL)
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a torn last line (SIGKILL mid-write): repaired later
                out.append(json.loads(line))
        return out

    def last_seq(self) -> int:
        records = self.records()
        return records[-1]["seq"] if records else 0

    def wait_record(
        self, predicate: Callable[[Record], bool], after_seq: int, what: str, timeout: float = 60
    ) -> Record:
        return self.wait(
            lambda: next((r for r in self.records() if r["seq"] > after_seq and predicate(r)), None),
            what,
            timeout,
        )

    def wait(self, probe: Callable[[], T | None], what: str, timeout: float = 60, every: float = 0.2) -> T:
        """Poll `probe` until it returns something truthy; fail with the service's state otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s\n{self.diagnostics()}")
            time.sleep(every)

    def wait_running(self, *, other_than: int | None = None, timeout: float = 90) -> int:
        """The engine's pid once STATUS= says it serves (and it is a different one than `other_than`)."""

        def serving() -> int | None:
            show = self.show()
            match = RUNNING.match(show["StatusText"])
            if show["ActiveState"] != "active" or not match or int(match.group(1)) == other_than:
                return None
            pid = int(match.group(1))
            # /status (what `tunerd status` shows) is published at the end of the loop step that sent
            # STATUS=: wait for it too, so that what follows sees one story.
            engine = (self.status_document() or {}).get("engine", {})
            return pid if (engine.get("state"), engine.get("pid")) == ("RUNNING", pid) else None

        return self.wait(
            serving, f"engine RUNNING{f' (not pid {other_than})' if other_than else ''}", timeout
        )

    def ensure_running(self) -> int:
        """The operator's base config in place, the service active, the engine serving: its pid."""
        base = self.config_text()
        if self.current_config() != base:
            self.write_config(base)
            if self.show()["ActiveState"] == "active":
                self.systemctl("reload", UNIT)
        if self.show()["ActiveState"] != "active":
            self.systemctl("reset-failed", UNIT, check=False)
            self.systemctl("start", UNIT)
        return self.wait_running()

    def diagnostics(self) -> str:
        status = self.box.run(
            ["systemctl", "status", UNIT, "--no-pager", "-l", "-n", "0"], check=False
        ).stdout
        logs = self.box.run(
            ["journalctl", "-u", UNIT, "--no-pager", "-n", "60", "-o", "short-precise"], check=False
        )
        records = "\n".join(json.dumps(r)[:400] for r in self.records()[-25:])
        return (
            f"--- systemctl status\n{status}\n--- journalctl -u tunerd\n{logs.stdout}\n"
            f"--- tunerd journal\n{records}"
        )


@dataclass
class Installed:
    """What the session fixture did once: install.sh, the first `systemctl start` and what systemd said
    right after it."""

    service: Service
    first_install: subprocess.CompletedProcess[str]
    render_before: subprocess.CompletedProcess[str]
    start: subprocess.CompletedProcess[str]
    after_start: dict[str, str]
