"""Operator commands over a unix socket in the state directory (after supervisorctl's unix_http_server).

`tunerd restart`, `tunerd resume` … talk HTTP to `paths.socket` (default `state_dir/tunerd.sock`). The
socket is mode 0660: the daemon's user and group may use it, nobody else — its file permissions decide
who may change the engine, not a port anyone on the host can reach. Handlers validate what can be
validated without the loop's state and post a `Command` to the loop; a malformed request gets 400 (or
413 / 411), never a crashed or blocked handler (reads are bounded by `REQUEST_TIMEOUT_S`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import socketserver
import threading
from collections.abc import Callable

from tunerd.core.commands import COMMANDS, Command
from tunerd.faces.http import SHUTDOWN_POLL_S, QuietHandler

MAX_BODY = 64 * 1024
SOCKET_MODE = 0o660
_DIGITS = re.compile(r"[0-9]+")  # a Content-Length: no sign, no spaces


class CommandError(ValueError):
    """A request that cannot become a command; `status` is the HTTP answer (400, 404, 411, 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_command(name: str, content_length: str | None, read: Callable[[int], bytes]) -> Command:
    """Turn `POST /<name>` with its Content-Length header and body into a `Command`.

    Raises CommandError: unknown command (404); Content-Length absent while a body follows is not
    detectable and reads as empty; not a plain number (400); over MAX_BODY (413); a body that is not a
    JSON object, `params` that is not an object of scalars, `reason` that is not a string (400).
    """
    if name not in COMMANDS:
        raise CommandError(404, f"unknown command {name!r} (known: {', '.join(sorted(COMMANDS))})")
    text = (content_length or "0").strip()
    if not _DIGITS.fullmatch(text):
        raise CommandError(400, f"Content-Length {content_length!r} is not a byte count")
    length = int(text)
    if length > MAX_BODY:
        raise CommandError(413, f"body of {length} bytes is over {MAX_BODY}")
    raw = read(length) if length else b""
    if len(raw) < length:
        raise CommandError(400, f"body ended after {len(raw)} of {length} bytes")
    try:
        payload = json.loads(raw or b"{}")
    except ValueError:
        raise CommandError(400, "the body is not JSON") from None
    if not isinstance(payload, dict):
        raise CommandError(400, "the body must be a JSON object")
    params = payload.get("params") or {}
    if not isinstance(params, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str)))
        for k, v in params.items()
    ):
        raise CommandError(
            400, '"params" must be an object of NAME: value (numbers, booleans, strings, null)'
        )
    reason = payload.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise CommandError(400, '"reason" must be a string')
    names = payload.get("names") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CommandError(400, '"names" must be a list of parameter names')
    return Command(name, dict(params), reason, tuple(names))


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class OperatorSocket:
    """Serves commands on a unix socket from a daemon thread. `accept(command)` runs on the handler
    thread: it validates against what it knows without the loop's state, enqueues (a `restart --set`
    waits, bounded, for the loop's answer), and returns None, or returns why the command is refused
    (answered 400)."""

    def __init__(self, path: str, accept: Callable[[Command], str | None]) -> None:
        self.path = path
        self.accept = accept
        _claim(path)
        self._server = _UnixHTTPServer(path, self._handler_class())
        os.chmod(path, SOCKET_MODE)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="tunerd-operator", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serving loop: never call it without one
            self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _handler_class(self) -> type[QuietHandler]:
        operator = self

        class Handler(QuietHandler):
            def address_string(self) -> str:
                return "unix"  # a unix peer has no address

            def do_POST(self) -> None:
                if self.headers.get("Transfer-Encoding"):
                    self.reply_json(411, {"error": "send the body with a Content-Length"})
                    return
                try:
                    command = parse_command(
                        self.path.strip("/"), self.headers.get("Content-Length"), self.rfile.read
                    )
                except CommandError as exc:
                    self.reply_json(exc.status, {"error": str(exc)})
                    return
                except OSError:  # the client went away or stopped sending (the read timed out)
                    self.close_connection = True
                    return
                refusal = operator.accept(command)
                with contextlib.suppress(OSError):  # the client may be gone by now: nothing to tell it
                    if refusal is not None:
                        self.reply_json(400, {"error": refusal})
                    else:
                        self.reply_json(202, {"accepted": True})

            def do_GET(self) -> None:
                self.reply_json(405, {"error": "POST a command: " + ", ".join(sorted(COMMANDS))})

        return Handler


def _claim(path: str) -> None:
    """Make `path` free for a new socket: remove a stale one; refuse while another daemon answers on it.

    Raises OSError (EADDRINUSE) when a live daemon holds it, or when the path is too long for a socket.
    """
    if len(os.fsencode(path)) > 107:
        raise OSError(f"{path}: longer than the 107 bytes a unix socket path may have")
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a socket left by a daemon that died
        return
    finally:
        probe.close()
    raise OSError(f"{path}: another tunerd answers on this socket")
