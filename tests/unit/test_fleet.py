"""The shared tuning memory without a database (tune/fleet.py): the pure decisions on a snapshot (tabu,
the value tried first) and the loop's side of the exchange against a fake store (write-ahead, an outage
journaled once, nothing lost). The real PostgreSQL: tests/integration/test_fleet_postgres.py."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fakes import HeldJobs, make_config
from tunerd.config import Config
from tunerd.config.memory import MemoryConfig, redact
from tunerd.core.params import EngineParams
from tunerd.policy.tunables import Proposal
from tunerd.records.experience import Entry, Experience, ExperienceKey
from tunerd.records.fleet_store import Exchange, FleetError, read_password
from tunerd.records.journal import Journal, read_records
from tunerd.records.metrics import Metrics
from tunerd.records.recorder import Recorder
from tunerd.tune.fleet import (
    HOST_ENV,
    Fleet,
    FleetValue,
    fleet_bad_values,
    fleet_first,
    fleet_for,
    with_value,
)

KEY = ExperienceKey("model-fp", "cuda:NVIDIA H200:140GiB", "0.32.0", "prompt~128 output~64 concurrency~16")
OTHER = ExperienceKey("model-fp", "cuda:NVIDIA H200:140GiB", "0.32.0", "prompt~1024 output~64 concurrency~16")
PARAMS = EngineParams(max_num_seqs=16, max_model_len=512)


def entry(
    host: str,
    value: int,
    decision: str,
    at: float,
    *,
    key: ExperienceKey = KEY,
    objective: float | None = None,
    old: int = 16,
    verified: bool = True,
) -> Entry:
    return Entry(
        key,
        "trial",
        {"max_num_seqs": value, "max_model_len": 512},
        objective,
        decision,
        {"param": "max_num_seqs", "old": old, "reason": f"{decision} on {host}"},
        at,
        unverified=None if verified else "an upgrade",
        objective_name="throughput.generation" if objective is not None else None,
        id=f"{host}-{at}",
        host=host,
    )


def step_down() -> Proposal:
    return Proposal("max_num_seqs", 16, 8, PARAMS.replace(max_num_seqs=8))


# -- the decisions ------------------------------------------------------------------------------------


def test_a_value_reverted_elsewhere_is_bad_unless_kept_later() -> None:
    snapshot = [
        entry("a", 8, "revert", 1.0),
        entry("a", 12, "revert", 2.0),
        entry("b", 12, "keep", 3.0, objective=1.0),
    ]
    bad = fleet_bad_values(snapshot, KEY)
    assert [(b.param, b.value, b.host) for b in bad] == [("max_num_seqs", 8, "a")]
    assert "revert on a" in bad[0].why


def test_bad_values_are_of_the_same_key_and_verified_only() -> None:
    snapshot = [entry("a", 8, "revert", 1.0, key=OTHER), entry("a", 4, "failed", 2.0, verified=False)]
    assert fleet_bad_values(snapshot, KEY) == []


def test_the_best_kept_value_in_the_steps_direction_comes_first() -> None:
    snapshot = [
        entry("a", 12, "keep", 1.0, objective=300.0),
        entry("b", 10, "keep", 2.0, objective=340.0),
        entry("c", 24, "keep", 3.0, objective=400.0),  # the other direction: not this rule's step
    ]
    found = fleet_first(snapshot, KEY, step_down(), local=[], tabu=[], objective="throughput.generation")
    assert found is not None and (found.value, found.host, found.objective) == (10, "b", 340.0)
    assert "kept max_num_seqs 16 → 10" in found.why


def test_no_fleet_proposal_once_this_box_tried_the_parameter() -> None:
    snapshot = [entry("a", 12, "keep", 1.0, objective=300.0)]
    local = [entry("here", 8, "revert", 0.5)]
    assert (
        fleet_first(snapshot, KEY, step_down(), local=local, tabu=[], objective="throughput.generation")
        is None
    )


def test_a_tabu_out_of_bounds_or_later_reverted_value_is_not_proposed() -> None:
    goal = "throughput.generation"
    kept = [entry("a", 12, "keep", 1.0, objective=300.0)]
    assert fleet_first(kept, KEY, step_down(), local=[], tabu=[("max_num_seqs", 12)], objective=goal) is None
    assert fleet_first(kept, KEY, step_down(), local=[], tabu=[], objective=goal, bounds=(13, 64)) is None
    reverted_later = [*kept, entry("b", 12, "revert", 2.0)]
    assert fleet_first(reverted_later, KEY, step_down(), local=[], tabu=[], objective=goal) is None


def test_with_value_rebuilds_the_configuration() -> None:
    changed = with_value(step_down(), 12, "fleet: a kept it")
    assert changed is not None and changed.new == 12 and changed.params.max_num_seqs == 12
    assert changed.notes == ("fleet: a kept it",)


def test_redact_hides_the_password() -> None:
    assert redact("postgresql://tunerd:s3cret@db:5432/tunerd") == "postgresql://tunerd:***@db:5432/tunerd"
    assert redact("postgresql://tunerd@db/tunerd") == "postgresql://tunerd@db/tunerd"


def test_memory_config_refuses_another_scheme() -> None:
    with pytest.raises(ValueError, match="not a postgresql:// URL"):
        MemoryConfig(url="mysql://u:pw@db/x")


def test_password_from_file_then_systemd_credential(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    assert read_password(MemoryConfig(url="postgresql://u@db/x", password_file=secret)) == "from-file"
    (tmp_path / "tunerd-memory-password").write_text("credential")
    config = MemoryConfig(url="postgresql://u@db/x")
    assert read_password(config, {"CREDENTIALS_DIRECTORY": str(tmp_path)}) == "credential"
    assert read_password(config, {}) is None
    with pytest.raises(FleetError, match=r"memory\.password_file") as raised:
        read_password(MemoryConfig(url="postgresql://u@db/x", password_file=tmp_path / "missing"))
    assert raised.value.config


# -- the exchange against a fake store --------------------------------------------------------------------


class FakeStore:
    """Holds what was sent by id; `down` makes every exchange fail as an unreachable database would."""

    def __init__(self, others: Sequence[Entry] = ()) -> None:
        self.rows: dict[str, Entry] = {}
        self.others = tuple(others)
        self.down: str | None = None
        self.exchanges = 0

    def exchange(self, entries: Sequence[Entry], *, fetch: bool) -> Exchange:
        self.exchanges += 1
        if self.down is not None:
            raise FleetError(self.down)
        for e in entries:
            self.rows.setdefault(e.entry_id(), e)
        return Exchange(tuple(e.entry_id() for e in entries), self.others if fetch else None, 2)


def rig(tmp_path: Path, store: FakeStore) -> tuple[Fleet, Experience, HeldJobs, Journal]:
    config: Config = make_config(
        tmp_path,
        tmp_path,
        {"memory": {"url": "postgresql://t:pw@db/t", "sync_interval_s": 10.0, "refresh_s": 60.0}},
    )
    journal = Journal(tmp_path / "journal.jsonl")
    journal.open()
    experience = Experience(tmp_path / "experience.json")
    jobs = HeldJobs()
    fleet = Fleet(
        lambda: config, experience, store, host="here", recorder=Recorder(journal, Metrics()), submit=jobs
    )
    return fleet, experience, jobs, journal


def record_trial(experience: Experience, value: int, at: float) -> None:
    experience.record(
        KEY, {"max_num_seqs": value}, None, kind="trial", decision="revert",
        figures={"param": "max_num_seqs", "old": 16}, at=at,
    )  # fmt: skip


def events(journal: Journal) -> list[dict[str, Any]]:
    return [dict(r) for r in read_records(journal.path)]


def test_unsent_entries_go_out_once_and_the_snapshot_comes_in(tmp_path: Path) -> None:
    store = FakeStore([entry("a", 8, "revert", 1.0)])
    fleet, experience, jobs, _ = rig(tmp_path, store)
    record_trial(experience, 8, 5.0)
    fleet.step(0.0)
    assert jobs.queued, "the exchange is a job, never run on the loop"
    jobs.run_all()
    fleet.step(1.0)  # takes the result; the next exchange is not due yet
    assert len(store.rows) == 1 and [e.host for e in fleet.snapshot] == ["a"]
    assert fleet.unsent() == () and not jobs.queued
    fleet.step(10.0)
    jobs.run_all()
    assert store.exchanges == 2 and len(store.rows) == 1


def test_an_outage_is_journaled_once_and_nothing_is_lost(tmp_path: Path) -> None:
    store = FakeStore()
    fleet, experience, jobs, journal = rig(tmp_path, store)
    store.down = "connection refused"
    for n, now in enumerate((0.0, 10.0, 20.0)):
        record_trial(experience, 8 - n, now)
        fleet.step(now)
        jobs.run_all()
    fleet.step(25.0)
    assert fleet.unreachable == "connection refused" and store.rows == {}
    assert len(fleet.unsent()) == 3
    store.down = None
    fleet.step(30.0)
    jobs.run_all()
    fleet.step(31.0)
    assert len(store.rows) == 3 and fleet.unsent() == ()
    names = [r["event"] for r in events(journal)]
    assert names.count("memory.fleet_unreachable") == 1 and names.count("memory.fleet_back") == 1
    down = next(r for r in events(journal) if r["event"] == "memory.fleet_unreachable")
    assert down["reason"] == "connection refused" and down["url"] == "postgresql://t:***@db/t"


def test_a_pending_exchange_blocks_nothing(tmp_path: Path) -> None:
    fleet, _, jobs, _ = rig(tmp_path, FakeStore())
    fleet.step(0.0)
    for now in (10.0, 20.0, 30.0):  # the job hangs (the database does not answer): no second one piles up
        fleet.step(now)
    assert len(jobs.queued) == 1


def test_a_value_another_box_kept_is_proposed_first_and_says_the_fleet_proposed_it(tmp_path: Path) -> None:
    fleet, _, _, journal = rig(tmp_path, FakeStore())
    model = Proposal("max_num_seqs", 16, 8, PARAMS.replace(max_num_seqs=8), proposed_by="kv model",
                     arithmetic="KV cache ...")  # fmt: skip
    kept = FleetValue("max_num_seqs", 12, "gpu-b", "kept: +12% goodput")
    fleet.first = lambda key, proposal, tabu: kept  # type: ignore[method-assign]  # the snapshot's one value
    taken = fleet.take_first(KEY, model, {})
    assert (taken.new, taken.proposed_by, taken.arithmetic) == (12, "fleet", None)
    assert "fleet: kept: +12% goodput" in taken.notes
    (said,) = [r for r in events(journal) if r["event"] == "memory.from_fleet"]
    assert (said["taken"], said["new"], said["instead_of"], said["host"]) == (
        "first proposal",
        12,
        8,
        "gpu-b",
    )


def test_memory_show_says_where_each_entry_came_from() -> None:
    from tunerd.cli.memory import fleet_rows, render_fleet, source

    assert source(entry("a", 8, "revert", 1.0)) == "fleet a"
    here = Entry(KEY, "probe", {}, 1.0, "measured", {}, 1.0)
    assert source(here) == "local"
    assert source(Entry(KEY, "probe", {}, 1.0, "measured", {}, 1.0, origin="b.json")) == "import b.json"
    rows = fleet_rows((entry("a", 8, "revert", 1.0), entry("b", 12, "keep", 2.0, objective=3.0)))
    text = render_fleet("postgresql://t:***@db/t", rows, None)
    assert "from: fleet a 1, fleet b 1" in text
    assert "kept: max_num_seqs=12  (fleet b)" in text and "bad:  max_num_seqs=8  (a: trial revert" in text


def test_the_first_snapshot_is_journaled_even_when_empty(tmp_path: Path) -> None:
    fleet, _, jobs, journal = rig(tmp_path, FakeStore())
    fleet.step(0.0)
    jobs.run_all()
    fleet.step(1.0)
    snapshots = [r for r in events(journal) if r["event"] == "memory.fleet_snapshot"]
    assert [(r["entries"], r["hosts"]) for r in snapshots] == [(0, [])]


def test_the_boxs_name_is_the_config_s_then_the_environment_s_then_the_host_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    experience = Experience(tmp_path / "experience.json")
    journal = Journal(tmp_path / "journal.jsonl")
    journal.open()

    def host(memory: dict[str, Any]) -> str:
        config = make_config(tmp_path, tmp_path, {"memory": {"url": "postgresql://t@db/t", **memory}})
        recorder = Recorder(journal, Metrics())
        fleet = fleet_for(lambda: config, experience, recorder=recorder, submit=HeldJobs())
        assert fleet is not None
        return fleet.host

    monkeypatch.delenv(HOST_ENV, raising=False)
    assert host({}) == socket.gethostname()
    monkeypatch.setenv(HOST_ENV, "node-7")  # the Helm chart's: the node, not the pod
    assert host({}) == "node-7"
    assert host({"host": "spark-1"}) == "spark-1"
