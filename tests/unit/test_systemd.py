"""The systemd notify protocol, received on a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tunerd.engine.launch import SYSTEMD_CHILD_ENV_BLOCKLIST
from tunerd.faces.systemd import Notifier


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket standing in for systemd's, and its path for NOTIFY_SOCKET."""
    path = tmp_path / "n.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    yield sock, str(path)
    sock.close()


def received(sock: socket.socket) -> list[dict[str, str]]:
    """Every datagram waiting on `sock`, each as its KEY=value fields."""
    messages = []
    while True:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return messages
        messages.append(dict(line.split("=", 1) for line in data.decode().split("\n")))


def test_ready_sends_ready_status_and_main_pid(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("engine starting")
    assert received(sock) == [{"READY": "1", "STATUS": "engine starting", "MAINPID": str(os.getpid())}]


def test_status_sends_one_status_field(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path})
    assert notifier.status("engine FATAL: model not found")
    assert notifier.status("engine RUNNING")
    assert received(sock) == [{"STATUS": "engine FATAL: model not found"}, {"STATUS": "engine RUNNING"}]


def test_a_reader_that_stopped_reading_drops_messages_and_never_blocks_the_loop(
    notify_socket: tuple[socket.socket, str],
) -> None:
    """The calls run on the daemon's loop: once the reader's queue is full (net.unix.max_dgram_qlen), a
    blocking sendto would freeze the loop until someone reads (seen on CI). A message that does not fit
    is dropped (False); once read, the next one gets through. (A blocking socket hangs this test.)"""
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path})
    sent = [notifier.status(f"engine STARTING {n}") for n in range(1000)]
    assert sent[0] and not sent[-1]  # the queue filled and the rest were dropped
    kept = received(sock)
    assert kept == [{"STATUS": f"engine STARTING {n}"} for n in range(sent.index(False))]
    assert notifier.status("engine RUNNING")
    assert received(sock) == [{"STATUS": "engine RUNNING"}]


def test_reloading_sends_reloading_with_monotonic_usec(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path})
    assert notifier.reloading()
    (message,) = received(sock)
    assert message["RELOADING"] == "1"
    assert message["MONOTONIC_USEC"].isdigit()
    assert int(message["MONOTONIC_USEC"]) > 0


def test_reloaded_sends_ready_again_with_status(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path})
    assert notifier.reloaded("config reloaded")
    assert received(sock) == [{"READY": "1", "STATUS": "config reloaded"}]


def test_stopping_sends_stopping_and_status(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path})
    assert notifier.stopping("stopping engine")
    assert received(sock) == [{"STOPPING": "1", "STATUS": "stopping engine"}]


def test_watchdog_pings_only_after_half_the_interval(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"})  # 10 s
    assert notifier.watchdog_interval_s == 5.0
    assert notifier.watchdog(1000.0)  # first ping
    assert not notifier.watchdog(1002.0)
    assert not notifier.watchdog(1004.999)
    assert notifier.watchdog(1005.0)
    assert not notifier.watchdog(1009.0)
    assert notifier.watchdog(1010.5)
    assert received(sock) == [{"WATCHDOG": "1"}] * 3


def test_watchdog_first_ping_waits_half_the_interval_from_clock_zero(
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
    assert not notifier.watchdog(1.0)
    assert notifier.watchdog(2.0)
    assert received(sock) == [{"WATCHDOG": "1"}]


def test_watchdog_is_off_without_watchdog_usec(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    notifier = Notifier(environ={"NOTIFY_SOCKET": path})
    assert notifier.watchdog_interval_s is None
    assert not notifier.watchdog(10_000.0)
    assert received(sock) == []


def test_watchdog_meant_for_another_pid_is_ignored(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    other_pid = str(os.getpid() + 1)
    notifier = Notifier(
        environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": other_pid}
    )
    assert notifier.watchdog_interval_s is None
    assert not notifier.watchdog(10_000.0)
    assert received(sock) == []


def test_watchdog_meant_for_this_pid_is_used(notify_socket: tuple[socket.socket, str]) -> None:
    _, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(environ=env).watchdog_interval_s == 0.5


def test_garbage_watchdog_usec_leaves_the_watchdog_off(notify_socket: tuple[socket.socket, str]) -> None:
    _, path = notify_socket
    assert Notifier(environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "soon"}).watchdog_interval_s is None


def test_abstract_socket_name_is_used() -> None:
    name = f"tunerd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.setblocking(False)
    try:
        notifier = Notifier(environ={"NOTIFY_SOCKET": "@" + name})
        assert notifier.enabled
        assert notifier.status("abstract")
        assert received(sock) == [{"STATUS": "abstract"}]
    finally:
        sock.close()


def test_without_notify_socket_every_call_returns_false() -> None:
    notifier = Notifier(environ={"WATCHDOG_USEC": "1000000"})
    assert not notifier.enabled
    assert notifier.ready("x") is False
    assert notifier.status("x") is False
    assert notifier.reloading() is False
    assert notifier.reloaded("x") is False
    assert notifier.stopping("x") is False
    assert notifier.watchdog(10_000.0) is False


def test_relative_notify_socket_path_is_ignored() -> None:
    notifier = Notifier(environ={"NOTIFY_SOCKET": "relative/notify"})
    assert not notifier.enabled
    assert notifier.status("x") is False


def test_send_to_a_vanished_socket_returns_false(tmp_path: Path) -> None:
    notifier = Notifier(environ={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.enabled
    assert notifier.status("x") is False


def test_child_env_blocklist_covers_notify_and_watchdog() -> None:
    assert {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} <= set(SYSTEMD_CHILD_ENV_BLOCKLIST)
