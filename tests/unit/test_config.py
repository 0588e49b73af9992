"""Config loading: every problem as `file: key: reason`, several at once; defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.config import Config, ConfigError, EngineConfig, load_config, parse_config
from tunerd.core.params import EngineParams

MINIMAL = '[engine]\nmodel = "/models/qwen3-tiny"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tunerd.toml"
    path.write_text(text)
    return path


def problems_of(tmp_path: Path, text: str) -> tuple[str, list[str]]:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(path), info.value.problems


def test_minimal_config_loads_with_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    assert isinstance(config, Config)
    assert config.engine.model == "/models/qwen3-tiny"
    assert config.engine.host == "127.0.0.1"
    assert config.engine.port == 8000
    assert config.engine.command == ["vllm", "serve"]
    assert config.engine.params == EngineParams()
    assert config.export.host == "127.0.0.1"
    assert config.timeouts.startup_s == 900.0
    assert config.backoff.initial_s == 10.0
    assert config.backoff.max_s == 300.0


def test_journal_and_state_default_to_files_under_state_dir(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL + '[paths]\nstate_dir = "/srv/tunerd"\n'))
    assert config.paths.journal_path == Path("/srv/tunerd/journal.jsonl")
    assert config.paths.state_file == Path("/srv/tunerd/state.json")
    assert config.paths.engine_log_dir == Path("/srv/tunerd/engine-logs")


def test_explicit_journal_path_wins_over_state_dir(tmp_path: Path) -> None:
    text = MINIMAL + '[paths]\nstate_dir = "/srv/tunerd"\njournal = "/var/log/tunerd.jsonl"\n'
    assert load_config(write(tmp_path, text)).paths.journal_path == Path("/var/log/tunerd.jsonl")


def test_engine_params_are_read_from_their_table(tmp_path: Path) -> None:
    text = MINIMAL + "[engine.params]\nmax_model_len = 512\nblock_size = 32\n"
    params = load_config(write(tmp_path, text)).engine.params
    assert params == EngineParams(max_model_len=512, block_size=32)


def test_misspelled_key_is_an_unknown_key(tmp_path: Path) -> None:
    name, problems = problems_of(tmp_path, MINIMAL + "[engine.prams]\nmax_model_len = 512\n")
    assert problems == [f"{name}: engine.prams: unknown key"]


def test_unknown_top_level_section_is_named(tmp_path: Path) -> None:
    name, problems = problems_of(tmp_path, MINIMAL + "[tunning]\nx = 1\n")
    assert problems == [f"{name}: tunning: unknown key"]


def test_negative_timeout_names_the_key_and_the_value(tmp_path: Path) -> None:
    name, problems = problems_of(tmp_path, MINIMAL + "[timeouts]\nstartup_s = -5\n")
    assert len(problems) == 1
    assert problems[0].startswith(f"{name}: timeouts.startup_s: ")
    assert "greater than 0" in problems[0]
    assert "-5" in problems[0]


def test_missing_engine_model_is_reported(tmp_path: Path) -> None:
    name, problems = problems_of(tmp_path, '[engine]\nhost = "127.0.0.1"\n')
    assert problems == [f"{name}: engine.model: required key is missing"]


def test_missing_engine_section_is_reported(tmp_path: Path) -> None:
    name, problems = problems_of(tmp_path, "[timeouts]\nstartup_s = 60\n")
    assert problems == [f"{name}: engine: required key is missing"]


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_port_out_of_range_is_reported(tmp_path: Path, port: int) -> None:
    name, problems = problems_of(tmp_path, MINIMAL + f"port = {port}\n")
    assert len(problems) == 1
    assert problems[0].startswith(f"{name}: engine.port: ")
    assert f"(got {port})" in problems[0]


def test_export_port_out_of_range_is_reported(tmp_path: Path) -> None:
    name, problems = problems_of(tmp_path, MINIMAL + "[export]\nport = 70000\n")
    assert problems[0].startswith(f"{name}: export.port: ")


def test_backoff_max_below_initial_is_reported(tmp_path: Path) -> None:
    name, problems = problems_of(tmp_path, MINIMAL + "[backoff]\ninitial_s = 60\nmax_s = 30\n")
    assert len(problems) == 1
    assert problems[0].startswith(f"{name}: backoff")
    assert "max_s" in problems[0]
    assert "initial_s" in problems[0]


@pytest.mark.parametrize(
    "extra",
    [
        ["--max-model-len", "512"],
        ["--max-model-len=512"],
        ["--gpu-memory-utilization", "0.5"],
        ["--enable-prefix-caching"],
        ["--port", "9000"],
        ["--model", "/models/other"],
    ],
)
def test_managed_flag_in_extra_args_is_rejected_as_managed(tmp_path: Path, extra: list[str]) -> None:
    args = ", ".join(f'"{a}"' for a in extra)
    name, problems = problems_of(tmp_path, MINIMAL + f"extra_args = [{args}]\n")
    flag = extra[0].split("=", 1)[0]
    assert len(problems) == 1
    assert problems[0].startswith(f"{name}: engine.extra_args: {flag} ")
    assert "managed by tunerd" in problems[0]


def test_negated_managed_boolean_flag_in_extra_args_is_rejected_as_managed(tmp_path: Path) -> None:
    # to_argv writes `--no-enable-prefix-caching`; the same flag in extra_args (placed after the
    # params) would silently override what the tuner set.
    name, problems = problems_of(tmp_path, MINIMAL + 'extra_args = ["--no-enable-prefix-caching"]\n')
    assert len(problems) == 1
    assert problems[0].startswith(f"{name}: engine.extra_args: ")
    assert "managed by tunerd" in problems[0]


def test_underscore_spelling_of_managed_flag_in_extra_args_is_rejected_as_managed(tmp_path: Path) -> None:
    # vLLM's FlexibleArgumentParser turns `--max_model_len` into `--max-model-len`.
    name, problems = problems_of(tmp_path, MINIMAL + 'extra_args = ["--max_model_len=512"]\n')
    assert len(problems) == 1
    assert problems[0].startswith(f"{name}: engine.extra_args: ")
    assert "managed by tunerd" in problems[0]


def test_unmanaged_extra_args_pass_through(tmp_path: Path) -> None:
    text = MINIMAL + 'extra_args = ["--enforce-eager", "--served-model-name", "tiny"]\n'
    config = load_config(write(tmp_path, text))
    assert config.engine.extra_args == ["--enforce-eager", "--served-model-name", "tiny"]


def test_toml_syntax_error_names_file_and_syntax(tmp_path: Path) -> None:
    name, problems = problems_of(tmp_path, '[engine]\nmodel = "unterminated\n')
    assert len(problems) == 1
    assert problems[0].startswith(f"{name}: (syntax): ")


def test_missing_file_is_reported_as_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"{path}: (file): cannot read: No such file or directory"]


def test_unreadable_file_is_reported_with_the_os_reason(tmp_path: Path) -> None:
    # A directory cannot be read as a file, whoever runs the test (root ignores file modes).
    path = tmp_path / "a-directory.toml"
    path.mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"{path}: (file): cannot read: Is a directory"]


def test_several_problems_are_reported_together(tmp_path: Path) -> None:
    text = (
        '[engine]\nport = 0\nextra_args = ["--block-size", "16"]\n'
        "[engine.prams]\n"
        "[timeouts]\nstartup_s = -1\n"
        "[backoff]\ninitial_s = 100\nmax_s = 10\n"
    )
    name, problems = problems_of(tmp_path, text)
    keys = sorted(line.split(": ")[1] for line in problems)
    assert keys == sorted(
        ["engine.model", "engine.port", "engine.extra_args", "engine.prams", "timeouts.startup_s", "backoff"]
    )
    assert all(line.startswith(f"{name}: ") for line in problems)


def test_config_error_message_joins_all_problems() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"engine": {"port": 0}}, "x.toml")
    assert str(info.value) == "\n".join(info.value.problems)
    assert len(info.value.problems) == 2


def test_parse_config_names_a_placeholder_when_no_file_is_given() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({})
    assert info.value.problems == ["<config>: engine: required key is missing"]


def test_engine_params_out_of_range_name_the_nested_key() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"engine": {"model": "m", "params": {"gpu_memory_utilization": 1.5}}}, "t.toml")
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("t.toml: engine.params.gpu_memory_utilization: ")


def test_empty_command_program_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"engine": {"model": "m", "command": [" ", "serve"]}}, "t.toml")
    assert info.value.problems == ["t.toml: engine.command: the first element must name a program"]


def _problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "t.toml")
    return caught.value.problems


def test_the_door_needs_a_port_of_its_own_and_vllm_on_loopback() -> None:
    engine = {"model": "/m", "port": 8000}
    (problem,) = _problems({"engine": engine, "door": {"enabled": True, "port": 8000}})
    assert problem.startswith("t.toml: (top level): door: port 8000 is also engine.port")
    (problem,) = _problems(
        {"engine": {**engine, "host": "0.0.0.0", "port": 18000}, "door": {"enabled": True}}
    )
    assert "door: engine.host '0.0.0.0' is not loopback" in problem
    config = parse_config({"engine": {**engine, "port": 18000}, "door": {"enabled": True}})
    assert config.door.enabled and config.door.port == 8000
    assert not parse_config({"engine": engine}).door.enabled  # off unless the config turns it on


def test_vllm_and_the_metrics_export_need_ports_of_their_own() -> None:
    (problem,) = _problems({"engine": {"model": "/m", "port": 9464}})
    assert problem.startswith("t.toml: (top level): export: port 9464 is also engine.port")


def test_a_probe_longer_than_the_context_is_refused_at_load() -> None:
    data = {"engine": {"model": "/m", "params": {"max_model_len": 200}}, "probe": {"prompt_tokens": 128}}
    (problem,) = _problems(data)
    assert "probe: prompt_tokens + max_tokens = 256 is over engine.params.max_model_len 200" in problem
    assert parse_config({**data, "probe": {"enabled": False}}).probe.enabled is False


@pytest.mark.parametrize(
    ("extra", "value"),
    [
        ([], None),
        (["--dtype", "float32"], "float32"),
        (["--dtype=half"], "half"),
        (["--dtype", "bfloat16", "--seed", "1", "--dtype=float32"], "float32"),  # the last one wins
        (["--seed", "1"], None),
        (["--dtype"], None),  # no value: vLLM refuses the line, the planner keeps its own choice
        (["--dtype-x", "float32"], None),
    ],
)
def test_extra_flag_reads_a_flag_vllm_is_given_in_extra_args(extra: list[str], value: str | None) -> None:
    engine = EngineConfig(model="/models/m", extra_args=extra)
    assert engine.extra_flag("dtype") == value


# -- strict TOML types: TOML writes a type, and the config keeps it --------------------------------


@pytest.mark.parametrize(
    ("toml", "key", "got"),
    [
        ("[backoff]\nmax_failures = true\n", "backoff.max_failures", "(got True)"),  # a boolean is no count
        ('[backoff]\nmax_failures = "3"\n', "backoff.max_failures", "(got '3')"),  # a string is no number
        ("[backoff]\nmax_failures = 3.0\n", "backoff.max_failures", "(got 3.0)"),  # a float is not whole
        ('[timeouts]\nstartup_s = "60"\n', "timeouts.startup_s", "(got '60')"),
        ("[timeouts]\nstartup_s = false\n", "timeouts.startup_s", "(got False)"),
        ('[probe]\nenabled = "yes"\n', "probe.enabled", "(got 'yes')"),  # a string is no boolean
        ("[probe]\nenabled = 1\n", "probe.enabled", "(got 1)"),  # nor is a number
        ("host = 127\n", "engine.host", "(got 127)"),  # a number is no string (MINIMAL ends in [engine])
        ("[engine.params]\nmax_num_seqs = true\n", "engine.params.max_num_seqs", "(got True)"),
        (
            '[engine.params]\ngpu_memory_utilization = "0.8"\n',
            "engine.params.gpu_memory_utilization",
            "'0.8'",
        ),
        ("[door]\nmax_queue = true\n", "door.max_queue", "(got True)"),
        ('[door]\nmax_in_flight = "8"\n', "door.max_in_flight", "(got '8')"),
        ("[tuning]\nbounds = { max_num_seqs = [4, true] }\n", "tuning.bounds.max_num_seqs.1", "(got True)"),
    ],
)
def test_a_value_of_the_wrong_toml_type_is_refused_with_its_key(
    tmp_path: Path, toml: str, key: str, got: str
) -> None:
    name, found = problems_of(tmp_path, MINIMAL + toml)
    assert len(found) == 1, found
    assert found[0].startswith(f"{name}: {key}: "), found
    assert got in found[0]


def test_an_integer_stands_for_a_float_and_a_string_for_a_path(tmp_path: Path) -> None:
    text = (
        MINIMAL
        + "[engine.params]\ngpu_memory_utilization = 1\n"
        + '[timeouts]\nstartup_s = 60\n[paths]\nstate_dir = "/srv/t"\nsocket = "/run/t.sock"\n'
        + '[tuning]\nrules = "r.toml"\nbounds = { max_num_seqs = [4, 128] }\n'
    )
    config = load_config(write(tmp_path, text))
    assert config.timeouts.startup_s == 60.0 and isinstance(config.timeouts.startup_s, float)
    assert config.engine.params.gpu_memory_utilization == 1.0
    assert config.paths.state_dir == Path("/srv/t") and config.paths.socket == Path("/run/t.sock")
    assert config.tuning.rules == Path("r.toml")
    assert config.tuning.bounds == {"max_num_seqs": (4.0, 128.0)}


# -- [objective] ----------------------------------------------------------------------------------------


def test_the_objective_defaults_to_goodput_without_targets_so_throughput_stays_in_force(
    tmp_path: Path,
) -> None:
    from tunerd.config.objective import in_force

    config = load_config(write(tmp_path, MINIMAL + "[door]\nenabled = true\nport = 8001\n"))
    objective = config.objective
    assert (objective.kind, objective.attainment, objective.count) == ("goodput", 0.95, "requests")
    assert (objective.ttft_s, objective.tpot_s, objective.e2e_s) == (None, None, None)
    applies = in_force(objective, config.door.enabled)
    assert (applies.kind, applies.name) == ("throughput", "throughput.generation")
    assert "no targets" in applies.reason
    targeted = objective.model_copy(update={"ttft_s": 1.0})
    assert in_force(targeted, True).kind == "goodput" and in_force(targeted, True).reason == ""
    assert "front door" in in_force(targeted, False).reason  # nothing measures it without the door


def test_bad_objective_values_are_refused_as_file_key_reason(tmp_path: Path) -> None:
    path, problems = problems_of(
        tmp_path,
        MINIMAL
        + "[objective]\n"
        + 'kind = "latency"\nttft_s = true\ntpot_s = -0.1\ne2e_s = "5"\nattainment = 1.5\ncount = "bytes"\n'
        + "surprise = 1\n",
    )
    keys = sorted(p.split(": ")[1] for p in problems)
    assert keys == [
        "objective.attainment",
        "objective.count",
        "objective.e2e_s",
        "objective.kind",
        "objective.surprise",
        "objective.tpot_s",
        "objective.ttft_s",
    ]
    assert all(p.startswith(f"{path}: objective.") for p in problems)
    assert any("(got True)" in p for p in problems)  # a bool is not a number
    assert any("(got '5')" in p for p in problems)  # nor is a string


def test_goodput_written_without_any_target_is_refused(tmp_path: Path) -> None:
    path, problems = problems_of(tmp_path, MINIMAL + '[objective]\nkind = "goodput"\n')
    assert problems == [
        f"{path}: objective: kind: goodput needs at least one per-request target: set ttft_s, tpot_s or "
        "e2e_s (or leave kind out: throughput stays in force until targets are set)"
    ]
    config = load_config(write(tmp_path, MINIMAL + '[objective]\nkind = "goodput"\ntpot_s = 0.05\n'))
    assert config.objective.tpot_s == 0.05 and config.objective.targets.any


def test_the_old_tuning_objective_key_is_a_deprecated_alias_of_objective_kind(tmp_path: Path) -> None:
    old = load_config(write(tmp_path, MINIMAL + '[tuning]\nobjective = "itl.p95"\n'))
    assert old.objective.kind == "itl.p95" and old.tuning.objective == "itl.p95"
    old = load_config(write(tmp_path, MINIMAL + '[tuning]\nobjective = "throughput.generation"\n'))
    assert old.objective.kind == "throughput" and old.tuning.objective == "throughput.generation"
    same = load_config(
        write(tmp_path, MINIMAL + '[tuning]\nobjective = "e2e.p95"\n[objective]\nkind = "e2e.p95"\n')
    )
    assert same.objective.kind == "e2e.p95"
    path, problems = problems_of(
        tmp_path, MINIMAL + '[tuning]\nobjective = "ttft.p95"\n[objective]\nkind = "throughput"\n'
    )
    assert len(problems) == 1 and problems[0].startswith(f"{path}: tuning.objective: 'ttft.p95' (deprecated")
    # What trials compare follows the kind, goodput included (the verdict asks whether it is in force).
    new = load_config(write(tmp_path, MINIMAL + '[objective]\nkind = "ttft.p95"\n'))
    assert new.tuning.objective == "ttft.p95"
    goodput = load_config(write(tmp_path, MINIMAL + "[objective]\nttft_s = 1\n"))
    assert goodput.objective.kind == "goodput" and goodput.tuning.objective == "slo.goodput"
    written = load_config(write(tmp_path, MINIMAL + '[objective]\nkind = "goodput"\ntpot_s = 0.05\n'))
    assert written.tuning.objective == "slo.goodput"
    default = load_config(write(tmp_path, MINIMAL))  # goodput by default, not in force without targets
    assert default.objective.kind == "goodput" and default.tuning.objective == "slo.goodput"
    text = '[tuning]\nobjective = "slo.goodput"\n[objective]\ntpot_s = 1\n'
    old = load_config(write(tmp_path, MINIMAL + text))
    assert old.objective.kind == "goodput" and old.tuning.objective == "slo.goodput"


def test_min_requests_is_at_least_one(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, MINIMAL)).objective.min_requests == 20
    config = load_config(write(tmp_path, MINIMAL + "[objective]\nmin_requests = 50\n"))
    assert config.objective.min_requests == 50
    path, problems = problems_of(tmp_path, MINIMAL + "[objective]\nmin_requests = 0\n")
    assert len(problems) == 1 and problems[0].startswith(f"{path}: objective.min_requests: ")
