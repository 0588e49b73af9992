"""The tuning memory (records/experience.py): keys, queries, upgrades, export/import, damaged files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tunerd.records.experience import (
    Experience,
    ExperienceFormatError,
    ExperienceKey,
    experience_path,
    hardware_key,
    model_key,
    workload_key,
)

H200 = hardware_key("NVIDIA H200", 143_771 * (1 << 20), False, "cuda")
KEY = ExperienceKey("3f9a", H200, "0.32.0", workload_key(128, 128, 4))
OTHER_LOAD = ExperienceKey("3f9a", H200, "0.32.0", workload_key(2048, 128, 32))
T0 = 1_800_000_000.0
TPUT = {"objective": "throughput.generation", "maximize": True}  # what `best` ranks by, in the tests
PROBE_TPUT = {
    "objective_name": "throughput.generation",
    "objective_unit": "tok/s",
    "objective_source": "probe",
}
LIVE_TPUT = {"objective_name": "throughput.generation", "objective_unit": "tok/s", "objective_source": "live"}


def base(**changes: Any) -> dict[str, Any]:
    return {"max_num_seqs": 16, "gpu_memory_utilization": 0.9, **changes}


def trial(
    memory: Experience,
    param: str,
    value: Any,
    objective: float | None,
    decision: str,
    at: float,
    key: ExperienceKey = KEY,
    **figures: Any,
) -> bool:
    return memory.record(
        key,
        base(**{param: value}),
        objective,
        kind="trial",
        decision=decision,
        figures={"param": param, **figures},
        at=at,
        **LIVE_TPUT,
    )


@pytest.fixture
def memory(tmp_path: Path) -> Experience:
    return Experience(experience_path(tmp_path / "state"))


# -- keys -------------------------------------------------------------------------------------------


def test_hardware_key() -> None:
    assert H200 == "cuda:NVIDIA H200:140GiB"
    assert hardware_key("NVIDIA GB10", None, True, "cuda") == "unified:NVIDIA GB10"
    assert hardware_key(None, None, False, "cpu") == "cpu"
    assert hardware_key(None, None, False, "cuda") == "cuda:unknown"


def test_workload_key_buckets_comparable_loads() -> None:
    assert workload_key(128, 128, 4) == "prompt~128 output~128 concurrency~4"
    assert workload_key(100, 120, 3.6) == workload_key(128, 128, 4) == workload_key(150, 140, 5)
    assert workload_key(90, 128, 4) != workload_key(100, 128, 4)  # 90 rounds to 64 in log scale
    assert workload_key(128, 128, 0.3) == "prompt~128 output~128 concurrency~1"
    assert workload_key(0, math.nan, -1) == "prompt~0 output~0 concurrency~0"


def test_key_text_and_model_key() -> None:
    assert KEY.text == "3f9a | cuda:NVIDIA H200:140GiB | vllm 0.32.0 | prompt~128 output~128 concurrency~4"
    assert str(ExperienceKey("m", "cpu", None, "w")) == "m | cpu | vllm unknown | w"
    assert model_key({"path": "/models/x", "fingerprint": "abc"}) == "abc"
    assert model_key({"id": "Qwen/Qwen3-8B"}) == "Qwen/Qwen3-8B"
    assert model_key({"path": "/models/x", "fingerprint": None}) == "/models/x"


# -- record and the file -----------------------------------------------------------------------------


def test_record_persists_in_a_plain_versioned_file(memory: Experience) -> None:
    assert memory.entries() == [] and memory.load_error is None
    assert trial(memory, "max_num_seqs", 32, 120.0, "keep", T0)
    assert memory.record(
        KEY, base(), 100.0, kind="probe", decision="baseline", figures={"ttft_p95": 0.2}, at=T0 + 1
    )
    text = memory.path.read_text()
    document = json.loads(text)
    assert (document["format"], document["version"]) == ("tunerd-experience", 1)
    assert [e["kind"] for e in document["entries"]] == ["trial", "probe"]
    lines = text.splitlines()
    assert len(lines) == 8  # 4 lines of header, one line per entry, 2 closing: diffable
    assert [json.loads(line.rstrip(","))["kind"] for line in lines[4:6]] == ["trial", "probe"]
    again = Experience(memory.path)
    assert [(e.kind, e.objective, e.params["max_num_seqs"]) for e in again.entries(KEY)] == [
        ("trial", 120.0, 32),
        ("probe", 100.0, 16),
    ]
    assert again.entries(OTHER_LOAD) == []


def test_record_cleans_values_for_json(memory: Experience) -> None:
    memory.record(
        KEY,
        base(),
        math.nan,
        kind="probe",
        decision="measured",
        figures={"x": math.inf, "pair": (1, 2)},
        at=T0,
    )
    (entry,) = Experience(memory.path).entries()
    assert entry.objective is None and entry.figures == {"x": None, "pair": [1, 2]}
    with pytest.raises(ValueError):
        memory.record(KEY, base(), 1.0, kind="guess", decision="x", figures={}, at=T0)  # type: ignore[arg-type]


def test_entries_capped(tmp_path: Path) -> None:
    memory = Experience(tmp_path / "e.json", max_entries=5)
    for i in range(8):
        trial(memory, "max_num_seqs", i, float(i), "keep", T0 + i)
    assert [e.params["max_num_seqs"] for e in Experience(tmp_path / "e.json").entries()] == [3, 4, 5, 6, 7]


def test_two_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    daemon, operator = Experience(path), Experience(path)
    trial(daemon, "max_num_seqs", 8, 90.0, "keep", T0)
    trial(operator, "max_num_seqs", 32, 95.0, "keep", T0 + 1)  # reads the daemon's entry first
    trial(daemon, "max_num_seqs", 64, None, "failed", T0 + 2)
    assert [e.params["max_num_seqs"] for e in Experience(path).entries()] == [8, 32, 64]
    assert [e.params["max_num_seqs"] for e in operator.entries()] == [8, 32, 64]  # re-read on change


def test_missing_file_is_empty(tmp_path: Path) -> None:
    memory = Experience(tmp_path / "nothing" / "experience.json")
    assert memory.entries() == [] and memory.best(KEY, **TPUT) is None and memory.load_error is None


def test_damaged_file_reads_as_empty_and_is_kept_aside(tmp_path: Path) -> None:
    path = tmp_path / "experience.json"
    path.write_text('{"format": "tunerd-experience", "version": 1, "entries": [')
    memory = Experience(path)
    assert memory.entries() == [] and "not JSON" in (memory.load_error or "")
    assert trial(memory, "max_num_seqs", 8, 90.0, "keep", T0)
    assert (tmp_path / "experience.json.damaged").read_text().endswith('"entries": [')
    assert len(Experience(path).entries()) == 1 and Experience(path).load_error is None


def test_damaged_entries_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "experience.json"
    trial(Experience(path), "max_num_seqs", 8, 90.0, "keep", T0)
    document = json.loads(path.read_text())
    document["entries"].append({"kind": "trial"})
    path.write_text(json.dumps(document))
    memory = Experience(path)
    assert len(memory.entries()) == 1
    assert "1 damaged entries skipped" in (memory.load_error or "")


def test_unwritable_file_never_raises(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("")
    memory = Experience(tmp_path / "plain" / "experience.json")  # its directory is a file
    assert not trial(memory, "max_num_seqs", 8, 90.0, "keep", T0)
    assert memory.save_error and len(memory.entries()) == 1  # kept in memory, written with the next


# -- queries ------------------------------------------------------------------------------------------


def test_best_is_the_best_verified_acceptable_objective(memory: Experience) -> None:
    trial(memory, "max_num_seqs", 8, 90.0, "keep", T0)
    trial(memory, "max_num_seqs", 32, 130.0, "keep", T0 + 1)
    trial(memory, "max_num_seqs", 64, 150.0, "revert", T0 + 2)  # lost (a limit broke): not a candidate
    trial(memory, "max_num_seqs", 128, None, "failed", T0 + 3)
    trial(memory, "max_num_seqs", 4, 200.0, "keep", T0 + 4, key=OTHER_LOAD)
    assert memory.best(KEY, **TPUT) == base(max_num_seqs=32)
    assert memory.best(KEY, objective="throughput.generation", maximize=False) == base(max_num_seqs=8)
    assert memory.best(KEY, objective="itl.p95", maximize=False) is None  # no value of it
    assert memory.best(OTHER_LOAD, **TPUT) == base(max_num_seqs=4)
    assert memory.best(ExperienceKey("other", H200, "0.32.0", KEY.workload), **TPUT) is None


def test_best_across_vllm_versions_only_when_asked(memory: Experience) -> None:
    old = ExperienceKey(KEY.model, KEY.hardware, "0.31.0", KEY.workload)
    trial(memory, "max_num_seqs", 32, 130.0, "keep", T0, key=old)
    assert memory.best(KEY, **TPUT) is None
    assert memory.best(KEY, any_vllm=True, **TPUT) == base(max_num_seqs=32)


def test_bad_values(memory: Experience) -> None:
    trial(memory, "max_num_seqs", 64, 80.0, "revert", T0, reason="throughput 20 % lower")
    trial(memory, "max_num_seqs", 128, None, "failed", T0 + 1, reason="out_of_memory")
    trial(memory, "gpu_memory_utilization", 0.95, None, "failed", T0 + 2)
    trial(memory, "gpu_memory_utilization", 0.95, 120.0, "keep", T0 + 3)  # good again: not bad now
    trial(memory, "max_num_seqs", 32, 130.0, "keep", T0 + 4)
    memory.record(KEY, base(), None, kind="probe", decision="measured", figures={}, at=T0 + 5)
    memory.record(KEY, base(max_num_seqs=256), None, kind="trial", decision="failed", figures={}, at=T0 + 6)
    assert memory.bad_values(KEY) == [
        ("max_num_seqs", 64, "trial revert: throughput 20 % lower"),
        ("max_num_seqs", 128, "trial failed: out_of_memory"),
    ]
    assert memory.bad_values(OTHER_LOAD) == []


def test_measured_points_of_one_parameter(memory: Experience) -> None:
    for value, objective, decision in ((8, 90.0, "measured"), (16, 110.0, "measured"), (64, None, "failed")):
        memory.record(
            KEY,
            base(max_num_seqs=value),
            objective,
            kind="explore",
            decision=decision,
            figures={"param": "max_num_seqs"},
            at=T0 + value,
            **PROBE_TPUT,
        )
    memory.record(
        KEY,
        base(max_num_seqs=8),
        95.0,
        kind="explore",
        decision="measured",
        figures={},
        at=T0 + 99,
        **PROBE_TPUT,
    )
    memory.record(
        KEY,
        base(max_num_seqs=32, gpu_memory_utilization=0.8),
        140.0,
        kind="explore",
        decision="measured",
        figures={},
        at=T0 + 100,
        **PROBE_TPUT,
    )
    others = {"gpu_memory_utilization": 0.9}
    probe = {"objective": "throughput.generation", "source": "probe"}
    assert memory.measured(KEY, "max_num_seqs", others, **probe) == {8: 95.0, 16: 110.0, 64: None}
    assert memory.measured(KEY, "max_num_seqs", {"gpu_memory_utilization": 0.8}, **probe) == {32: 140.0}
    assert memory.measured(KEY, "max_num_seqs", others, kinds=("trial",), **probe) == {}
    assert memory.measured(OTHER_LOAD, "max_num_seqs", others, **probe) == {}
    # A live search's points are other figures: the probe's are not known to it, nor its to the probe's.
    live = {"objective": "throughput.generation", "source": "live"}
    assert memory.measured(KEY, "max_num_seqs", others, **live) == {64: None}  # infeasible is infeasible


# -- upgrades ---------------------------------------------------------------------------------------


def test_mark_unverified_after_a_vllm_upgrade(memory: Experience) -> None:
    old = ExperienceKey(KEY.model, KEY.hardware, "0.31.0", KEY.workload)
    trial(memory, "max_num_seqs", 32, 130.0, "keep", T0, key=old)
    trial(memory, "max_num_seqs", 64, None, "failed", T0 + 1, key=old)
    trial(memory, "max_num_seqs", 16, 100.0, "keep", T0 + 2)  # already measured on 0.32.0
    assert memory.mark_unverified("vLLM 0.31.0 → 0.32.0", vllm="0.32.0") == 2
    again = Experience(memory.path)
    assert [e.verified for e in again.entries()] == [False, False, True]
    assert again.entries()[0].unverified == "vLLM 0.31.0 → 0.32.0"
    assert again.best(old, **TPUT) is None and again.bad_values(old) == []  # hints, not truth
    assert again.best(old, include_unverified=True, **TPUT) == base(max_num_seqs=32)
    assert again.bad_values(old, include_unverified=True)[0][:2] == ("max_num_seqs", 64)
    assert again.mark_unverified("again", vllm="0.32.0") == 0  # already flagged


def test_mark_unverified_after_a_driver_upgrade(memory: Experience) -> None:
    trial(memory, "max_num_seqs", 32, 130.0, "keep", T0, driver="570.1")
    trial(memory, "max_num_seqs", 16, 100.0, "keep", T0 + 1, driver="580.2")
    trial(memory, "max_num_seqs", 8, 90.0, "keep", T0 + 2)  # no driver recorded: can't tell
    assert memory.mark_unverified("driver 570.1 → 580.2", driver="580.2") == 2
    assert [e.verified for e in memory.entries()] == [False, True, False]
    assert memory.best(KEY, **TPUT) == base(max_num_seqs=16)
    assert memory.mark_unverified("everything") == 1


# -- export and import ---------------------------------------------------------------------------------


def test_export_then_import_merges_without_duplicates(tmp_path: Path) -> None:
    here, there = Experience(tmp_path / "here.json"), Experience(tmp_path / "there.json")
    trial(here, "max_num_seqs", 32, 130.0, "keep", T0 + 10)
    trial(here, "max_num_seqs", 64, None, "failed", T0 + 20)
    trial(there, "max_num_seqs", 8, 90.0, "keep", T0 + 15)
    assert here.export(tmp_path / "carry.json") == 2
    report = there.import_(tmp_path / "carry.json")
    assert (report.added, report.duplicates, report.total, report.dropped) == (2, 0, 3, 0)
    assert [e.at for e in there.entries()] == [T0 + 10, T0 + 15, T0 + 20]  # by time
    assert [e.origin for e in there.entries()] == ["carry.json", None, "carry.json"]
    again = there.import_(tmp_path / "carry.json")
    assert (again.added, again.duplicates, again.total) == (0, 2, 3)
    assert Experience(tmp_path / "there.json").best(KEY, **TPUT) == base(max_num_seqs=32)
    assert Experience(tmp_path / "there.json").bad_values(KEY)[0][:2] == ("max_num_seqs", 64)


def test_import_keeps_the_cap(tmp_path: Path) -> None:
    source = Experience(tmp_path / "source.json")
    for i in range(4):
        trial(source, "max_num_seqs", i, float(i), "keep", T0 + i)
    target = Experience(tmp_path / "target.json", max_entries=3)
    report = target.import_(source.path)
    assert (report.added, report.total, report.dropped) == (4, 3, 1)


def test_import_refuses_another_format_version(tmp_path: Path, memory: Experience) -> None:
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"format": "tunerd-experience", "version": 2, "entries": []}))
    with pytest.raises(ExperienceFormatError, match="format version 2, this tunerd reads version 1 only"):
        memory.import_(future)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"entries": []}))
    with pytest.raises(ExperienceFormatError, match="not a tunerd memory file"):
        memory.import_(other)
    with pytest.raises(FileNotFoundError):
        memory.import_(tmp_path / "absent.json")
    assert not memory.path.exists()  # nothing changed


def test_text_is_the_export(memory: Experience, tmp_path: Path) -> None:
    trial(memory, "max_num_seqs", 32, 130.0, "keep", T0)
    memory.export(tmp_path / "out.json")
    assert memory.text() == (tmp_path / "out.json").read_text()


# -- the objective of a value ------------------------------------------------------------------------


def test_an_entry_names_its_objective_unit_and_source(memory: Experience) -> None:
    # Issue 20: a trial decided on ITL p95 stored seconds where other entries stored tok/s.
    itl = {"objective_name": "itl.p95", "objective_unit": "s", "objective_source": "live"}
    memory.record(KEY, base(max_num_seqs=8), 0.031, kind="trial", decision="keep", figures={}, at=T0, **itl)
    memory.record(
        KEY, base(max_num_seqs=4), 0.012, kind="trial", decision="keep", figures={}, at=T0 + 1, **itl
    )
    trial(memory, "max_num_seqs", 32, 130.0, "keep", T0 + 2)
    line = json.loads(memory.path.read_text())["entries"][0]
    assert (line["objective_name"], line["objective_unit"], line["objective_source"]) == (
        "itl.p95",
        "s",
        "live",
    )
    again = Experience(memory.path)
    assert again.objectives(KEY) == ["itl.p95", "throughput.generation"]
    # Seconds and tokens per second never compare: each objective ranks its own values, its own way.
    assert again.best(KEY, objective="itl.p95", maximize=False) == base(max_num_seqs=4)
    assert again.best(KEY, **TPUT) == base(max_num_seqs=32)
    assert again.best(KEY, objective="throughput.generation", maximize=True, source="probe") is None


def test_entries_of_an_older_tunerd_still_read(tmp_path: Path) -> None:
    path = tmp_path / "experience.json"
    key = {"model": KEY.model, "hardware": KEY.hardware, "vllm": KEY.vllm, "workload": KEY.workload}
    old = [
        {"at": T0, "decision": "measured", "figures": {}, "key": key, "kind": "probe",
         "objective": 900.0, "params": base(max_num_seqs=8)},
        {"at": T0 + 1, "decision": "measured", "figures": {"param": "max_num_seqs"}, "key": key,
         "kind": "explore", "objective": 950.0, "params": base(max_num_seqs=16)},
        {"at": T0 + 2, "decision": "keep", "figures": {"param": "max_num_seqs"}, "key": key,
         "kind": "trial", "objective": 0.012, "params": base(max_num_seqs=4)},
    ]  # fmt: skip
    lines = ",\n".join(f"  {json.dumps(entry, sort_keys=True)}" for entry in old)
    path.write_text(f'{{\n "format": "tunerd-experience",\n "version": 1,\n "entries": [\n{lines}\n ]\n}}\n')
    memory = Experience(path)
    assert memory.load_error is None
    probe, explore, old_trial = memory.entries()
    # A probe's value was always its generation throughput; an exploration point's too, from a source
    # not recorded; a trial's could be either, so it names none and is not ranked.
    assert (probe.objective_name, probe.objective_unit, probe.objective_source) == (
        "throughput.generation",
        "tok/s",
        "probe",
    )
    assert (explore.objective_name, explore.objective_source) == ("throughput.generation", None)
    assert (old_trial.objective_name, old_trial.objective_unit, old_trial.objective) == (None, None, 0.012)
    assert memory.objectives(KEY) == ["throughput.generation"]
    assert memory.best(KEY, **TPUT) == base(max_num_seqs=16)
    assert memory.best(KEY, objective="throughput.generation", maximize=True, source="probe") == base(
        max_num_seqs=8
    )
    assert memory.bad_values(KEY) == []
    # Written again (a new entry), the old ones keep their values and gain what is known of them.
    trial(memory, "max_num_seqs", 32, 130.0, "keep", T0 + 3)
    assert [e.objective for e in Experience(path).entries()] == [900.0, 950.0, 0.012, 130.0]
