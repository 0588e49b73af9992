"""The host's memory files in procfs, one reader each: /proc/meminfo (and the page-cache figure),
/proc/vmstat and /proc/pressure/memory (PSI)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo or a node's meminfo ("Node 0 MemTotal: N kB") → {key: bytes}."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "Node" and len(parts) >= 4:
            key, number, unit = parts[2].rstrip(":"), parts[3], parts[4] if len(parts) > 4 else ""
        elif len(parts) >= 2:
            key, number, unit = parts[0].rstrip(":"), parts[1], parts[2] if len(parts) > 2 else ""
        else:
            continue
        with contextlib.suppress(ValueError):
            values[key] = int(number) * (1024 if unit == "kB" else 1)
    return values


def read_meminfo(proc: str = "/proc") -> dict[str, int]:
    """`<proc>/meminfo` as {key: value}: `kB` values in bytes, the others (HugePages_* counts) as they
    are. Raises OSError if the file can't be read."""
    return parse_meminfo(_read(f"{proc}/meminfo"))


def page_cache_bytes(meminfo: Mapping[str, int]) -> int | None:
    """Buffers + Cached − Shmem: the file-backed page cache that dropping caches could release.

    Shmem (tmpfs, /dev/shm, which vLLM uses for IPC) sits inside `Cached` but cannot be dropped.
    None when the kernel gave no `Cached` line.
    """
    if "Cached" not in meminfo:
        return None
    return max(0, meminfo["Cached"] + meminfo.get("Buffers", 0) - meminfo.get("Shmem", 0))


def parse_vmstat(text: str) -> dict[str, int]:
    """/proc/vmstat ("name value" lines) → {name: value}; lines that are not a name and an integer are
    left out."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            with contextlib.suppress(ValueError):
                values[parts[0]] = int(parts[1])
    return values


def read_vmstat(proc: str = "/proc") -> dict[str, int]:
    """`<proc>/vmstat` as {counter: value} (pgfault, pgmajfault, pswpin, pswpout, …: cumulative since
    boot). Raises OSError if the file can't be read."""
    return parse_vmstat(_read(f"{proc}/vmstat"))


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


def parse_memory_pressure(text: str) -> MemoryPressure | None:
    """A PSI file ("some avg10=… avg60=… avg300=… total=…", then a "full" line) → MemoryPressure, the
    fields read by name in whatever order; None if there is no `some` line or a field is missing or
    not a number."""
    lines: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        words = line.split()
        if words:
            lines[words[0]] = dict(w.split("=", 1) for w in words[1:] if "=" in w)

    def psi_line(fields: dict[str, str]) -> PsiLine:
        return PsiLine(
            avg10=float(fields["avg10"]),
            avg60=float(fields["avg60"]),
            avg300=float(fields["avg300"]),
            total_us=int(fields["total"]),
        )

    try:
        some = psi_line(lines["some"])
        full = psi_line(lines["full"]) if "full" in lines else None
    except (KeyError, ValueError):
        return None
    return MemoryPressure(some=some, full=full)


def read_memory_pressure(proc: str = "/proc") -> MemoryPressure | None:
    """Memory PSI, or None where the kernel has none: the file is absent (kernel without CONFIG_PSI,
    some containers), reading fails with EOPNOTSUPP (booted with psi=0) or any other OSError, or the
    content can't be parsed. None means "not known", never "no pressure"."""
    try:
        text = _read(f"{proc}/pressure/memory")
    except OSError:
        return None
    return parse_memory_pressure(text)
