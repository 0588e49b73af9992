"""The daemon under a systemd-like notify socket: READY, STATUS, WATCHDOG, RELOADING, STOPPING; and vLLM
never sees NOTIFY_SOCKET or WATCHDOG_USEC."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from pathlib import Path

from tests.harness import running_daemon, wait_until
from tests.integration.conftest import fake_sections


def read_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


class NotifyReader:
    """systemd's side of $NOTIFY_SOCKET: a thread that reads every datagram as it comes (systemd reads
    its socket all the time; a reader that stopped would fill the queue and drop the daemon's messages)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue

    def close(self) -> None:
        """Stop reading, keep what is still queued (the daemon's last messages), close."""
        self._stop.set()
        self._thread.join()
        self.sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                self.messages.append(self.sock.recv(4096).decode())
        self.sock.close()


def test_notify_protocol_and_a_child_environment_without_systemd_variables(workdir: Path) -> None:
    address = str(workdir / "notify.sock")
    reader = NotifyReader(address)
    messages = reader.messages
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}  # ping every 0.2 s
    with running_daemon(workdir, fake_sections(workdir), env=env) as daemon:
        daemon.wait_state("RUNNING")
        wait_until(lambda: sum(m == "WATCHDOG=1" for m in messages) >= 2, 60, "two watchdog pings")
        wait_until(lambda: any("STATUS=engine RUNNING" in m for m in messages), 60, "STATUS=engine RUNNING")
        assert any(m.startswith("READY=1") for m in messages)
        for pid in daemon.marked_pids():
            child_env = read_environ(pid)
            assert "NOTIFY_SOCKET" not in child_env and "WATCHDOG_USEC" not in child_env
            assert child_env["PYTHONUNBUFFERED"] == "1"

        daemon.signal(signal.SIGHUP)
        daemon.wait_event("config.reloaded")
        wait_until(lambda: any(m.startswith("RELOADING=1") for m in messages), 60, "RELOADING=1")

        assert daemon.stop() == 0
    reader.close()
    assert any(m.startswith("STOPPING=1") for m in messages)
