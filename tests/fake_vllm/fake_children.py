"""The engine-core, worker and grandchild processes of the fake vLLM (see fake_vllm.py).

ok_start.json: the API server's child ``VLLM::EngineCore`` (comm ``VLLM::EngineCor``) starts the
``VLLM::Worker`` grandchild; both stay in the API server's process group and print their own lines of
ok_start.log. They leave when their parent is gone, as real vLLM's do.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from fake_vllm import (
    POLL_S,
    FixtureLog,
    Knobs,
    Marks,
    Renderer,
    Terminated,
    emit,
    kv_plan,
    on_sigterm,
    parse_args,
    role_of,
    semantic_subs,
    startup_clock,
    sub,
)

HERE = Path(__file__).resolve().parent
TITLES = {"engine": "VLLM::EngineCore", "worker": "VLLM::Worker", "grandchild": "fake_vllm-grandchild"}


def _is_engine_line(line: str) -> bool:
    return role_of(line) == "EngineCore"


def _is_worker_line(line: str) -> bool:
    return role_of(line) == "Worker"


def _alive(pid: int) -> bool:
    """True while pid runs; a zombie counts as gone (sigterm_shutdown.json counts zombies as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _set_comm(title: str) -> None:
    """prctl(PR_SET_NAME); the kernel keeps 15 bytes, so comm reads VLLM::EngineCor, as for real vLLM."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(15, title.encode(), 0, 0, 0)


def spawn(role: str, cfg: dict[str, Any], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start a child titled like the real one. Python reads its script from stdin, so /proc/PID/cmdline is
    exactly the title (ok_start.json: cmdline "VLLM::EngineCore"). It inherits the environment, stdout,
    stderr and process group."""
    cfg = {**cfg, "role": role}
    code = f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport fake_children\n"
    code += f"fake_children.child_main({json.dumps(cfg)!r})\n"
    proc = subprocess.Popen(
        [TITLES[role]], executable=cfg["python"], stdin=subprocess.PIPE, pass_fds=pass_fds
    )
    assert proc.stdin is not None
    proc.stdin.write(code.encode())
    proc.stdin.close()
    return proc


def _report(fd: int, message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, message.encode() + b"\n")


def child_main(cfg_json: str) -> None:
    """Entry point of the engine core, worker and grandchild processes (see spawn)."""
    cfg = json.loads(cfg_json)
    _set_comm(TITLES[cfg["role"]])
    sys.stdout.reconfigure(encoding="utf-8", errors="replace")  # type: ignore[union-attr]
    if cfg["role"] == "grandchild":
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            time.sleep(3600)
    ns, knobs = parse_args(cfg["argv"]), Knobs.from_env()
    (EngineCore if cfg["role"] == "engine" else Worker)(cfg, ns, knobs).run()


class Child:
    """What the engine core and the worker share: config, their part of ok_start.log, parent watching."""

    def __init__(self, cfg: dict[str, Any], ns: argparse.Namespace, knobs: Knobs) -> None:
        self.cfg, self.ns, self.knobs = cfg, ns, knobs
        self.started = time.monotonic()
        self.log = FixtureLog("ok_start.log")
        self.marks = Marks.of(self.log)
        self.clock = startup_clock(self.log, self.marks, cfg["t0"], knobs.startup_s)
        self.pids = {"APIServer": cfg["api_pid"]}
        self.drain = ns.shutdown_timeout > 0

    def renderer(self) -> Renderer:
        kv = kv_plan(self.ns, self.knobs.bytes_per_token)
        mode = (
            [sub(r"mode=abort timeout=0s", f"mode=drain timeout={self.ns.shutdown_timeout}s")]
            if self.drain
            else []
        )
        return Renderer(self.log, self.ns, self.pids, semantic_subs(self.ns, kv, self.started) + mode)

    def emit(self, a: int, b: int) -> None:
        if not self.cfg["quiet"]:
            emit(self.log, self.renderer(), a, b, self.clock)

    def linger_and_exit(self, default: float) -> NoReturn:
        time.sleep(default if self.knobs.linger_s is None else self.knobs.linger_s)
        os._exit(0)


class EngineCore(Child):
    """VLLM::EngineCore: prints its lines, starts the worker (and the grandchild), reports "W <pid>" and
    "R" (ready) on its status pipe to the API server, whose EOF tells the API server that it died."""

    worker: subprocess.Popen[bytes]

    def run(self) -> NoReturn:
        hold = bytearray(self.knobs.hold_mb << 20)
        hold[::4096] = b"\x01" * len(range(0, len(hold), 4096))  # touch every page so it is resident
        self.pids["EngineCore"] = os.getpid()
        handler = signal.SIG_IGN if self.knobs.ignore_sigterm else on_sigterm
        signal.signal(signal.SIGTERM, handler)
        try:
            self._start()
            while True:
                time.sleep(POLL_S)
                if os.getppid() != self.cfg["api_pid"]:
                    self.linger_and_exit(0.0)
                if self.worker.poll() is not None:
                    self._worker_died(self.worker.returncode)
        except Terminated:
            self._shutdown()

    def _start(self) -> None:
        m, status = self.marks, self.cfg["status_fd"]
        self.emit(m.engine, m.worker)
        r, w = os.pipe()
        self.worker = spawn("worker", {**self.cfg, "status_fd": w, "engine_pid": os.getpid()}, (w,))
        os.close(w)
        self.pids["Worker"] = self.worker.pid
        _report(status, f"W {self.worker.pid}")
        if self.knobs.grandchild:
            sock = self.cfg.get("sock_fd")
            extra = spawn("grandchild", self.cfg, (sock,) if sock is not None else ())
            _report(status, f"G {extra.pid}")
        if self.cfg.get("sock_fd") is not None:
            os.close(self.cfg["sock_fd"])
        with os.fdopen(r, "rb") as from_worker:
            from_worker.readline()  # "R" once the worker has loaded the model (EOF if it died)
        self.emit(m.kv, m.api_ready)
        _report(status, "R")

    def _worker_died(self, code: int) -> NoReturn:
        """crash_worker_sigill_eager.log: the engine core reports the dead worker and its fatal error, then
        exits; the API server takes that as the engine core's death."""
        log = FixtureLog("crash_worker_sigill_eager.log")
        subs = [sub(r"\(exit code: -?\d+\)", f"(exit code: {code})")]
        r = Renderer(log, self.ns, {"EngineCore": os.getpid(), "APIServer": self.cfg["api_pid"]}, subs)
        a = log.find("died unexpectedly")
        b = next(i for i in range(a, len(log.lines)) if not _is_engine_line(log.lines[i]))
        if not self.cfg["quiet"]:
            emit(log, r, a, b)
        os._exit(1)

    def _shutdown(self) -> NoReturn:
        """ok_start.log: the engine core's four [shutdown] lines; in drain mode it then waits for the API
        server (which drains the requests) up to --shutdown-timeout."""
        if not self.cfg["quiet"]:
            emit(self.log, self.renderer(), self.marks.shutdown, len(self.log.lines), keep=_is_engine_line)
        deadline = time.monotonic() + (self.ns.shutdown_timeout if self.drain else 0)
        while time.monotonic() < deadline and _alive(self.cfg["api_pid"]):
            time.sleep(POLL_S)
        os._exit(0)


class Worker(Child):
    """VLLM::Worker: prints the model-loading lines, then waits for its engine core or API server to go."""

    def run(self) -> NoReturn:
        engine = self.cfg["engine_pid"]
        self.pids.update(EngineCore=engine, Worker=os.getpid())
        if self.knobs.ignore_sigterm or self.drain:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # real: the API server SIGKILLs the worker
        self.emit(self.marks.worker, self.marks.kv)
        _report(self.cfg["status_fd"], "R")
        api = self.cfg["api_pid"]
        while os.getppid() == engine and _alive(api):
            time.sleep(POLL_S)
        api_alive = _alive(api)
        if api_alive and not self.cfg["quiet"]:  # "Parent process exited, terminating worker queues"
            emit(self.log, self.renderer(), self.marks.shutdown, len(self.log.lines), keep=_is_worker_line)
        while _alive(api):
            time.sleep(POLL_S)
        # engine_killed_run2.json: the worker outlived the API server by ~2 s after its engine core died.
        self.linger_and_exit(2.0 if api_alive else 0.0)
