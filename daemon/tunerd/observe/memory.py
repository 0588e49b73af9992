"""The host memory reading the guards act on: MemTotal, MemAvailable and memory pressure (PSI)."""

from __future__ import annotations

from tunerd.core.machine import MemoryReading
from tunerd.procfs.memory import read_meminfo, read_memory_pressure


def read_memory(proc: str = "/proc") -> MemoryReading:
    """From `<proc>/meminfo` and `<proc>/pressure/memory`; unknown parts are None (never 0)."""
    try:
        info = read_meminfo(proc)
    except OSError:
        info = {}
    pressure = read_memory_pressure(proc)
    return MemoryReading(
        info.get("MemTotal"),
        info.get("MemAvailable"),
        pressure.some.avg10 if pressure else None,
        pressure.full.avg10 if pressure and pressure.full else None,
    )
