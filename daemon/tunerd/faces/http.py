"""tunerd's read-only endpoint on 127.0.0.1:9464: Prometheus `/metrics` (tunerd_*) and `/status` JSON.

The main loop publishes; handler threads only read the last published snapshot (an immutable reference
swap). Nothing here changes the daemon: commands go over the operator socket (`faces.operator`), whose
file permissions decide who may use them.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tunerd.records.metrics import Metrics

REQUEST_TIMEOUT_S = 5.0  # a client that stops sending holds a handler thread this long at most
# How often a serving loop checks for shutdown(): stop() waits up to this long. socketserver's default is
# 0.5 s, which every daemon stop (and every test's teardown) paid in full.
SHUTDOWN_POLL_S = 0.05


class QuietHandler(BaseHTTPRequestHandler):
    """Base handler: bounded reads, JSON replies, no access log (scrapes every few seconds would flood
    the daemon's log)."""

    server_version = "tunerd"
    timeout = REQUEST_TIMEOUT_S

    def reply(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def reply_json(self, code: int, document: Any) -> None:
        self.reply(code, json.dumps(document, default=str).encode() + b"\n")

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Exporter:
    """Serves `GET /metrics` and `GET /status` from a daemon thread."""

    def __init__(self, host: str, port: int, metrics: Metrics, socket_path: str) -> None:
        self.metrics = metrics
        self.socket_path = socket_path  # named in the answer to a command sent here
        self._snapshot: dict[str, Any] = {}
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="tunerd-http", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serving loop: never call it without one
            self._server.shutdown()
        self._server.server_close()

    def publish(self, snapshot: dict[str, Any]) -> None:
        """Replace the status snapshot (called by the main loop only)."""
        self._snapshot = snapshot

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        exporter = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    self.reply(200, generate_latest(exporter.metrics.registry), CONTENT_TYPE_LATEST)
                elif path == "/status":
                    self.reply(200, json.dumps(exporter._snapshot, default=str).encode())
                else:
                    self.reply(404, b"not found\n", "text/plain")

            def do_POST(self) -> None:
                hint = f"read-only endpoint: commands go over the unix socket {exporter.socket_path}"
                self.reply_json(405, {"error": hint})

            do_PUT = do_DELETE = do_PATCH = do_POST

        return Handler
