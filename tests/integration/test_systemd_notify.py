"""The daemon under a systemd-like notify socket: READY, STATUS, WATCHDOG, RELOADING, STOPPING; and vLLM
never sees NOTIFY_SOCKET or WATCHDOG_USEC."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

from tests.harness import running_daemon, wait_until
from tests.integration.conftest import fake_sections


def read_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def test_notify_protocol_and_a_child_environment_without_systemd_variables(workdir: Path) -> None:
    address = str(workdir / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(0.2)
    messages: list[str] = []

    def drain() -> None:
        while True:
            try:
                messages.append(sock.recv(4096).decode())
            except TimeoutError:
                return

    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}  # ping every 0.2 s
    with running_daemon(workdir, fake_sections(workdir), env=env) as daemon:
        daemon.wait_state("RUNNING")
        wait_until(
            lambda: drain() or sum(m == "WATCHDOG=1" for m in messages) >= 2,
            20,
            "two watchdog pings",
        )
        wait_until(
            lambda: drain() or any("STATUS=engine RUNNING" in m for m in messages),
            20,
            "STATUS=engine RUNNING",
        )
        assert any(m.startswith("READY=1") for m in messages)
        for pid in daemon.marked_pids():
            child_env = read_environ(pid)
            assert "NOTIFY_SOCKET" not in child_env and "WATCHDOG_USEC" not in child_env
            assert child_env["PYTHONUNBUFFERED"] == "1"

        daemon.signal(signal.SIGHUP)
        daemon.wait_event("config.reloaded")
        wait_until(lambda: drain() or any(m.startswith("RELOADING=1") for m in messages), 5, "RELOADING=1")

        assert daemon.stop() == 0
        drain()
        assert any(m.startswith("STOPPING=1") for m in messages)
    sock.close()
