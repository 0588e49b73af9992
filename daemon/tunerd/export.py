"""tunerd's own endpoint on 127.0.0.1:9464: Prometheus `/metrics` (tunerd_*), `/status` JSON, commands.

The main loop publishes; HTTP handler threads only read the last published snapshot (an immutable
reference swap) or post a command to the loop's queue. Metric names follow the Prometheus exporter
conventions: `tunerd_` prefix, base units, counters end in `_total`, an `_up` gauge for the scrape.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from tunerd.engine.states import EngineState

COMMANDS = frozenset({"resume", "restart"})
MAX_COMMAND_BODY = 64 * 1024


# Signal units (observe/signals.py) → Prometheus base-unit suffixes (exporter naming conventions).
_UNIT_SUFFIX = {
    "ratio 0..1": "ratio",
    "1/0": "",
    "1/s": "per_second",
    "s": "seconds",
    "bytes": "bytes",
    "bytes/s": "bytes_per_second",
    "tokens": "tokens",
    "tokens/s": "tokens_per_second",
    "pages/s": "pages_per_second",
    "percent": "percent",
    "requests": "",
}


def signal_metric_name(signal_name: str, unit: str) -> str:
    """`kv_cache.usage` in `ratio 0..1` → `tunerd_signal_kv_cache_usage_ratio`.

    The unit's suffix is left out when the name already says it (`host.mem_available_bytes_min`).
    """
    words = signal_name.replace(".", "_").replace("-", "_")
    suffix = _UNIT_SUFFIX.get(unit, "")
    if suffix and suffix.split("_")[0] in words.split("_"):
        suffix = ""
    return f"tunerd_signal_{words}" + (f"_{suffix}" if suffix else "")


class Metrics:
    """The tunerd_* families in one registry (a fresh one per daemon; tests pass their own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.engine_up = Gauge(
            "tunerd_engine_up", "1 when vLLM is RUNNING (its /health answered 200)", registry=r
        )
        self.engine_state = Gauge(
            "tunerd_engine_state",
            "Engine state: " + ", ".join(f"{s.value}={s.name}" for s in EngineState),
            registry=r,
        )
        self.restarts = Counter(
            "tunerd_engine_restarts",
            "Engine failures that led to a restart, by classified reason",
            ["reason"],
            registry=r,
        )
        self.scrape_up = Gauge(
            "tunerd_engine_scrape_up", "1 when the last scrape of vLLM's /metrics worked", registry=r
        )
        self.param = Gauge(
            "tunerd_param", "Engine parameters in force (booleans as 0/1)", ["name"], registry=r
        )
        self.kv_cache_tokens = Gauge(
            "tunerd_engine_kv_cache_tokens", "KV-cache capacity vLLM reported at its last start", registry=r
        )
        self.reload_ok = Gauge(
            "tunerd_config_last_reload_successful", "1 when the last config (re)load succeeded", registry=r
        )
        self.reload_time = Gauge(
            "tunerd_config_last_reload_success_timestamp_seconds", "When the config last loaded", registry=r
        )
        self.journal_errors = Counter(
            "tunerd_journal_write_errors", "Journal records that could not be made durable", registry=r
        )
        self.reload_ok.set(1)
        self._signal_gauges: dict[str, Gauge] = {}
        self._params_seen: set[str] = set()

    def set_engine(self, state: EngineState) -> None:
        self.engine_state.set(state.value)
        self.engine_up.set(1 if state is EngineState.RUNNING else 0)

    def set_params(self, params: Mapping[str, Any]) -> None:
        for name in self._params_seen - set(params):
            self.param.remove(name)
        for name, value in params.items():
            if isinstance(value, (int, float)):
                self.param.labels(name=name).set(float(value))
        self._params_seen = {n for n, v in params.items() if isinstance(v, (int, float))}

    def set_signals(self, values: Mapping[str, float | None], units: Mapping[str, str]) -> None:
        """One gauge per signal; a signal without a value is NaN (unknown), never 0."""
        for name, value in values.items():
            gauge = self._signal_gauges.get(name)
            if gauge is None:
                metric = signal_metric_name(name, units.get(name, ""))
                gauge = Gauge(metric, f"tunerd signal {name} ({units.get(name, '')})", registry=self.registry)
                self._signal_gauges[name] = gauge
            gauge.set(float("nan") if value is None else value)


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
