"""Host memory signals from procfs: capacity, page cache, swap, page faults, PSI, and the engine's share.

On a DGX Spark / GB10 CPU and GPU share one memory, NVML reports no memory figures, and the signals that
exist everywhere are the host's: `/proc/meminfo`, the `/proc/vmstat` fault and swap counters,
`/proc/pressure/memory`, and per-process minflt/majflt/VmRSS (shared/docs/vllm-facts.md, "Unified
memory"). The same readers serve discrete-GPU hosts, where they show host RAM pressure from the API
server, tokenizers and CPU offload.

Cost matters: the sampler runs every second. A sample reads `meminfo`, `vmstat` and `pressure/memory`
once each, plus `stat` (faults) and `statm` (RSS) of each engine pid, through descriptors kept open
(`procfs.ProcFiles`), as bytes, and picks out only the figures it uses with one C-level search per file
(bench/poll_cost.py's "host" part, 4 engine pids: 0.39 ms → 0.12 ms of CPU per sample). psutil is not
used: its procfs root is a module global (`psutil.PROCFS_PATH`), not a per-collector parameter, and its
memory call reads more than we need.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tunerd.procfs.processes import (
    PAGE_SIZE,
    ProcFiles,
    parse_stat_faults,
    parse_statm_rss_bytes,
)

__all__ = [
    "EngineUsage",
    "HostCollector",
    "HostSample",
    "MemoryPressure",
    "PsiLine",
    "pci_sysfs_name",
    "read_engine_usage",
    "read_memory_pressure",
    "read_pci_numa_node",
]

# The figures a sample uses, found by one regex search over the file (a "\n" is put in front so that
# the first line is found too): ~4 µs for meminfo where splitting all its ~55 lines costs ~25 µs.
_MEMINFO_RE = re.compile(
    rb"\n(MemTotal|MemFree|MemAvailable|Buffers|Cached|Shmem|SwapTotal|SwapFree):[ \t]*([0-9]+)([ \t]+kB)?"
)
_VMSTAT_RE = re.compile(rb"\n(pgfault|pgmajfault|pswpin|pswpout) ([0-9]+)[ \t]*(?=\n|$)")
# The kernel's PSI line, whole (psi_show: "some avg10=%lu.%02lu avg60=… avg300=… total=%llu").
_PSI_RE = re.compile(
    rb"^(some|full) avg10=([0-9]+(?:\.[0-9]+)?) avg60=([0-9]+(?:\.[0-9]+)?) avg300=([0-9]+(?:\.[0-9]+)?)"
    rb" total=([0-9]+)[ \t]*$",
    re.MULTILINE,
)


def _read_bytes(path: str) -> bytes:
    # os.open/os.read: half the CPU of open().read() for a small procfs file (meminfo: ~10 µs vs ~20
    # µs). Read to EOF: a multi-record seq_file (vmstat) comes a page at a time.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 65536)
        if data:
            while more := os.read(fd, 65536):
                data += more
        return data
    finally:
        os.close(fd)


def _read_text(path: str) -> str:
    return _read_bytes(path).decode("ascii", "replace")


def pci_sysfs_name(bus_id: str) -> str | None:
    """NVML's PCI bus id ("00000000:00:06.0", GB10's "0000000F:01:00.0") → the sysfs device name
    ("0000:00:06.0", "000f:01:00.0"); None if it isn't one."""
    domain, sep, rest = bus_id.strip().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest.lower()}" if sep and rest else None
    except ValueError:
        return None


def read_pci_numa_node(bus_id: str, sys: str = "/sys") -> int | None:
    """The NUMA node of a PCI device, from `<sys>/bus/pci/devices/<id>/numa_node`; None if the file is
    absent or unreadable, or says -1 (no NUMA affinity)."""
    name = pci_sysfs_name(bus_id)
    if name is None:
        return None
    try:
        node = int(_read_text(f"{sys}/bus/pci/devices/{name}/numa_node").strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


@dataclass(frozen=True)
class PsiLine:
    """One line of a PSI file: share of wall time stalled (percent) over 10/60/300 s, and the
    cumulative stall time in microseconds."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


@dataclass(frozen=True)
class MemoryPressure:
    """`<proc>/pressure/memory`: `some` = at least one task stalled on memory, `full` = all non-idle
    tasks stalled at once. `full` is None only if the kernel printed no such line."""

    some: PsiLine
    full: PsiLine | None


def _parse_psi_line(words: list[str]) -> PsiLine:
    fields = dict(w.split("=", 1) for w in words if "=" in w)
    return PsiLine(
        avg10=float(fields["avg10"]),
        avg60=float(fields["avg60"]),
        avg300=float(fields["avg300"]),
        total_us=int(fields["total"]),
    )


def read_memory_pressure(proc: str = "/proc") -> MemoryPressure | None:
    """Return memory PSI, or None where the kernel has none: the file is absent (kernel without
    CONFIG_PSI, some containers), reading fails with EOPNOTSUPP (booted with psi=0) or any other OSError,
    or the content can't be parsed. None means "not known", never "no pressure"."""
    try:
        text = _read_text(f"{proc}/pressure/memory")
    except OSError:
        return None
    return _parse_pressure(text.encode("ascii", "replace"))


def _parse_pressure(raw: bytes) -> MemoryPressure | None:
    found = _PSI_RE.findall(raw)
    if found and len(found) == len(raw.splitlines()):
        # Every line in the kernel's own layout: read it without splitting words (same values).
        psi = {
            kind: PsiLine(float(a10), float(a60), float(a300), int(total))
            for kind, a10, a60, a300, total in found
        }
        if b"some" in psi:
            return MemoryPressure(some=psi[b"some"], full=psi.get(b"full"))
    return _parse_pressure_words(raw.decode("ascii", "replace"))


def _parse_pressure_words(text: str) -> MemoryPressure | None:
    lines: dict[str, list[str]] = {}
    for line in text.splitlines():
        words = line.split()
        if words:
            lines[words[0]] = words[1:]
    try:
        some = _parse_psi_line(lines["some"])
        full = _parse_psi_line(lines["full"]) if "full" in lines else None
    except (KeyError, ValueError):
        return None
    return MemoryPressure(some=some, full=full)


@dataclass(frozen=True)
class EngineUsage:
    """Summed over the engine processes that could be read (`pids`): cumulative minor and major page
    faults and resident memory.

    The sums are over a set that changes when a process exits or starts, so a rate computed from two
    samples is only valid when `pids` are equal in both. RSS counts pages shared between the processes
    (shared memory, shared libraries) once per process, so it is an upper bound of their footprint.
    """

    pids: tuple[int, ...]
    minflt_total: int
    majflt_total: int
    rss_bytes: int
    faults_by_pid: tuple[tuple[int, int, int], ...] = ()  # (pid, minflt, majflt) for each pid read


def read_engine_usage(pids: Iterable[int], proc: str = "/proc") -> EngineUsage | None:
    """Read `stat` and `statm` of each pid and sum faults and RSS; skip pids that vanished.

    Returns None if no pid was given or none could be read (the engine is not running). A zombie counts
    its faults and zero RSS. The same figures `HostCollector.sample` gets through kept-open files; this
    one opens files by path, for occasional callers such as the GPU sampler on unified memory.
    """
    return _engine_usage(pids, lambda name: _read_bytes(f"{proc}/{name}"), PAGE_SIZE)


def _engine_usage(pids: Iterable[int], read: Callable[[str], bytes], page_size: int) -> EngineUsage | None:
    faults: list[tuple[int, int, int]] = []
    rss = 0
    for pid in dict.fromkeys(pids):  # keeps order, drops duplicates
        try:
            pair = parse_stat_faults(read(f"{pid}/stat"))
        except OSError:  # vanished (ENOENT, ESRCH) or not ours to read (EACCES): skip it
            continue
        if pair is None:
            continue
        faults.append((pid, *pair))
        try:  # noqa: SIM105 (contextlib.suppress builds an object per pid and per second)
            rss += parse_statm_rss_bytes(read(f"{pid}/statm"), page_size) or 0
        except OSError:
            pass
    if not faults:
        return None
    return EngineUsage(
        pids=tuple(pid for pid, _, _ in faults),
        minflt_total=sum(minor for _, minor, _ in faults),
        majflt_total=sum(major for _, _, major in faults),
        rss_bytes=rss,
        faults_by_pid=tuple(faults),
    )


@dataclass(frozen=True)
class HostSample:
    """One host sample. Sizes in bytes; `*_total` are cumulative kernel counters since boot (the
    caller turns two samples into rates with `taken_at`, a monotonic time in seconds). A field is None
    when the kernel does not provide it; None never means 0.

    `page_cache_bytes` is `Buffers + Cached − Shmem`: the file-backed page cache that dropping caches
    could release. Shmem (tmpfs, /dev/shm, which vLLM uses for IPC) sits inside `Cached` but can't be
    dropped, so it is taken out and kept apart in `shmem_bytes`. SReclaimable slab is not included.
    """

    taken_at: float
    mem_total_bytes: int | None
    mem_available_bytes: int | None
    mem_free_bytes: int | None
    page_cache_bytes: int | None
    shmem_bytes: int | None
    swap_total_bytes: int | None
    swap_used_bytes: int | None
    swap_in_pages_total: int | None
    swap_out_pages_total: int | None
    pgfault_total: int | None
    pgmajfault_total: int | None
    pressure: MemoryPressure | None
    engine: EngineUsage | None

    def as_readings(self) -> dict[str, float | None]:
        """Flat view for metrics and rules: exactly the keys below, None where unknown."""
        psi, eng = self.pressure, self.engine
        full = psi.full if psi is not None else None
        return {
            "host.mem_total_bytes": _f(self.mem_total_bytes),
            "host.mem_available_bytes": _f(self.mem_available_bytes),
            "host.mem_free_bytes": _f(self.mem_free_bytes),
            "host.swap_total_bytes": _f(self.swap_total_bytes),
            "host.swap_used_bytes": _f(self.swap_used_bytes),
            "host.swap_in_pages_total": _f(self.swap_in_pages_total),
            "host.swap_out_pages_total": _f(self.swap_out_pages_total),
            "host.pgfault_total": _f(self.pgfault_total),
            "host.pgmajfault_total": _f(self.pgmajfault_total),
            "host.psi_some_avg10": psi.some.avg10 if psi is not None else None,
            "host.psi_full_avg10": full.avg10 if full is not None else None,
            "host.psi_some_total_us": float(psi.some.total_us) if psi is not None else None,
            "host.psi_full_total_us": float(full.total_us) if full is not None else None,
            "host.page_cache_bytes": _f(self.page_cache_bytes),
            "engine.minflt_total": float(eng.minflt_total) if eng is not None else None,
            "engine.majflt_total": float(eng.majflt_total) if eng is not None else None,
            "engine.rss_bytes": float(eng.rss_bytes) if eng is not None else None,
        }


def _f(value: int | None) -> float | None:
    return None if value is None else float(value)


def _diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


class HostCollector:
    """Takes `HostSample`s from a procfs tree (`proc`, default "/proc"). `clock` stamps `taken_at`
    (monotonic seconds; tests pass a fake); `page_size` converts `statm` pages to bytes.

    Keeps the files it samples open between samples (`procfs.ProcFiles`): those of pids no longer
    asked for are closed at the next sample, all of them by `close()` or when the collector is
    garbage-collected. Not thread-safe: one sampling thread.
    """

    def __init__(
        self,
        proc: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
        page_size: int = PAGE_SIZE,
    ) -> None:
        self.proc = proc
        self.page_size = page_size
        self._clock = clock
        self._files = ProcFiles(proc)
        self._pids: tuple[int, ...] = ()

    def sample(self, engine_pids: Iterable[int] = ()) -> HostSample:
        """Read one sample; `engine_pids` are the engine's processes (see procfs.pids_in_group).

        Raises OSError only if `<proc>/meminfo` can't be read (procfs not mounted). A missing or
        unreadable vmstat or PSI file gives None fields; vanished engine pids are skipped.
        """
        taken_at = self._clock()
        files = self._files
        mem = {
            key: int(value) * 1024 if kb else int(value)
            for key, value, kb in _MEMINFO_RE.findall(b"\n" + files.read("meminfo"))
        }
        try:
            vm = dict(_VMSTAT_RE.findall(b"\n" + files.read("vmstat", to_eof=True)))
        except OSError:
            vm = {}
        try:
            pressure = _parse_pressure(files.read("pressure/memory"))
        except OSError:
            pressure = None
        pids = tuple(engine_pids)
        if pids != self._pids:  # close what belonged to processes no longer sampled
            self._pids = pids
            per_pid = [f"{pid}/{name}" for pid in pids for name in ("stat", "statm")]
            files.keep_only(["meminfo", "vmstat", "pressure/memory", *per_pid])
        cached, buffers, shmem = mem.get(b"Cached"), mem.get(b"Buffers"), mem.get(b"Shmem")
        page_cache = None
        if cached is not None and buffers is not None:
            page_cache = cached + buffers - (shmem or 0)
        return HostSample(
            taken_at=taken_at,
            mem_total_bytes=mem.get(b"MemTotal"),
            mem_available_bytes=mem.get(b"MemAvailable"),
            mem_free_bytes=mem.get(b"MemFree"),
            page_cache_bytes=page_cache,
            shmem_bytes=shmem,
            swap_total_bytes=mem.get(b"SwapTotal"),
            swap_used_bytes=_diff(mem.get(b"SwapTotal"), mem.get(b"SwapFree")),
            swap_in_pages_total=_int(vm.get(b"pswpin")),
            swap_out_pages_total=_int(vm.get(b"pswpout")),
            pgfault_total=_int(vm.get(b"pgfault")),
            pgmajfault_total=_int(vm.get(b"pgmajfault")),
            pressure=pressure,
            engine=_engine_usage(pids, files.read, self.page_size),
        )

    def close(self) -> None:
        """Close the files kept open; a later `sample()` opens them again."""
        self._files.close()


def _int(value: bytes | None) -> int | None:
    return None if value is None else int(value)
