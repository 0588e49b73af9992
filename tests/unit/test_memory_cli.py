"""`tunerd memory show|export|import` (cli/memory.py), called with an argparse Namespace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tunerd.cli import memory as cli
from tunerd.records.experience import Experience, ExperienceKey, experience_path, workload_key

KEY = ExperienceKey("3f9a", "cuda:NVIDIA H200:140GiB", "0.32.0", workload_key(128, 128, 4))
T0 = 1_800_000_000.0


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "tunerd.toml"
    path.write_text(f'[engine]\nmodel = "/models/x"\n\n[paths]\nstate_dir = "{tmp_path / "state"}"\n')
    return path


def live(tmp_path: Path) -> Experience:
    return Experience(experience_path(tmp_path / "state"))


PROBE = {"objective_name": "throughput.generation", "objective_unit": "tok/s", "objective_source": "probe"}
LIVE = {"objective_name": "throughput.generation", "objective_unit": "tok/s", "objective_source": "live"}


def fill(memory: Experience) -> None:
    params = {"max_num_seqs": 16, "gpu_memory_utilization": 0.9}
    memory.record(KEY, params, 100.0, kind="probe", decision="baseline", figures={}, at=T0, **PROBE)
    memory.record(
        KEY,
        {**params, "max_num_seqs": 32},
        130.0,
        kind="trial",
        decision="keep",
        figures={"param": "max_num_seqs"},
        at=T0 + 60,
        **LIVE,
    )
    memory.record(
        KEY,
        {**params, "max_num_seqs": 128},
        None,
        kind="trial",
        decision="failed",
        figures={"param": "max_num_seqs", "reason": "out_of_memory"},
        at=T0 + 120,
    )


def ns(config: Path | str, **more: object) -> argparse.Namespace:
    return argparse.Namespace(config=str(config), **more)


def test_show_empty(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.cmd_memory_show(ns(config, json=False)) == 0
    out = capsys.readouterr().out
    assert "0 entries" in out and "nothing measured yet" in out


def test_show_best_and_bad_values(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(live(tmp_path))
    assert cli.cmd_memory_show(ns(config, json=False)) == 0
    out = capsys.readouterr().out
    assert KEY.text in out
    assert "best: gpu_memory_utilization=0.9 max_num_seqs=32  (throughput.generation 130 tok/s, live;" in out
    assert "bad:  max_num_seqs=128  (trial failed: out_of_memory)" in out


def test_show_json(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(live(tmp_path))
    assert cli.cmd_memory_show(ns(config, json=True)) == 0
    document = json.loads(capsys.readouterr().out)
    (row,) = document["keys"]
    assert row["key"]["vllm"] == "0.32.0" and row["entries"] == 3 and row["unverified"] == 0
    (best,) = row["best"]
    assert best["params"]["max_num_seqs"] == 32 and best["objective"] == 130.0
    assert (best["objective_name"], best["objective_unit"], best["objective_source"]) == (
        "throughput.generation",
        "tok/s",
        "live",
    )
    assert row["bad_values"] == [
        {"param": "max_num_seqs", "value": 128, "why": "trial failed: out_of_memory"}
    ]


def test_show_ranks_each_objective_in_its_own_direction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 20: with `objective = "ttft.p95"` the ranking took the lowest value as the best, of probe
    # throughputs too: the slowest configuration was shown as the best one.
    config = tmp_path / "tunerd.toml"
    config.write_text(
        f'[engine]\nmodel = "/models/x"\n\n[paths]\nstate_dir = "{tmp_path / "state"}"\n\n'
        '[tuning]\nobjective = "ttft.p95"\n'
    )
    memory = live(tmp_path)
    for seqs, tokens_per_s in ((8, 900.0), (16, 1500.0), (64, 600.0)):
        memory.record(KEY, {"max_num_seqs": seqs}, tokens_per_s, kind="probe", decision="measured",
                      figures={}, at=T0 + seqs, **PROBE)  # fmt: skip
    ttft = {"objective_name": "ttft.p95", "objective_unit": "s", "objective_source": "live"}
    for seqs, seconds in ((8, 0.2), (16, 0.4)):
        memory.record(KEY, {"max_num_seqs": seqs}, seconds, kind="trial", decision="keep",
                      figures={"param": "max_num_seqs"}, at=T0 + 100 + seqs, **ttft)  # fmt: skip
    assert cli.cmd_memory_show(ns(config, json=True)) == 0
    (row,) = json.loads(capsys.readouterr().out)["keys"]
    best = {b["objective_name"]: (b["params"]["max_num_seqs"], b["objective"]) for b in row["best"]}
    assert best == {"ttft.p95": (8, 0.2), "throughput.generation": (16, 1500.0)}
    assert row["best"][0]["objective_name"] == "ttft.p95"  # the configured objective first
    assert cli.cmd_memory_show(ns(config, json=False)) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs=16  (throughput.generation 1500 tok/s, probe;" in out
    assert "max_num_seqs=8  (ttft.p95 0.2 s, live;" in out


def test_show_reads_entries_of_an_older_tunerd(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Written before entries named their objective: a probe's value was its throughput; a trial's may
    # be tok/s or seconds, so it is counted but not ranked.
    path = experience_path(tmp_path / "state")
    path.parent.mkdir()
    key = {"model": KEY.model, "hardware": KEY.hardware, "vllm": KEY.vllm, "workload": KEY.workload}
    old = [
        {"at": T0, "decision": "measured", "figures": {}, "key": key, "kind": "probe",
         "objective": 900.0, "params": {"max_num_seqs": 8}},
        {"at": T0 + 1, "decision": "keep", "figures": {"param": "max_num_seqs"}, "key": key,
         "kind": "trial", "objective": 0.012, "params": {"max_num_seqs": 4}},
    ]  # fmt: skip
    lines = ",\n".join(f"  {json.dumps(entry, sort_keys=True)}" for entry in old)
    path.write_text(f'{{\n "format": "tunerd-experience",\n "version": 1,\n "entries": [\n{lines}\n ]\n}}\n')
    assert cli.cmd_memory_show(ns(config, json=True)) == 0
    (row,) = json.loads(capsys.readouterr().out)["keys"]
    assert row["entries"] == 2
    (best,) = row["best"]
    assert (best["objective_name"], best["objective_source"], best["objective"]) == (
        "throughput.generation",
        "probe",
        900.0,
    )


def test_show_damaged_memory_says_so(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = experience_path(tmp_path / "state")
    path.parent.mkdir()
    path.write_text("garbage")
    assert cli.cmd_memory_show(ns(config, json=False)) == 1
    captured = capsys.readouterr()
    assert "not a tunerd memory file" in captured.err and "0 entries" in captured.out
    assert path.read_text() == "garbage"  # showing changes nothing


def test_export_and_import(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(live(tmp_path))
    carry = tmp_path / "carry.json"
    assert cli.cmd_memory_export(ns(config, file=str(carry))) == 0
    assert "3 entries written" in capsys.readouterr().out
    other = tmp_path / "other"
    other.mkdir()
    config_b = other / "tunerd.toml"
    config_b.write_text(f'[engine]\nmodel = "/models/x"\n\n[paths]\nstate_dir = "{other / "state"}"\n')
    assert cli.cmd_memory_import(ns(config_b, file=str(carry))) == 0
    assert "3 entries added, 0 already known; 3 in" in capsys.readouterr().out
    assert cli.cmd_memory_import(ns(config_b, file=str(carry))) == 0
    assert "0 entries added, 3 already known" in capsys.readouterr().out
    assert Experience(experience_path(other / "state")).best(
        KEY, objective="throughput.generation", maximize=True
    ) == {
        "max_num_seqs": 32,
        "gpu_memory_utilization": 0.9,
    }


def test_export_to_stdout(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(live(tmp_path))
    assert cli.cmd_memory_export(ns(config, file="-")) == 0
    assert len(json.loads(capsys.readouterr().out)["entries"]) == 3


def test_import_refuses_another_version(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"format": "tunerd-experience", "version": 9, "entries": []}))
    assert cli.cmd_memory_import(ns(config, file=str(future))) == 1
    err = capsys.readouterr().err
    assert "format version 9, this tunerd reads version 1 only" in err and "Traceback" not in err


def test_import_missing_file(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.cmd_memory_import(ns(config, file=str(tmp_path / "absent.json"))) == 1
    assert "absent.json: No such file or directory" in capsys.readouterr().err


def test_export_unwritable(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "plain").write_text("")
    assert cli.cmd_memory_export(ns(config, file=str(tmp_path / "plain" / "out.json"))) == 1
    assert "tunerd memory export:" in capsys.readouterr().err


def test_bad_config_exits_78(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\n")
    assert cli.cmd_memory_show(ns(bad, json=False)) == 78
    assert "engine" in capsys.readouterr().err
    assert cli.cmd_memory_import(ns(tmp_path / "absent.toml", file="x")) == 78


def test_commands_registered(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tunerd")
    sub = parser.add_subparsers()

    def config_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("-c", "--config", default=None)

    cli.add_commands(sub, config_option)
    args = parser.parse_args(["memory", "show", "--json", "-c", str(config)])
    assert args.func is cli.cmd_memory_show and args.json
    assert parser.parse_args(["memory", "export", "f"]).func is cli.cmd_memory_export
    assert parser.parse_args(["memory", "import", "f"]).func is cli.cmd_memory_import
    assert parser.parse_args(["memory"]).func(None) == 2  # no action: usage
