"""The engine's command line and environment."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tunerd.config import Config, EngineConfig, NumactlConfig
from tunerd.core.params import EngineParams
from tunerd.engine.launch import ACCESS_LOG_FLAG, access_log_args, build_argv, build_env
from tunerd.policy.corrections import without_flags

PARAMS = EngineParams(max_model_len=512, block_size=32, enable_prefix_caching=False)


def engine(**overrides: object) -> EngineConfig:
    return EngineConfig.model_validate({"model": "/models/qwen3-tiny", **overrides})


def test_argv_is_command_then_model_host_port_then_params_then_extra_args() -> None:
    config = engine(port=18102, extra_args=["--enforce-eager", "--served-model-name", "tiny"])
    assert build_argv(config, PARAMS) == [
        "vllm",
        "serve",
        "--model",
        "/models/qwen3-tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "18102",
        "--max-model-len",
        "512",
        "--block-size",
        "32",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--served-model-name",
        "tiny",
    ]


def test_argv_uses_the_configured_command() -> None:
    config = engine(command=["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"])
    argv = build_argv(config, EngineParams())
    assert argv[:3] == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:] == ["--model", "/models/qwen3-tiny", "--host", "127.0.0.1", "--port", "8000"]


def test_argv_without_numactl_starts_with_the_command() -> None:
    config = engine(numactl=NumactlConfig(enabled=False, cpunodebind=1, membind=1))
    assert build_argv(config, EngineParams())[0] == "vllm"


def test_numactl_prefix_binds_cpus_and_memory() -> None:
    config = engine(numactl={"enabled": True, "cpunodebind": 1, "membind": 0})
    argv = build_argv(config, PARAMS)
    assert argv[:5] == ["numactl", "--cpunodebind=1", "--membind=0", "vllm", "serve"]


def test_numactl_prefix_leaves_out_unset_bindings() -> None:
    config = engine(numactl={"enabled": True, "command": "/usr/bin/numactl", "membind": 1})
    assert build_argv(config, EngineParams())[:3] == ["/usr/bin/numactl", "--membind=1", "vllm"]


@pytest.fixture
def systemd_env() -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": "/var/lib/tunerd",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "1234",
        "LISTEN_FDS": "1",
        "LISTEN_PID": "1234",
    }


def test_env_drops_systemd_notify_and_watchdog_variables(systemd_env: dict[str, str]) -> None:
    env = build_env(engine(), systemd_env)
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
        assert key not in env
    assert env["PATH"] == "/usr/bin:/bin"
    assert env["HOME"] == "/var/lib/tunerd"


def test_env_sets_python_unbuffered(systemd_env: dict[str, str]) -> None:
    assert build_env(engine(), systemd_env)["PYTHONUNBUFFERED"] == "1"


def test_env_applies_the_config_env_last(systemd_env: dict[str, str]) -> None:
    config = engine(env={"VLLM_CPU_KVCACHE_SPACE": "1", "PATH": "/opt/venv/bin:/usr/bin"})
    env = build_env(config, systemd_env)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["PATH"] == "/opt/venv/bin:/usr/bin"


def test_env_does_not_change_the_base_mapping(systemd_env: dict[str, str]) -> None:
    before = dict(systemd_env)
    build_env(engine(env={"X": "1"}), systemd_env)
    assert systemd_env == before


def test_env_defaults_to_the_daemons_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("TUNERD_TEST_MARK", "present")
    env = build_env(engine())
    assert env["TUNERD_TEST_MARK"] == "present"
    assert "NOTIFY_SOCKET" not in env


# -- vLLM's access log (issue 20) -----------------------------------------------------------------------


def full_config(door: bool, **engine_keys: object) -> Config:
    return Config.model_validate(
        {"engine": {"model": "/m", "port": 18000, **engine_keys}, "door": {"enabled": door, "port": 8000}}
    )


@pytest.mark.parametrize(
    ("door", "access_log", "expected"),
    [
        (True, "auto", [ACCESS_LOG_FLAG]),  # behind the door: every line names the door, most are polls
        (False, "auto", []),  # without it vLLM's access log is the only record of requests
        (True, "on", []),
        (False, "off", [ACCESS_LOG_FLAG]),
    ],
)
def test_the_access_log_is_off_behind_the_door_unless_said_otherwise(
    door: bool, access_log: str, expected: list[str]
) -> None:
    assert access_log_args(full_config(door, access_log=access_log)) == expected


@pytest.mark.parametrize("given", ["--disable-uvicorn-access-log", "--no-disable-uvicorn-access-log"])
def test_extra_args_that_say_it_win(given: str) -> None:
    assert access_log_args(full_config(True, extra_args=[given])) == []


def test_a_vllm_without_the_flag_has_it_dropped_with_the_flags_after_it_kept() -> None:
    """The correction for "unrecognized arguments" leaves the flag out; it takes no value."""
    argv = ["vllm", "serve", ACCESS_LOG_FLAG, "--shutdown-timeout", "20"]
    assert without_flags(argv, [ACCESS_LOG_FLAG]) == ["vllm", "serve", "--shutdown-timeout", "20"]


def test_an_unknown_access_log_setting_is_refused() -> None:
    with pytest.raises(ValidationError, match="access_log"):
        full_config(True, access_log="quiet")
