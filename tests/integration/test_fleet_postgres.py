"""The tuning memory shared through a real PostgreSQL (tests/pg.py: Debian's package, a throwaway
cluster): two daemons on the fake vLLM sharing what they learned, the database stopped mid-run, two
writers at once, a wrong password, a database migrated by a newer tunerd.

The fake's control file sets the pressure the KV rule fires on (test_tuning.py); a trial is kept when
the test lifts the pressure once the trial's engine runs (the rule's condition eased, throughput alike),
else reverted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.harness import Daemon, free_port, running_daemon, wait_until
from tests.integration.test_observe import control
from tests.integration.test_tuning import PRESSURE, tuning_sections
from tests.pg import PASSWORD, Cluster, cluster
from tunerd.config.memory import MemoryConfig
from tunerd.records.experience import Entry, ExperienceKey, experience_path
from tunerd.records.fleet_store import SCHEMA_VERSION, FleetStore

# Relieved, the engine serves 2x: a performance change is kept only on evidence of a gain beyond the
# tolerance (issue 22; LOOSE's 20 % here), not for easing its condition alone. 1.5x was too close on a
# busy box: CI measured 303 → 428 tok/s over a 4 s window, ratio interval [1.158, 1.719], budget spent.
RELIEVED = {**PRESSURE, "kv_cache_usage": 0.5, "preemptions_per_s": 0, "tokens_per_s": 600}


def kv_rule(name: str, factor: float) -> str:
    return f"""
[[rule]]
name = "{name}"
all = ["preemptions.rate > 0", "kv_cache.full_share >= 0.1"]
for_s = 2
cooldown_s = 600
action = {{ kind = "step", param = "max_num_seqs", direction = "down", factor = {factor} }}
"""


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    with cluster() as pg:
        yield pg


@pytest.fixture
def fleet_url(postgres: Cluster) -> str:
    """A fresh database of the session's cluster, its URL without a password."""
    return postgres.create_database(f"fleet_{uuid.uuid4().hex[:10]}")


ENV = {"PGPASSWORD": PASSWORD}


def box(workdir: Path, model: Path, url: str, host: str, rules: str, **memory: Any) -> dict:
    workdir.mkdir(exist_ok=True)
    sections = tuning_sections(workdir, rules)
    sections["engine"]["model"] = str(model)  # one model on every box: one key
    sections["memory"] = {"url": url, "host": host, "sync_interval_s": 0.5, "refresh_s": 1.0} | memory
    return sections


def rows(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url, password=PASSWORD) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT id, host, param, old_value, new_value, decision FROM tunerd_experiments ORDER BY at"
        )
        names = [d.name for d in cur.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def check_config(daemon: Daemon) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tunerd", "check-config", str(daemon.config_path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def spawns(daemon: Daemon) -> int:
    return sum(1 for r in daemon.records() if r["event"] == "engine.spawned")


def trial_after_relief(daemon: Daemon, ctl: Path, after_seq: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lift the pressure once the next trial started (its before window is taken): (started, decided)."""
    started = daemon.wait_event("trial.started", timeout=90, after_seq=after_seq)
    control(ctl, **RELIEVED)
    return started, daemon.wait_event("trial.decided", timeout=90, after_seq=started["seq"])


def test_the_second_box_skips_what_lost_and_tries_what_was_kept_first(
    tmp_path: Path, fleet_url: str, figures: Callable[[str], None]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    # Box A: the halving rule's 16 → 8 loses (the pressure stays); then the 0.75 rule's step is kept.
    a_dir = tmp_path / "a"
    a = box(a_dir, model, fleet_url, "box-a", kv_rule("kv-half", 0.5) + kv_rule("kv-quarter", 0.75))
    with running_daemon(a_dir, a, ENV) as daemon:
        first = daemon.wait_event("trial.started", timeout=90)
        assert (first["old"], first["new"]) == (16, 8)
        lost = daemon.wait_event("trial.decided", timeout=90, after_seq=first["seq"])
        assert lost["decision"] == "reverted"
        second, kept = trial_after_relief(daemon, a_dir / "control.json", lost["seq"])
        value = second["new"]
        assert 8 < value < 16 and kept["decision"] == "kept", daemon.dump()
        daemon.wait_event("memory.fleet_sent", timeout=30, after_seq=kept["seq"])
        a_restarts = spawns(daemon) - 1
    sent = {(r["host"], r["param"], r["new_value"], r["decision"]) for r in rows(fleet_url)}
    assert {("box-a", "max_num_seqs", 8, "revert"), ("box-a", "max_num_seqs", value, "keep")} <= sent

    # Box B, with only the halving rule: its own step would be 16 → 8, which lost on box A.
    b_dir = tmp_path / "b"
    b = box(b_dir, model, fleet_url, "box-b", kv_rule("kv-half", 0.5))
    with running_daemon(b_dir, b, ENV) as daemon:
        tabu = daemon.wait_event("memory.from_fleet", timeout=90, taken="tabu")  # after the proposal
        assert {"param": "max_num_seqs", "value": 8, "host": "box-a"} in [
            {k: v[k] for k in ("param", "value", "host")} for v in tabu["values"]
        ]
        first_proposal = daemon.wait_event("memory.from_fleet", timeout=30, taken="first proposal")
        taken = (first_proposal["new"], first_proposal["instead_of"], first_proposal["host"])
        assert taken == (value, 8, "box-a")
        started, decided = trial_after_relief(daemon, b_dir / "control.json", first_proposal["seq"])
        assert started["new"] == value and any("fleet: box-a" in note for note in started["notes"])
        assert decided["decision"] == "kept", daemon.dump()  # verified here, as every change is
        tried = [r["new"] for r in daemon.records() if r["event"] == "trial.started"]
        assert tried == [value]  # 8, which lost on box A, never tried here
        b_restarts = spawns(daemon) - 1
        status = daemon.status()["tuning"]["fleet"]
        assert status["reachable"] and status["host"] == "box-b" and status["snapshot_entries"] >= 2
        shown = subprocess.run(
            [sys.executable, "-m", "tunerd", "memory", "show", "--config", str(daemon.config_path)],
            capture_output=True, text=True, timeout=60, env={**os.environ, **ENV},
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert "from: local" in shown.stdout and "fleet box-a" in shown.stdout
        assert f"kept: max_num_seqs={value}  (fleet box-a)" in shown.stdout
    # The figure of README "More than one box": the restarts the second box saved.
    figures(
        f"shared memory: box A took {a_restarts} engine restarts to keep max_num_seqs={value} "
        f"(16 → 8 lost, reverted); box B, taking box A's memory, {b_restarts}"
    )
    assert b_restarts < a_restarts


def test_the_database_stopped_mid_run_loses_nothing_and_blocks_nothing(
    tmp_path: Path, postgres: Cluster, fleet_url: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    sections = box(tmp_path / "a", model, fleet_url, "box-a", kv_rule("kv-half", 0.5))
    with running_daemon(tmp_path / "a", sections, ENV) as daemon:
        daemon.wait_event("memory.fleet_snapshot", timeout=60)
        postgres.stop()
        try:
            down = daemon.wait_event("memory.fleet_unreachable", timeout=60)
            assert "refused" in down["reason"] or "failed" in down["reason"]
            decided = daemon.wait_event("trial.decided", timeout=120)  # the tuning goes on alone
            assert decided["decision"] == "reverted"
            # The loop answers, and the trial's entry waits to be sent. The status document is rebuilt
            # every STATUS_EVERY_S, not at the step that journaled the verdict: a read right after
            # trial.decided can precede the entry (CI: unsent 0).
            wait_until(
                lambda: daemon.status()["tuning"]["fleet"]["unsent"] >= 1, 30, "the entry counted unsent"
            )
            assert not daemon.status()["tuning"]["fleet"]["reachable"]
        finally:
            postgres.start()
        back = daemon.wait_event("memory.fleet_back", timeout=60, after_seq=down["seq"])
        daemon.wait_event("memory.fleet_sent", timeout=30, after_seq=back["seq"] - 1)
        assert [r["event"] for r in daemon.records()].count("memory.fleet_unreachable") == 1
    local = json.loads(experience_path(tmp_path / "a" / "state").read_text())["entries"]
    stored = {r["id"] for r in rows(fleet_url)}
    assert local and {e["id"] for e in local} <= stored


def entries(host: str, count: int) -> list[Entry]:
    key = ExperienceKey("m", "cuda:H200:140GiB", "0.32.0", "prompt~128 output~64 concurrency~16")
    return [
        Entry(
            key,
            "trial",
            {"max_num_seqs": n},
            float(n),
            "keep",
            {"param": "max_num_seqs"},
            float(n),
            id=f"{host}-{n}",
        )
        for n in range(count)
    ]


def test_two_writers_at_once_each_migrate_once_and_lose_nothing(
    fleet_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    barrier, errors = threading.Barrier(2), []
    shared = entries("shared", 50)

    def write(host: str) -> None:
        store = FleetStore(MemoryConfig(url=fleet_url, password_file=None), host)
        barrier.wait()
        try:
            for chunk in range(0, 200, 20):
                store.exchange([*entries(host, 200)[chunk : chunk + 20], *shared[: chunk // 4]], fetch=True)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(h,)) for h in ("box-a", "box-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    ids = [r["id"] for r in rows(fleet_url)]
    assert len(ids) == len(set(ids)) == 400 + 45
    with psycopg.connect(fleet_url, password=PASSWORD) as conn:
        versions = [v for (v,) in conn.execute("SELECT version FROM tunerd_schema_version ORDER BY version")]
    assert versions == list(range(1, SCHEMA_VERSION + 1))


def test_an_older_tunerd_goes_on_with_a_database_a_newer_one_migrated(
    fleet_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    store = FleetStore(MemoryConfig(url=fleet_url), "old-box")
    store.exchange([], fetch=False)
    with psycopg.connect(fleet_url, password=PASSWORD) as conn:  # what a newer tunerd's migration 3 does
        conn.execute("ALTER TABLE tunerd_experiments ADD COLUMN goodput_slo jsonb")
        conn.execute("INSERT INTO tunerd_schema_version (version) VALUES (3)")
    done = store.exchange(entries("old-box", 3), fetch=True)
    assert done.schema == 3 and len(done.sent) == 3
    assert len(rows(fleet_url)) == 3


def test_a_wrong_password_fails_check_config_and_the_box_tunes_alone(tmp_path: Path, fleet_url: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    sections = box(
        tmp_path / "a", model, fleet_url, "box-a", kv_rule("kv-half", 0.5), password_file=str(wrong)
    )
    with running_daemon(tmp_path / "a", sections) as daemon:
        checked = check_config(daemon)
        assert checked.returncode == 1
        assert "memory.url" in checked.stderr and "password authentication failed" in checked.stderr
        down = daemon.wait_event("memory.fleet_unreachable", timeout=60)
        assert "password authentication failed" in down["reason"]
        daemon.wait_event("trial.decided", timeout=120)  # tuning goes on locally
        assert "not-the-password" not in daemon.journal_path.read_text()
        assert "not-the-password" not in json.dumps(daemon.status())


def test_an_unreachable_database_is_a_warning_of_check_config(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    url = f"postgresql://tunerd:{PASSWORD}@127.0.0.1:{free_port()}/nothing"
    sections = box(tmp_path / "a", model, url, "box-a", kv_rule("kv-half", 0.5))
    daemon = Daemon(tmp_path / "a", sections)
    checked = check_config(daemon)
    assert checked.returncode == 0, checked.stderr
    assert "unreachable now" in checked.stdout and PASSWORD not in checked.stdout + checked.stderr
