"""Host collector and the procfs memory readers against fake /proc trees, and a smoke test against this
machine's /proc."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import psutil
import pytest

from tunerd.observe.host import HostCollector, pci_sysfs_name, read_pci_numa_node
from tunerd.procfs import memory
from tunerd.procfs.memory import PsiLine, read_meminfo, read_memory_pressure, read_vmstat

KIB = 1024

MEMINFO = """\
MemTotal:       127600748 kB
MemFree:         2000000 kB
MemAvailable:   118566368 kB
Buffers:          100000 kB
Cached:         116000000 kB
SwapCached:            0 kB
Active:          5000000 kB
Shmem:            300000 kB
SReclaimable:     400000 kB
SwapTotal:       16777212 kB
SwapFree:        16000000 kB
HugePages_Total:       0
HugePages_Free:        0
Hugepagesize:       2048 kB
"""

VMSTAT = """\
nr_free_pages 500000
nr_zone_inactive_anon 1234
pgpgin 99
pswpin 17
pswpout 42
pgalloc_normal 123456789
pgfault 987654321
pgmajfault 4321
workingset_nodes -3
"""

PRESSURE = """\
some avg10=1.25 avg60=0.50 avg300=0.10 total=123456
full avg10=0.75 avg60=0.25 avg300=0.05 total=65432
"""

READING_KEYS = {
    "host.mem_total_bytes",
    "host.mem_available_bytes",
    "host.mem_free_bytes",
    "host.swap_total_bytes",
    "host.swap_used_bytes",
    "host.swap_in_pages_total",
    "host.swap_out_pages_total",
    "host.pgfault_total",
    "host.pgmajfault_total",
    "host.psi_some_avg10",
    "host.psi_full_avg10",
    "host.psi_some_total_us",
    "host.psi_full_total_us",
    "host.page_cache_bytes",
    "engine.minflt_total",
    "engine.majflt_total",
    "engine.rss_bytes",
}


FAKE_PAGE_SIZE = 4096  # statm counts pages; the fake trees are written for this size whatever the host's


def fake_collector(proc: Path, **kwargs) -> HostCollector:
    return HostCollector(proc=str(proc), page_size=FAKE_PAGE_SIZE, **kwargs)


def write_pid(proc: Path, pid: int, *, ppid: int, minflt: int, majflt: int, rss_kb: int | None) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(
        f"{pid} (VLLM::EngineCor) S {ppid} {ppid} {ppid} 0 -1 4194560 {minflt} 9 {majflt} 8 "
        "1 2 0 0 20 0 4 0\n"
    )
    status = f"Name:\tpython\nPPid:\t{ppid}\n"
    if rss_kb is not None:
        status += f"VmRSS:\t{rss_kb:>8} kB\n"
    (d / "status").write_text(status + "Threads:\t3\n")
    # statm: size resident shared text lib data dt, in pages; a zombie has no memory map: all zero.
    pages = (rss_kb or 0) * 1024 // FAKE_PAGE_SIZE
    (d / "statm").write_text(
        f"{pages * 3} {pages} {pages // 4} 1000 0 {pages * 2} 0\n" if pages else "0 0 0 0 0 0 0\n"
    )


def make_proc(tmp_path: Path, *, psi: bool = True) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "vmstat").write_text(VMSTAT)
    if psi:
        (proc / "pressure").mkdir()
        (proc / "pressure" / "memory").write_text(PRESSURE)
    write_pid(proc, 1745, ppid=1744, minflt=1000, majflt=10, rss_kb=1275256)
    write_pid(proc, 1809, ppid=1745, minflt=250000, majflt=5, rss_kb=2428392)
    write_pid(proc, 1808, ppid=1745, minflt=7, majflt=0, rss_kb=None)  # zombie: no VmRSS
    return proc


def test_sample_reads_every_figure_exactly(tmp_path: Path) -> None:
    proc = make_proc(tmp_path)
    s = fake_collector(proc, clock=lambda: 12.5).sample([1745, 1809, 1808])
    assert s.taken_at == 12.5
    assert s.mem_total_bytes == 127600748 * KIB
    assert s.mem_available_bytes == 118566368 * KIB
    assert s.mem_free_bytes == 2000000 * KIB
    assert s.page_cache_bytes == (100000 + 116000000 - 300000) * KIB  # Buffers + Cached - Shmem
    assert s.shmem_bytes == 300000 * KIB
    assert s.swap_total_bytes == 16777212 * KIB
    assert s.swap_used_bytes == (16777212 - 16000000) * KIB
    assert (s.swap_in_pages_total, s.swap_out_pages_total) == (17, 42)
    assert (s.pgfault_total, s.pgmajfault_total) == (987654321, 4321)
    assert s.pressure is not None and s.pressure.full is not None
    assert (s.pressure.some.avg10, s.pressure.some.avg60, s.pressure.some.avg300) == (1.25, 0.5, 0.1)
    assert (s.pressure.some.total_us, s.pressure.full.total_us) == (123456, 65432)
    assert s.engine is not None
    assert s.engine.pids == (1745, 1809, 1808)
    assert s.engine.minflt_total == 1000 + 250000 + 7
    assert s.engine.majflt_total == 15
    assert s.engine.rss_bytes == (1275256 + 2428392) * KIB


def test_as_readings_has_exactly_the_documented_keys(tmp_path: Path) -> None:
    proc = make_proc(tmp_path)
    r = fake_collector(proc).sample([1809]).as_readings()
    assert set(r) == READING_KEYS
    assert r["host.mem_total_bytes"] == 127600748.0 * KIB
    assert r["host.psi_some_avg10"] == 1.25
    assert r["host.psi_full_avg10"] == 0.75
    assert r["host.psi_some_total_us"] == 123456.0
    assert r["host.psi_full_total_us"] == 65432.0
    assert r["host.swap_out_pages_total"] == 42.0
    assert r["engine.minflt_total"] == 250000.0
    assert r["engine.majflt_total"] == 5.0
    assert r["engine.rss_bytes"] == 2428392.0 * KIB
    assert all(isinstance(v, float) for v in r.values())


def test_kernel_without_psi_gives_none_not_zero(tmp_path: Path) -> None:
    proc = make_proc(tmp_path, psi=False)
    s = fake_collector(proc).sample()
    assert s.pressure is None
    r = s.as_readings()
    for key in (
        "host.psi_some_avg10",
        "host.psi_full_avg10",
        "host.psi_some_total_us",
        "host.psi_full_total_us",
    ):
        assert r[key] is None
    assert r["host.mem_total_bytes"] == 127600748.0 * KIB


def test_psi_disabled_with_eopnotsupp_gives_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # psi=0 on the kernel command line: the file exists but reading it fails with EOPNOTSUPP.
    proc = make_proc(tmp_path)
    real_read = memory._read

    def read(path: str) -> str:
        if path.endswith("/pressure/memory"):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_read(path)

    monkeypatch.setattr(memory, "_read", read)
    assert read_memory_pressure(str(proc)) is None
    s = fake_collector(proc).sample()
    assert s.pressure is None and s.mem_total_bytes == 127600748 * KIB


def test_psi_without_full_line_keeps_some(tmp_path: Path) -> None:
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "memory").write_text(PRESSURE.splitlines()[0] + "\n")
    psi = read_memory_pressure(str(tmp_path))
    assert psi is not None and psi.full is None and psi.some.total_us == 123456


def test_engine_pid_that_vanished_is_skipped(tmp_path: Path) -> None:
    proc = make_proc(tmp_path)
    # 9999 never existed; 1745 is still listed but its files are gone (exited between list and read).
    for name in ("stat", "status", "statm"):
        (proc / "1745" / name).unlink()
    s = fake_collector(proc).sample([9999, 1745, 1809])
    assert s.engine is not None
    assert s.engine.pids == (1809,)
    assert (s.engine.minflt_total, s.engine.majflt_total) == (250000, 5)
    assert s.engine.rss_bytes == 2428392 * KIB


def test_no_engine_pids_gives_none_engine_readings(tmp_path: Path) -> None:
    proc = make_proc(tmp_path)
    for pids in ([], [9999]):
        r = fake_collector(proc).sample(pids).as_readings()
        assert r["engine.minflt_total"] is None
        assert r["engine.rss_bytes"] is None


def test_missing_vmstat_gives_none_counters(tmp_path: Path) -> None:
    proc = make_proc(tmp_path)
    (proc / "vmstat").unlink()
    s = fake_collector(proc).sample()
    assert (s.pgfault_total, s.swap_in_pages_total) == (None, None)
    assert s.mem_total_bytes == 127600748 * KIB


def test_missing_meminfo_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        fake_collector(tmp_path).sample()


def test_read_meminfo_converts_kb_and_keeps_counts(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text(MEMINFO)
    mem = read_meminfo(str(tmp_path))
    assert mem["MemTotal"] == 127600748 * KIB
    assert mem["Hugepagesize"] == 2048 * KIB
    assert mem["HugePages_Total"] == 0


def test_pci_numa_node_from_sysfs(tmp_path: Path) -> None:
    assert pci_sysfs_name("00000000:00:06.0") == "0000:00:06.0"
    assert pci_sysfs_name("0000000F:01:00.0") == "000f:01:00.0"  # GB10's bus id
    assert pci_sysfs_name("garbage") is None
    devices = tmp_path / "bus" / "pci" / "devices"
    for name, node in (("0000:00:06.0", "-1"), ("000f:01:00.0", "1")):
        (devices / name).mkdir(parents=True)
        (devices / name / "numa_node").write_text(node + "\n")
    assert read_pci_numa_node("00000000:00:06.0", str(tmp_path)) is None
    assert read_pci_numa_node("0000000F:01:00.0", str(tmp_path)) == 1
    assert read_pci_numa_node("00000000:41:00.0", str(tmp_path)) is None


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="needs Linux procfs")
def test_smoke_on_this_machines_proc() -> None:
    s = HostCollector().sample([os.getpid()])
    assert s.mem_total_bytes == psutil.virtual_memory().total
    assert s.mem_available_bytes is not None and 0 < s.mem_available_bytes <= s.mem_total_bytes
    assert s.mem_free_bytes is not None and 0 < s.mem_free_bytes <= s.mem_total_bytes
    assert s.page_cache_bytes is not None and s.page_cache_bytes >= 0
    assert s.pgfault_total is not None and s.pgfault_total > 0
    assert s.engine is not None and s.engine.pids == (os.getpid(),)
    assert s.engine.minflt_total > 0
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < s.engine.rss_bytes < 2 * rss
    r = s.as_readings()
    assert set(r) == READING_KEYS
    try:
        Path("/proc/pressure/memory").read_text()
    except OSError:  # no PSI on this kernel (absent, or psi=0)
        assert r["host.psi_some_total_us"] is None
    else:
        assert r["host.psi_some_total_us"] is not None


def test_psi_fields_are_read_by_name_in_any_order_and_garbage_is_none(tmp_path: Path) -> None:
    (tmp_path / "pressure").mkdir()
    psi_file = tmp_path / "pressure" / "memory"
    psi_file.write_text("some total=5 avg300=0.10 avg60=0.50 avg10=1.25\n")
    psi = read_memory_pressure(str(tmp_path))
    assert psi is not None and psi.some == PsiLine(1.25, 0.5, 0.1, 5) and psi.full is None
    for garbage in ("some avg10=1.2.3 avg60=0.50 avg300=0.10 total=5\n", "some avg10=1.25\n", "full\n", ""):
        psi_file.write_text(garbage)
        assert read_memory_pressure(str(tmp_path)) is None


def test_vmstat_keeps_name_value_lines_only(tmp_path: Path) -> None:
    (tmp_path / "vmstat").write_text(VMSTAT + "odd line with words\nnr_bad x\n")
    vm = read_vmstat(str(tmp_path))
    assert (vm["pgfault"], vm["pswpout"], vm["workingset_nodes"]) == (987654321, 42, -3)
    assert "nr_bad" not in vm and "odd" not in vm
    with pytest.raises(OSError):
        read_vmstat(str(tmp_path / "nothing"))


def test_rss_comes_from_statm_and_every_sample_reads_the_files_afresh(tmp_path: Path) -> None:
    proc = make_proc(tmp_path)
    (proc / "1809" / "statm").write_text(f"9 {1000000 // 4} 0 0 0 0 0\n")  # statm wins over status
    collector = fake_collector(proc)
    assert collector.sample([1745, 1809]).engine.rss_bytes == (1275256 + 1000000) * KIB  # type: ignore[union-attr]
    (proc / "meminfo").write_text(MEMINFO.replace("118566368", "118000000"))  # rewritten, as procfs is
    (proc / "1809" / "statm").write_text(f"9 {2000000 // 4} 0 0 0 0 0\n")
    second = collector.sample([1809])
    assert second.mem_available_bytes == 118000000 * KIB
    assert second.engine is not None and second.engine.pids == (1809,)
    assert second.engine.rss_bytes == 2000000 * KIB
