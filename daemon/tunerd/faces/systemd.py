"""The systemd notify protocol, written directly on $NOTIFY_SOCKET (no libsystemd dependency).

READY=1 once the daemon is up, STATUS=<engine state>, WATCHDOG=1 from the main loop, RELOADING=1
and STOPPING=1. Without $NOTIFY_SOCKET (not under systemd) every call is a cheap no-op.

The socket is non-blocking: the calls run on the daemon's loop, and a datagram socket whose reader has
stopped reading blocks its sender once the reader's queue is full (net.unix.max_dgram_qlen, 10 by
default: 2 s of watchdog pings at WATCHDOG_USEC=400000). A message that does not fit is dropped and the
call says False; the next STATUS or WATCHDOG=1 carries the state again. (Seen on CI: a loop frozen in
sendto for 30 s under a notify socket nobody drained.)
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    """Sends notify messages; remembers the watchdog interval systemd asked for."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._sock: socket.socket | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        wanted = usec.isdigit() and (not pid or pid == str(os.getpid()))
        # Ping at half the interval systemd enforces, as sd_watchdog_enabled(3) recommends.
        self.watchdog_interval_s: float | None = int(usec) / 2e6 if wanted else None
        self._last_watchdog = 0.0

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *fields: str) -> bool:
        """Send `KEY=value` fields in one datagram, never blocking. False when not under systemd, on error,
        or when the reader's queue is full (the message is dropped)."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                self._sock = socket.socket(socket.AF_UNIX, kind)
            self._sock.sendto("\n".join(fields).encode(), self._address)
        except OSError:
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def reloading(self) -> bool:
        # systemd >= 253 wants MONOTONIC_USEC with RELOADING=1 (Type=notify-reload); harmless before.
        return self.send(
            "RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
        )

    def reloaded(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self, now: float) -> bool:
        """Ping the watchdog if half its interval has passed since the last ping (monotonic `now`)."""
        if self.watchdog_interval_s is None or now - self._last_watchdog < self.watchdog_interval_s:
            return False
        self._last_watchdog = now
        return self.send("WATCHDOG=1")


def _socket_address(value: str) -> str | None:
    if not value:
        return None
    if value.startswith("@"):  # abstract namespace
        return "\0" + value[1:]
    return value if value.startswith("/") else None
