"""/proc/meminfo — the one reader of the host's memory figures and of the page-cache figure."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping


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
    with open(f"{proc}/meminfo", encoding="ascii", errors="replace") as f:
        return parse_meminfo(f.read())


def page_cache_bytes(meminfo: Mapping[str, int]) -> int | None:
    """Buffers + Cached − Shmem: the file-backed page cache that dropping caches could release.

    Shmem (tmpfs, /dev/shm, which vLLM uses for IPC) sits inside `Cached` but cannot be dropped.
    None when the kernel gave no `Cached` line.
    """
    if "Cached" not in meminfo:
        return None
    return max(0, meminfo["Cached"] + meminfo.get("Buffers", 0) - meminfo.get("Shmem", 0))
