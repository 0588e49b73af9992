"""tunerd's own endpoint on 127.0.0.1:9464: Prometheus `/metrics` (tunerd_*), `/status` JSON, commands.

The main loop publishes; HTTP handler threads only read the last published snapshot (an immutable
reference swap) or post a command to the loop's queue.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tunerd.records.metrics import Metrics

COMMANDS = frozenset({"resume", "restart"})
MAX_COMMAND_BODY = 64 * 1024


class Exporter:
    """Serves `/metrics`, `/status` and `POST /resume` from a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Metrics,
        post_command: Callable[[str, dict[str, Any]], str | None],
    ) -> None:
        self.metrics = metrics
        self.post_command = post_command
        self._snapshot: dict[str, Any] = {}
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="tunerd-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def publish(self, snapshot: dict[str, Any]) -> None:
        """Replace the status snapshot (called by the main loop only)."""
        self._snapshot = snapshot

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "tunerd"

            def do_GET(self) -> None:
                if self.path.split("?")[0] == "/metrics":
                    self._reply(200, generate_latest(exporter.metrics.registry), CONTENT_TYPE_LATEST)
                elif self.path.split("?")[0] == "/status":
                    body = json.dumps(exporter._snapshot, default=str).encode()
                    self._reply(200, body, "application/json")
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def do_POST(self) -> None:
                name = self.path.strip("/")
                if name not in COMMANDS:
                    self._reply(404, b"unknown command\n", "text/plain")
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_COMMAND_BODY:
                    self._reply(413, b'{"error": "body too large"}\n', "application/json")
                    return
                try:
                    payload = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    payload = None
                if not isinstance(payload, dict):
                    self._reply(400, b'{"error": "the body must be a JSON object"}\n', "application/json")
                    return
                error = exporter.post_command(name, payload)
                if error is not None:
                    self._reply(400, json.dumps({"error": error}).encode() + b"\n", "application/json")
                    return
                self._reply(202, b'{"accepted": true}\n', "application/json")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes every few seconds would flood the daemon's log

        return Handler
