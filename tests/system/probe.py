#!/usr/bin/env python3
"""Runs inside the test container (stdlib only): what the system tier asks about processes and files.

probe.py procs              every process: pid, ppid, pgid, comm, cmdline, start time, uid,
                            groups, the TUNERD_INSTANCE marker (JSON list)
probe.py environ PID        the process' environment (JSON object)
probe.py resident FILE...   how many pages of each file are in the page cache (mincore(2))
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
from typing import Any

MARKER = b"TUNERD_INSTANCE="


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def process(pid: int) -> dict[str, Any] | None:
    try:
        stat = read(f"/proc/{pid}/stat").decode(errors="replace")
        cmdline = read(f"/proc/{pid}/cmdline").split(b"\0")
        status = read(f"/proc/{pid}/status").decode(errors="replace")
    except OSError:
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    rest = stat[stat.rindex(")") + 2 :].split()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    marker = None
    try:
        for item in read(f"/proc/{pid}/environ").split(b"\0"):
            if item.startswith(MARKER):
                marker = item[len(MARKER) :].decode()
    except OSError:
        pass
    return {
        "pid": pid,
        "state": rest[0],
        "ppid": int(rest[1]),
        "pgid": int(rest[2]),
        "start": int(rest[19]),
        "comm": comm,
        "cmdline": [part.decode(errors="replace") for part in cmdline if part],
        "uid": int(fields["Uid"].split()[1]),
        "groups": [int(g) for g in fields.get("Groups", "").split()],
        "marker": marker,
    }


def procs() -> list[dict[str, Any]]:
    found = (process(int(entry)) for entry in os.listdir("/proc") if entry.isdigit())
    return [p for p in found if p is not None]


def environ(pid: int) -> dict[str, str]:
    pairs = (
        item.decode(errors="replace").partition("=") for item in read(f"/proc/{pid}/environ").split(b"\0")
    )
    return {key: value for key, _, value in pairs if key}


def resident(path: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(address, size, vector) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        libc.munmap(address, size)
    return sum(byte & 1 for byte in vector)


def main(argv: list[str]) -> int:
    if argv[:1] == ["procs"]:
        print(json.dumps(procs()))
    elif argv[:1] == ["environ"] and len(argv) == 2:
        print(json.dumps(environ(int(argv[1]))))
    elif argv[:1] == ["resident"]:
        print(json.dumps({path: resident(path) for path in argv[1:]}))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
