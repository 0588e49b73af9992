"""The preflight every start passes — first start, crash restart, rollback, tuning trial alike.

In order, each may hold the start back (non-blocking: `step(now)` is called every loop tick):
1. leftovers: processes an earlier vLLM of this tunerd left (found by the marker) are stopped and
   reaped (engine/leftovers.py); a vLLM this tunerd did not start is only reported;
2. the port is free (a holder is named);
3. the memory-return gate: free memory back within tolerance of the baseline taken before the
   first start (MemAvailable, and the GPU's free memory where NVML reports it: so the gate waits for
   the first poll);
4. page cache: on unified memory, a large one is dropped when the config allows, else advised;
5. the capacity planner's verdict on the parameters (a refusal is final for these parameters); a
   change's owner that asked the planner already (tune/experiment.py) hands its plan in: asked once.
A start held back longer than `max_wait_s` fails with the last reason, so the crash-loop breaker
(backoff, rollback, FATAL) applies instead of an endless wait.
Over 400 lines: the five checks are one ordered gate with one wait/report discipline; the scans they
run as jobs (foreign engines, page cache) sit beside them because nothing else uses them.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil

from tunerd.config import Config
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.machine import GpuFacts
from tunerd.core.params import EngineParams
from tunerd.core.units import GiB
from tunerd.engine.leftovers import LeftoverReaper
from tunerd.engine.oscalls import OsCalls
from tunerd.engine.process import MARKER_ENV
from tunerd.observe.memory import read_memory
from tunerd.policy.guards import MemoryGate, memory_returned
from tunerd.procfs.memory import page_cache_bytes, read_meminfo
from tunerd.procfs.processes import list_pids, read_comm, read_stat
from tunerd.supervise.capacity import PlanOutcome


@dataclass
class PreflightStep:
    clear: bool
    reason: str | None = None  # why the start waits (clear False, failure None)
    failure: EngineFailure | None = None  # the start fails: no launch
    records: list[dict[str, Any]] = field(default_factory=list)  # journal records to write


PlanCheck = Callable[[EngineParams], PlanOutcome]

T = TypeVar("T")
Submit = Callable[[Callable[[], T]], "Future[T]"]


def run_here(job: Callable[[], T]) -> Future[T]:
    """A `Submit` that runs the job at once, in the caller's thread (tests, the command line)."""
    future: Future[T] = Future()
    try:
        future.set_result(job())
    except Exception as exc:
        future.set_exception(exc)
    return future


def _result(future: Future[T], default: T) -> T:
    """A finished job's result, or `default` when it raised (a scan that failed reports nothing)."""
    try:
        return future.result()
    except Exception:
        return default


def port_is_free(host: str, port: int) -> bool:
    """Whether `host:port` can be bound, as uvicorn will bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host or "0.0.0.0", port))
            return True
        except OSError:
            return False


def port_holder(port: int) -> str:
    """Who listens on TCP `port`, as far as we can see (psutil walks every process' sockets: slow)."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                if conn.pid == os.getpid():  # export.port = 0 lets the kernel pick any free port
                    return f"this tunerd (pid {conn.pid}: one of its own listeners; give vLLM another port)"
                return f"pid {conn.pid} ({read_comm(conn.pid)})"
    return "another process"


def foreign_engines(marker: str, proc: str = "/proc", own_pid: int | None = None) -> list[dict[str, Any]]:
    """vLLM-looking processes that do not carry our marker: another tunerd's or a person's vLLM.

    The daemon's own descendants are never foreign: its `vllm … --help` capability probe looks like a
    vLLM server by its command line (it was journaled as a foreign engine on the very first start).
    Reads every process' stat (and, for candidates, cmdline and environ): run it off the loop thread.
    """
    own = os.getpid() if own_pid is None else own_pid
    stats = [s for s in (read_stat(pid, proc) for pid in list_pids(proc)) if s is not None]
    parent = {s.pid: s.ppid for s in stats}
    found = []
    wanted = f"{MARKER_ENV}={marker}".encode()
    for stat in stats:
        if stat.state == "Z" or _descends_from(stat.pid, own, parent):
            continue
        if not (stat.comm.startswith("VLLM::") or _looks_like_vllm_server(stat.pid, proc)):
            continue
        try:
            with open(f"{proc}/{stat.pid}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    continue
        except OSError:
            pass  # not ours to read: certainly not ours
        found.append({"pid": stat.pid, "comm": stat.comm})
    return found


def _descends_from(pid: int, ancestor: int, parent: dict[int, int]) -> bool:
    seen = set()
    while pid in parent and pid not in seen:
        if pid == ancestor:
            return True
        seen.add(pid)
        pid = parent[pid]
    return pid == ancestor


def _looks_like_vllm_server(pid: int, proc: str) -> bool:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    text = b" ".join(argv)
    return b"vllm" in text and (b"serve" in argv or b"vllm.entrypoints.openai.api_server" in text)


FULL_DROP_NEEDS = (
    "the kernel lets only uid 0 write /proc/sys/vm/drop_caches (no capability is enough) and the unit "
    "runs as user tunerd: run the service as root (a drop-in, see README 'Install as a service') or use "
    'drop_page_cache = "fadvise", which drops the model\'s own cache without privilege'
)


def drop_page_cache() -> str | None:
    """sync + drop the clean page cache of the whole host (`echo 1 > /proc/sys/vm/drop_caches`).

    None on success, else why not. /proc/sys checks the writer's uid against the file's mode (0200,
    root), not capabilities: as the unit's user (or in a container, where /proc/sys is read-only) it is
    refused.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def fadvise_model_files(model: str, max_errors: int = 5) -> dict[str, Any]:
    """posix_fadvise(POSIX_FADV_DONTNEED) on every regular file under the model directory: the kernel
    drops their clean cached pages. Needs no privilege, only read access to the files (symlinks, as in a
    Hugging Face snapshot, are followed to their blobs). Dirty pages stay (the kernel writes them first).

    Returns {"files", "file_bytes", "errors"}; "errors" names what could not be advised.
    """
    from stat import S_ISREG

    files = file_bytes = 0
    errors: list[str] = []
    if not os.path.isdir(model):
        return {"files": 0, "file_bytes": 0, "errors": [f"{model}: not a local directory"]}
    for top, _dirs, names in os.walk(model):
        for name in names:
            path = os.path.join(top, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                if len(errors) < max_errors:
                    errors.append(f"{path}: {exc.strerror or exc}")
                continue
            try:
                st = os.fstat(fd)
                if S_ISREG(st.st_mode):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    files += 1
                    file_bytes += st.st_size
            except OSError as exc:
                if len(errors) < max_errors:
                    errors.append(f"{path}: {exc.strerror or exc}")
            finally:
                os.close(fd)
    return {"files": files, "file_bytes": file_bytes, "errors": errors}


class Preflight:
    """The checks for one pending start. A new instance per start."""

    def __init__(
        self,
        config: Config,
        params: EngineParams,
        *,
        oscalls: OsCalls,
        marker: str,
        reaper: LeftoverReaper,
        gate: MemoryGate | None,
        gpu: Callable[[], GpuFacts | None],
        plan_check: PlanCheck | None,
        started: float,
        submit: Submit = run_here,
        plan: PlanOutcome | None = None,
    ) -> None:
        """`plan`: the planner's outcome for `params`, already asked by the change's owner: used (and
        journaled) as the planner's verdict, the planner is not asked twice for the same parameters."""
        self.config = config
        self.params = params
        self.os = oscalls
        self.marker = marker
        self.reaper = reaper
        self.gate = gate
        self.gpu = gpu
        self.plan_check = plan_check
        self.started = started
        self.submit = submit
        self.timings: dict[str, float] = {}
        self._phase_started = started
        self._reported: set[str] = set()
        self._foreign: Future[list[dict[str, Any]]] | None = None
        self._port_holder: Future[str] | None = None
        self._plan_job: Future[PlanOutcome] | None = None
        self.baseline: MemoryGate | None = None  # set when this preflight took the first baseline
        self.plan: PlanOutcome | None = None  # the planner's verdict, once asked
        self._known_plan = plan

    def step(self, now: float) -> PreflightStep:
        """One look at the checks (every loop tick while the start is pending); never blocks: scans
        of every process, the port's holder and the planner (NVML, model headers) run as jobs."""
        records: list[dict[str, Any]] = []
        for name, check in (
            ("foreign", self._foreign_engines),
            ("leftovers", self._leftovers),
            ("port", self._port),
            ("memory", self._memory),
            ("page_cache", self._page_cache),
            ("plan", self._plan),
        ):
            if name in self.timings:
                continue
            result = check(now, records)
            if result is not None:
                result.records[:0] = records
                if result.failure is None and now - self.started > self.config.preflight.max_wait_s:
                    waited = f"waited {now - self.started:.0f} s: {result.reason}"
                    result = PreflightStep(
                        False, None, EngineFailure(FailureKind.PREFLIGHT, waited), result.records
                    )
                return result
            self.timings[name] = round(now - self._phase_started, 3)
            self._phase_started = now
        records.append(
            {"event": "preflight.passed", "seconds": round(now - self.started, 3), "timings": self.timings}
        )
        return PreflightStep(True, records=records)

    def _wait(self, key: str, reason: str, records: list[dict[str, Any]], **fields: Any) -> PreflightStep:
        if key not in self._reported:  # journal each kind of wait once, not every tick
            self._reported.add(key)
            records.append({"event": "preflight.waiting", "check": key, "reason": reason, **fields})
        return PreflightStep(False, reason, records=[])

    def _foreign_engines(self, now: float, records: list[dict[str, Any]]) -> PreflightStep | None:
        """Report (never touch) a vLLM this tunerd did not start, once per start. The scan runs as a
        job; the start waits for it (tens of milliseconds), so that no start goes without its report."""
        if self._foreign is None:
            marker, proc = self.marker, self.os.proc
            self._foreign = self.submit(lambda: foreign_engines(marker, proc))
        if not self._foreign.done():
            return PreflightStep(False, "looking for vLLM processes this tunerd did not start")
        if others := _result(self._foreign, []):
            records.append(
                {
                    "event": "preflight.foreign_engine",
                    "processes": others,
                    "note": "not started by this tunerd: left alone",
                }
            )
        return None

    def _leftovers(self, now: float, records: list[dict[str, Any]]) -> PreflightStep | None:
        result = self.reaper.step(now, self.config.timeouts.graceful_stop_s)
        records.extend(result.journal)
        return None if result.clear else self._wait("leftovers", result.reason or "leftovers", records)

    def _port(self, now: float, records: list[dict[str, Any]]) -> PreflightStep | None:
        engine = self.config.engine
        if port_is_free(engine.host, engine.port):
            return None
        if self._port_holder is None:  # named once per start, not at every tick of the wait
            port = engine.port
            self._port_holder = self.submit(lambda: port_holder(port))
        if not self._port_holder.done():
            return PreflightStep(False, f"port {engine.port} is held (finding out by whom)")
        holder = _result(self._port_holder, "another process")
        return self._wait("port", f"port {engine.port} is held by {holder}", records)

    def _memory(self, now: float, records: list[dict[str, Any]]) -> PreflightStep | None:
        gpu = self.gpu()
        if gpu is None:
            # The baseline and the gate need the GPU's free memory too, which only a poll knows.
            return self._wait("memory", "waiting for the first reading of GPU memory", records)
        reading = read_memory(self.config.observe.memory_proc)
        if self.gate is None:
            if reading.mem_available_bytes is None:
                return None
            pre = self.config.preflight
            tolerance = max(
                pre.memory_tolerance_bytes, int(reading.mem_available_bytes * pre.memory_tolerance_ratio)
            )
            self.gate = self.baseline = MemoryGate(reading.mem_available_bytes, tolerance, gpu.free_bytes)
            records.append(
                {
                    "event": "preflight.baseline",
                    "mem_available_bytes": reading.mem_available_bytes,
                    "gpu_free_bytes": gpu.free_bytes,
                    "tolerance_bytes": tolerance,
                }
            )
            return None
        back, why = memory_returned(self.gate, reading.mem_available_bytes, gpu.free_bytes)
        return None if back else self._wait("memory", f"memory not returned yet: {why}", records)

    def _page_cache(self, now: float, records: list[dict[str, Any]]) -> PreflightStep | None:
        """On unified memory a large page cache counts as used: `preflight.drop_page_cache` says what to
        do. advise: a journal line; fadvise: drop the model files' own cache (no privilege); drop: sync
        and drop the whole cache (uid 0 only), else say why not and drop the model's own."""
        gpu = self.gpu()
        mode = self.config.preflight.drop_page_cache
        if gpu is None or not gpu.unified_memory or mode == "off":
            return None
        proc = self.config.observe.memory_proc
        try:
            info = read_meminfo(proc)
        except OSError:
            return None
        cache = page_cache_bytes(info)
        total = info.get("MemTotal") or 0
        if not total or cache is None or cache < total * self.config.preflight.page_cache_advice_ratio:
            return None
        if mode == "advise":
            records.append(
                {
                    "event": "preflight.page_cache_advice",
                    "page_cache_bytes": cache,
                    "advice": f"{cache / GiB:.1f} GiB of page cache counts as used on unified memory: "
                    'set preflight.drop_page_cache = "fadvise" (the model\'s own cache, no privilege) or '
                    '"drop" (all of it, uid 0 only), or run: sync; echo 1 > /proc/sys/vm/drop_caches',
                }
            )
            return None
        if mode == "drop":
            failed = drop_page_cache()
            if failed is None:
                records.append(
                    {"event": "preflight.page_cache_dropped", "page_cache_bytes": cache, "error": None}
                )
                return None
            import structlog

            reason = f"full drop refused ({failed}): {FULL_DROP_NEEDS}"
            records.append(
                {
                    "event": "preflight.page_cache_kept",
                    "page_cache_bytes": cache,
                    "error": failed,
                    "uid": os.geteuid(),
                    "reason": reason,
                }
            )
            structlog.get_logger("tunerd").warning("preflight.page_cache_kept", error=failed, reason=reason)
        model = self.config.engine.model
        advised = fadvise_model_files(model)
        try:
            after = page_cache_bytes(read_meminfo(proc))
        except OSError:
            after = None
        records.append(
            {
                "event": "preflight.page_cache_fadvised",
                "model": model,
                "page_cache_bytes": cache,
                "page_cache_after_bytes": after,
                **advised,
            }
        )
        return None

    def _plan(self, now: float, records: list[dict[str, Any]]) -> PreflightStep | None:
        if self.plan_check is None:
            return None
        if self._plan_job is None and self._known_plan is not None:
            known = self._known_plan  # asked by the change's owner for these very parameters
            self._plan_job = run_here(lambda: known)
        if self._plan_job is None:
            check, params = self.plan_check, self.params
            self._plan_job = self.submit(lambda: check(params))
        if not self._plan_job.done():
            return PreflightStep(False, "asking the capacity planner")
        try:
            self.plan = self._plan_job.result()
        except Exception as exc:  # a planner bug must not stop the start: the planner is advice
            self.plan = PlanOutcome(None, {"planner": f"no plan: {type(exc).__name__}: {exc}"})
        if self.plan.refusal is None:
            records.append({"event": "preflight.plan", "params": self.params, **self.plan.figures})
            return None
        records.append(
            {
                "event": "preflight.refused",
                "params": self.params,
                "reason": self.plan.refusal,
                **self.plan.figures,
            }
        )
        # With vLLM's estimate of what fits, the refusal says what to start instead (policy/corrections).
        failure = EngineFailure(
            FailureKind.PLAN_REFUSED, self.plan.refusal, self.plan.estimated_max_model_len
        )
        return PreflightStep(False, None, failure, records=[])
