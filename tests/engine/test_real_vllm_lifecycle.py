"""tunerd supervising real vLLM on the CPU, on the tiny daemon the engine tier shares (conftest.tiny_daemon).

Start → RUNNING with vLLM's "KV cache size: N tokens" read; load and the signals it moves; a tuning-style
restart through the preflight; SIGTERM of the daemon: every process gone, exit 0 (run after every other
user of the shared daemon). The engine core killed and its whole old tree reaped is the door's test
(test_real_vllm_door.py), under its clients' load.

A vLLM start costs 45-90 s on a small CPU, so the tests share one daemon, but none depends on another:
each passes alone and in any order. A test that needs RUNNING waits for it (a previous test may have left
a restart under way), one that disturbs the engine leaves it restarted and RUNNING, one that stops the
daemon leaves it stopped and the next test's fixture starts it again, and journal records are looked for
only after the seq the test noted before acting. Parameters are whatever the previous test left.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.engine.conftest import UP_S
from tests.harness import Daemon, alive
from tunerd.procfs import processes as procfs

pytestmark = pytest.mark.engine


@pytest.fixture
def daemon(tiny_daemon: Daemon) -> Daemon:
    """The shared tiny daemon (conftest.tiny_daemon), running when a test begins."""
    if not tiny_daemon.running:
        tiny_daemon.start()
    return tiny_daemon


def vllm_url(daemon: Daemon) -> str:
    return f"http://127.0.0.1:{daemon.sections['engine']['port']}"


def test_real_vllm_comes_up_running_with_its_kv_cache_size_read(daemon: Daemon) -> None:
    status = daemon.wait_state("RUNNING", timeout=UP_S)
    ready = [r for r in daemon.records() if r["event"] == "engine.ready"][-1]  # of the engine now running
    assert ready["pid"] == status["engine"]["pid"]
    assert ready["kv_cache_tokens"] == 1952  # "CPU KV cache size: 1,952 tokens" (fixture ok_start.log)
    assert status["engine"]["kv_cache_tokens"] == 1952
    comms = {procfs.read_stat(pid).comm for pid in daemon.marked_pids() if procfs.read_stat(pid)}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= comms
    answer = httpx.post(
        f"{vllm_url(daemon)}/v1/completions",
        json={
            "model": str(daemon.sections["engine"]["model"]),
            "prompt": "The quick brown fox",
            "max_tokens": 8,
        },
        timeout=60,
    )
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 8


def generate_load(daemon: Daemon, sequences: int = 12, max_tokens: int = 480) -> int:
    """One completion request carrying `sequences` distinct prompts: vLLM admits them together, so they
    grow side by side until their ~5,900 tokens overflow the 1,952-token KV cache (vllm-facts.md).

    One request, not one per thread: on 2 cores client threads (and vLLM's API server) are scheduled so
    unevenly that separate requests ran one after another and the cache never filled (CI, usage peak
    0.45). Distinct prompts: identical ones could share cached blocks. Returns the HTTP status.
    """
    body = {
        "model": str(daemon.sections["engine"]["model"]),
        "prompt": [f"{i}: the quick brown fox jumps over the lazy dog today" for i in range(sequences)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    return httpx.post(f"{vllm_url(daemon)}/v1/completions", json=body, timeout=300).status_code


def test_under_load_the_kv_cache_signal_passes_0_9_and_preemptions_are_counted(daemon: Daemon) -> None:
    """Waves of 12 sequences x ~490 tokens against a 1,952-token cache: each fills it for a few seconds.

    On 2 cores vLLM's API server (which also answers /metrics) and every observer are starved while
    vLLM generates, so one wave may pass between two polls: the load goes on, wave after wave, until
    the window shows what it must (or the waves run out), and the signals are read after each wave.
    """
    daemon.wait_state("RUNNING", timeout=UP_S)
    signals: dict[str, float | None] = {}
    statuses: list[int] = []
    for _ in range(10):
        statuses.append(generate_load(daemon))
        # Two more polls folded: the second one began after the first ended, so after the wave.
        daemon.observe(0, samples=2)
        signals = {name: entry["value"] for name, entry in daemon.status()["signals"].items()}
        if (signals["kv_cache.usage_max"] or 0) > 0.9 and (signals["preemptions.rate"] or 0) > 0:
            break
    assert statuses == [200] * len(statuses)
    assert signals["kv_cache.usage_max"] > 0.9, f"KV-cache usage peaked at {signals['kv_cache.usage_max']}"
    assert signals["preemptions.rate"] > 0, "preemptions were counted"
    assert signals["throughput.generation"] > 0
    assert daemon.metric("tunerd_engine_up") == 1
    assert daemon.metric("tunerd_engine_scrape_up") == 1
    peak = daemon.metric("tunerd_signal_kv_cache_usage_max_ratio")
    assert peak is not None and peak > 0.9, f"the exported KV-cache peak is {peak}"


def test_tuning_style_restart_goes_through_the_preflight_and_memory_gate(daemon: Daemon) -> None:
    before = daemon.wait_state("RUNNING", timeout=UP_S)["engine"]["params"].get("max_num_seqs")
    target = 8 if before != 8 else 12  # a change from whatever is in force: a trial
    old_tree = daemon.marked_pids()
    after = daemon.last_seq()
    asked = subprocess.run(
        [
            sys.executable,
            "-m",
            "tunerd",
            "restart",
            "--set",
            f"max_num_seqs={target}",
            "--reason",
            "trial from the test",
            "--config",
            str(daemon.config_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert asked.returncode == 0, asked.stderr
    intent = daemon.wait_record(lambda r: r["event"] == "intent" and r["action"] == "change", after_seq=after)
    assert intent["params"]["max_num_seqs"] == target
    assert intent["params_before"].get("max_num_seqs") == before
    stopped = daemon.wait_event("engine.stopped", timeout=60, after_seq=intent["seq"])
    passed = daemon.wait_event("preflight.passed", timeout=60, after_seq=stopped["seq"])
    assert set(passed["timings"]) == {"foreign", "leftovers", "port", "memory", "page_cache", "plan"}
    spawned = daemon.wait_event("engine.spawned", after_seq=passed["seq"])
    assert spawned["argv"][spawned["argv"].index("--max-num-seqs") + 1] == str(target)
    assert "--shutdown-timeout" in spawned["argv"], "vLLM 0.32 has it (checked with --help at daemon start)"
    outcome = daemon.wait_record(
        lambda r: r["event"] == "outcome" and r["intent"] == intent["seq"], timeout=UP_S
    )
    assert outcome["result"] == "ok"
    assert not [pid for pid in old_tree if alive(pid)]
    assert daemon.wait_state("RUNNING")["engine"]["params"]["max_num_seqs"] == target
    print("\n".join(json.dumps(r) for r in daemon.records() if r["seq"] >= intent["seq"]))


@pytest.mark.stops_tiny_daemon
def test_sigterm_stops_vllm_and_every_process_of_its_tree(daemon: Daemon) -> None:
    daemon.wait_state("RUNNING", timeout=UP_S)
    tree = daemon.marked_pids()
    after = daemon.last_seq()
    assert daemon.stop(timeout=120) == 0
    assert not [pid for pid in tree if alive(pid)]
    assert not daemon.marked_pids()
    stopped = daemon.wait_event("engine.stopped", after_seq=after)
    assert stopped["reason"] == "daemon shutdown" and stopped["survivors"] == []
    assert daemon.records()[-1]["event"] == "daemon.stopped"
