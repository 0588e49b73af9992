"""vLLM's dev endpoints: when tunerd may reset the prefix cache, and the reset's retries.

The fake server answers `POST /reset_prefix_cache` from a script of (status, body) in the forms vLLM
0.32.0 gave (vllm/entrypoints/serve/dev/cache/api_router.py, and a real server under load): 200
`{"success":true}`; 200 `{"success":false}` while KV blocks are in use; 404 without
VLLM_SERVER_DEV_MODE (the route is not registered); 200 with an empty body from vLLM before the
success flag. `sleep` is a recorder: nothing waits.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tunerd.engine.admin import dev_mode, reset_prefix_cache
from tunerd.faces.http import SHUTDOWN_POLL_S  # shutdown() waits up to one poll

DONE = (200, b'{"success":true}')
IN_USE = (200, b'{"success":false}')
NOT_FOUND = (404, b'{"detail":"Not Found"}')


class ScriptServer:
    """Answers each POST with the next (status, body) of `script` (the last one repeats), each after
    `delay_s`; `held` is how long each answer was held, on the server's own monotonic clock."""

    def __init__(self, script: list[tuple[int, bytes]], delay_s: float = 0.0) -> None:
        self.script = list(script)
        self.paths: list[str] = []
        self.held: list[float] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                received = time.monotonic()
                server.paths.append(self.path)
                time.sleep(delay_s)  # the known delay, not a synchronisation
                server.held.append(time.monotonic() - received)
                status, body = server.script.pop(0) if len(server.script) > 1 else server.script[0]
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[list[tuple[int, bytes]]], ScriptServer]]:
    servers: list[ScriptServer] = []

    def start(script: list[tuple[int, bytes]], delay_s: float = 0.0) -> ScriptServer:
        servers.append(ScriptServer(script, delay_s))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def test_success_at_once(serve: Callable[..., ScriptServer]) -> None:
    server, sleeps = serve([DONE], delay_s=0.05), Sleeps()
    result = reset_prefix_cache(server.url, retries=5, retry_after_s=10.0, sleep=sleeps)
    assert (result.ok, result.attempts) == (True, 1)
    assert sleeps == [] and result.detail == 'HTTP 200 {"success": true}'
    assert server.paths == ["/reset_prefix_cache"]  # never reset_running_requests: live requests stay
    # The reset's duration contains the server's: it was asked before the server received, and answered
    # after the server held the answer 0.05 s (both on this process's monotonic clock).
    assert result.seconds >= server.held[0] >= 0.05


def test_in_use_twice_then_success(serve: Callable[..., ScriptServer]) -> None:
    server, sleeps = serve([IN_USE, IN_USE, DONE]), Sleeps()
    result = reset_prefix_cache(server.url, retries=5, retry_after_s=10.0, sleep=sleeps)
    assert (result.ok, result.attempts) == (True, 3)
    assert sleeps == [10.0, 10.0]
    assert len(server.paths) == 3


def test_gives_up_after_retries(serve: Callable[..., ScriptServer]) -> None:
    server, sleeps = serve([IN_USE]), Sleeps()
    result = reset_prefix_cache(server.url, retries=2, retry_after_s=3.0, sleep=sleeps)
    assert (result.ok, result.attempts) == (False, 3)
    assert sleeps == [3.0, 3.0] and len(server.paths) == 3
    assert "in use" in result.detail and "gave up after 3 attempts" in result.detail


def test_no_retries_means_one_attempt(serve: Callable[..., ScriptServer]) -> None:
    server, sleeps = serve([IN_USE]), Sleeps()
    result = reset_prefix_cache(server.url, retries=0, retry_after_s=3.0, sleep=sleeps)
    assert (result.ok, result.attempts, sleeps) == (False, 1, [])


def test_404_dev_mode_off_is_not_retried(serve: Callable[..., ScriptServer]) -> None:
    server, sleeps = serve([NOT_FOUND, DONE]), Sleeps()
    result = reset_prefix_cache(server.url, retries=5, retry_after_s=1.0, sleep=sleeps)
    assert (result.ok, result.attempts, sleeps) == (False, 1, [])
    assert "404" in result.detail and "VLLM_SERVER_DEV_MODE" in result.detail
    assert len(server.paths) == 1


def test_other_status_is_not_retried(serve: Callable[..., ScriptServer]) -> None:
    server, sleeps = serve([(500, b'{"error":{"message":"boom"}}'), DONE]), Sleeps()
    result = reset_prefix_cache(server.url, retries=5, retry_after_s=1.0, sleep=sleeps)
    assert (result.ok, result.attempts, sleeps) == (False, 1, [])
    assert result.detail.startswith("HTTP 500")


def test_old_vllm_empty_body(serve: Callable[..., ScriptServer]) -> None:
    server = serve([(200, b"")])
    result = reset_prefix_cache(server.url, retries=5, retry_after_s=1.0, sleep=Sleeps())
    assert (result.ok, result.attempts) == (True, 1)
    assert "does not say" in result.detail


def test_connection_refused_never_raises() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sleeps = Sleeps()
    result = reset_prefix_cache(f"http://127.0.0.1:{port}", retries=3, retry_after_s=1.0, sleep=sleeps)
    assert (result.ok, result.attempts, sleeps) == (False, 1, [])
    assert result.detail.startswith("connection: ConnectError")


def test_failing_sleep_never_raises(serve: Callable[..., ScriptServer]) -> None:
    server = serve([IN_USE])

    def broken(seconds: float) -> None:
        raise RuntimeError("interrupted")

    result = reset_prefix_cache(server.url, retries=3, retry_after_s=1.0, sleep=broken)
    assert (result.ok, result.attempts) == (False, 1) and "interrupted" in result.detail


def test_given_client_is_used_and_left_open(serve: Callable[..., ScriptServer]) -> None:
    server = serve([IN_USE, DONE])
    with httpx.Client(trust_env=False) as client:
        result = reset_prefix_cache(server.url, retries=1, retry_after_s=0.5, sleep=Sleeps(), client=client)
        assert result.ok and result.attempts == 2
        assert not client.is_closed


@pytest.mark.parametrize(
    ("env", "host", "allowed", "says"),
    [
        ({"VLLM_SERVER_DEV_MODE": "1"}, "127.0.0.1", True, "VLLM_SERVER_DEV_MODE=1"),
        ({"VLLM_SERVER_DEV_MODE": "1"}, "127.0.0.2", True, "loopback"),
        ({"VLLM_SERVER_DEV_MODE": "1"}, "::1", True, "loopback"),
        ({"VLLM_SERVER_DEV_MODE": "1"}, "[::1]", True, "loopback"),
        ({"VLLM_SERVER_DEV_MODE": "1"}, "localhost", True, "loopback"),
        ({}, "127.0.0.1", False, "VLLM_SERVER_DEV_MODE is not set"),
        ({"VLLM_SERVER_DEV_MODE": "0"}, "127.0.0.1", False, "turns vLLM's dev endpoints off"),
        ({"VLLM_SERVER_DEV_MODE": "true"}, "127.0.0.1", False, "not an integer"),
        ({"VLLM_SERVER_DEV_MODE": "1"}, "0.0.0.0", False, "not a loopback address"),
        ({"VLLM_SERVER_DEV_MODE": "1"}, "", False, "not a loopback address"),
        ({"VLLM_SERVER_DEV_MODE": "1"}, "10.1.2.3", False, "not a loopback address"),
        ({"VLLM_SERVER_DEV_MODE": "1"}, "gpu-box.local", False, "not a loopback address"),
    ],
)
def test_dev_mode(env: dict[str, str], host: str, allowed: bool, says: str) -> None:
    ok, reason = dev_mode(env, host)
    assert ok is allowed and says in reason


def test_dev_mode_names_both_missing() -> None:
    ok, reason = dev_mode({"PATH": "/usr/bin"}, "0.0.0.0")
    assert not ok
    assert "VLLM_SERVER_DEV_MODE is not set" in reason and "0.0.0.0, not a loopback address" in reason
