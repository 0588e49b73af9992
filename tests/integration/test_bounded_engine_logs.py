"""A chatty engine's log stays bounded while tunerd still reads every line of it (issue 20).

The fake vLLM prints access-log lines at a busy server's rate (FAKE_VLLM_CHATTER_PER_S), then its engine
core dies (FAKE_VLLM_ENGINE_DIES_AFTER_S, engine_killed_run2): the log is rotated many times meanwhile,
and the line that says why vLLM died is still classified and kept on disk. (The journal's tail of a
failed start comes from the same lines: tests/unit/test_engine_logs.py.)
"""

from __future__ import annotations

from pathlib import Path

from tests.harness import running_daemon
from tests.integration.conftest import fake_sections

CAP = 64 * 1024
STARTUP = "Starting vLLM server"  # the fake's start-up banner (ok_start.log)


def run_files(log: Path) -> list[Path]:
    return [log, *sorted(log.parent.glob(f"{log.name}.*"))]


def test_a_chatty_engines_log_stays_under_the_cap_and_its_fatal_line_is_still_classified(
    workdir: Path,
) -> None:
    sections = fake_sections(
        workdir,
        knobs={"FAKE_VLLM_CHATTER_PER_S": "2000", "FAKE_VLLM_ENGINE_DIES_AFTER_S": "4.0"},
        engine={"access_log": "on"},  # the door is off here; "on" says it: the access log is the chatter
        paths={"engine_log_max_bytes": CAP, "engine_log_backups": 1},
    )
    with running_daemon(workdir, sections) as daemon:
        spawned = daemon.wait_event("engine.spawned")
        assert "--disable-uvicorn-access-log" not in spawned["argv"]
        failed = daemon.wait_event("engine.failed")
        daemon.wait_event("engine.stopped", after_seq=failed["seq"])  # the run's output is complete
        assert daemon.stop() == 0

    assert failed["failure"]["kind"] == "engine_dead" and failed["phase"] == "running"
    assert "engine core exited unexpectedly" in failed["failure"]["detail"]
    log = Path(spawned["log"])
    files = run_files(log)
    assert [f.name for f in files] == [log.name, log.name + ".1"]  # rotated, one copy kept
    for path in files:
        assert path.stat().st_size <= 2 * CAP, f"{path.name}: {path.stat().st_size} bytes"
    kept = "".join(path.read_text(errors="replace") for path in reversed(files))  # oldest first
    # About 8,000 lines (~570 KB) were written: the start-up scrolled out of both files ...
    assert STARTUP not in kept
    assert kept.count('"POST /v1/completions HTTP/1.1" 200 OK') > 500  # what is kept is the chatter
    # ... yet the line that says why vLLM died is on disk, the engine's last words after it.
    assert kept.index("engine core exited unexpectedly") > kept.rindex("/v1/completions HTTP/1.1")
    assert failed["failure"]["detail"] in kept
