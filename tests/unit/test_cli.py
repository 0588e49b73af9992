"""The command line: check-config's exit status and messages, journal printing, restart's --set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunerd.cli.main import main, parse_assignment

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "tunerd" / "tunerd.toml"


def test_check_config_of_the_shipped_file_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(SHIPPED)]) == 0
    rules = SHIPPED.parent / "rules.toml"  # the playbook beside it is checked too
    assert capsys.readouterr().out.strip().splitlines() == [f"{SHIPPED}: ok", f"{rules}: ok (8 rules)"]


def test_check_config_names_the_rule_and_key_of_a_bad_rules_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tunerd.toml"
    config.write_text('[engine]\nmodel = "/m"\n')
    (tmp_path / "rules.toml").write_text(
        '[[rule]]\nname = "kv"\nall = ["nope.signal > 1", "kv_cache.usage > high"]\n'
        'action = { kind = "step", param = "max_num_seqs", direction = "down", factor = 0.5 }\n'
    )
    assert main(["check-config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'rules.toml'}: rule kv: all: unknown signal 'nope.signal'" in err
    assert main(["run", "--config", str(config)]) == 78  # and `tunerd run` refuses to start


def test_check_config_with_a_misspelled_key_exits_1_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "tunerd.toml"
    bad.write_text(SHIPPED.read_text().replace("graceful_stop_s = 30.0", "graceful_stop_sec = 30.0"))
    assert main(["check-config", str(bad)]) == 1
    assert f"{bad}: timeouts.graceful_stop_sec: unknown key" in capsys.readouterr().err


def test_check_config_with_a_negative_timeout_exits_1_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "tunerd.toml"
    bad.write_text(SHIPPED.read_text().replace("startup_s = 900.0", "startup_s = -5.0"))
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: timeouts.startup_s: Input should be greater than 0 (got -5.0)" in err
    assert "Traceback" not in err


def test_check_config_reads_tunerd_config_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TUNERD_CONFIG", str(tmp_path / "missing.toml"))
    assert main(["check-config"]) == 1
    assert "missing.toml: (file): cannot read" in capsys.readouterr().err


def test_journal_prints_records_for_humans_and_raw(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "journal.jsonl"
    records = [
        {"seq": 1, "time": "2026-11-30T12:00:00.000Z", "event": "daemon.started", "version": "0.1.0"},
        {"seq": 2, "time": "2026-11-30T12:00:01.000Z", "event": "intent", "action": "start"},
    ]
    journal.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    assert main(["journal", "--file", str(journal)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2026-11-30 12:00:00.000Z  #1") and "daemon.started" in out[0]
    assert main(["journal", "--file", str(journal), "--json", "-n", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == records[1]
    assert main(["journal", "--file", str(journal), "--since", "yesterday-ish"]) == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_num_seqs=8", ("max_num_seqs", 8)),
        ("gpu_memory_utilization=0.8", ("gpu_memory_utilization", 0.8)),
        ("enable_prefix_caching=false", ("enable_prefix_caching", False)),
        ("kv_cache_dtype=fp8", ("kv_cache_dtype", "fp8")),
        ("max_model_len=none", ("max_model_len", None)),
    ],
)
def test_restart_set_values_are_typed(text: str, expected: tuple[str, object]) -> None:
    assert parse_assignment(text) == expected


def test_restart_without_a_daemon_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tunerd.toml"
    config.write_text(f'[engine]\nmodel = "m"\n[export]\nport = 1\n[paths]\nstate_dir = "{tmp_path}"\n')
    assert main(["restart", "--set", "max_num_seqs=8", "--config", str(config)]) == 3
    assert "cannot reach the daemon" in capsys.readouterr().err


def test_no_module_of_the_cli_imports_main_back() -> None:
    # main imports every subcommand module; one that took main's helpers back made an import circle
    # (door, probe and tuning did, with imports hidden in functions). They share `cli.common` instead.
    import ast

    import tunerd.cli

    circle = []
    for source in sorted(Path(tunerd.cli.__file__).parent.glob("*.py")):
        if source.name in ("__init__.py", "main.py"):  # the package re-exports `main`: the entry point
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "tunerd.cli.main":
                circle.append(f"{source.name}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module == "tunerd.cli":
                circle += [f"{source.name}:{node.lineno}" for alias in node.names if alias.name == "main"]
            elif isinstance(node, ast.Import):
                circle += [f"{source.name}:{node.lineno}" for a in node.names if a.name == "tunerd.cli.main"]
    assert circle == []


def test_cache_reset_answers_say_what_vllm_did_and_exit_0_only_when_it_reset() -> None:
    from tunerd.cli.probe import cache_reset_answer

    done = {"event": "cache_reset.done", "attempts": 3, "seconds": 0.41, "before": {"kv_cache.usage": 0.4},
            "after": {"kv_cache.usage": 0.0}}  # fmt: skip
    assert cache_reset_answer(done) == ("cache reset: done (3 attempts, 0.41 s); kv_cache.usage 0.4 → 0.0", 0)
    skipped = {"event": "cache_reset.skipped", "reason": "vLLM is not idle"}
    assert cache_reset_answer(skipped) == ("tunerd cache-reset: it did not run: vLLM is not idle", 1)
    failed = {"event": "cache_reset.failed", "attempts": 6, "detail": "HTTP 200; gave up after 6 attempts"}
    assert cache_reset_answer(failed)[1] == 1 and "failed after 6 attempts" in cache_reset_answer(failed)[0]
