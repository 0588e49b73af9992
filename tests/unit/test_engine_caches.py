"""Every cache the engine writes goes under the service's persistent cache directory ($CACHE_DIRECTORY,
which systemd sets for CacheDirectory=): TorchInductor's default under /tmp does not survive PrivateTmp=.
The operator's [engine.env] wins; without CACHE_DIRECTORY nothing is invented."""

from __future__ import annotations

import pytest

from tunerd.config import EngineConfig
from tunerd.engine.launch import ENGINE_CACHES, build_env

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "HF_HOME")


def engine(**fields: object) -> EngineConfig:
    return EngineConfig.model_validate({"model": "/models/m", **fields})


def service_env(**extra: str) -> dict[str, str]:
    """What systemd gives tunerd.service (CacheDirectory=tunerd, StateDirectory=tunerd)."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": "/var/lib/tunerd",
        "CACHE_DIRECTORY": "/var/cache/tunerd",
        "STATE_DIRECTORY": "/var/lib/tunerd",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        **extra,
    }


def test_the_caches_named_are_torchinductor_triton_vllm_and_hugging_face() -> None:
    assert set(ENGINE_CACHES) == set(CACHE_VARIABLES)


def test_every_engine_cache_goes_under_the_cache_directory() -> None:
    env = build_env(engine(), service_env())
    assert {key: env[key] for key in CACHE_VARIABLES} == {
        "TORCHINDUCTOR_CACHE_DIR": "/var/cache/tunerd/torchinductor",
        "TRITON_CACHE_DIR": "/var/cache/tunerd/triton",
        "VLLM_CACHE_ROOT": "/var/cache/tunerd/vllm",
        "HF_HOME": "/var/cache/tunerd/huggingface",
    }
    assert not any(env[key].startswith("/tmp") for key in CACHE_VARIABLES)


def test_the_operators_engine_env_wins() -> None:
    env = build_env(
        engine(env={"HF_HOME": "/data/hf", "TORCHINDUCTOR_CACHE_DIR": "/data/inductor"}), service_env()
    )
    assert env["HF_HOME"] == "/data/hf"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/data/inductor"
    assert env["TRITON_CACHE_DIR"] == "/var/cache/tunerd/triton"


def test_a_cache_already_set_for_the_daemon_is_kept() -> None:
    # e.g. `Environment=VLLM_CACHE_ROOT=/srv/vllm` in a drop-in: the operator set it for the service.
    env = build_env(engine(), service_env(VLLM_CACHE_ROOT="/srv/vllm"))
    assert env["VLLM_CACHE_ROOT"] == "/srv/vllm"
    assert env["HF_HOME"] == "/var/cache/tunerd/huggingface"


def test_the_first_of_several_cache_directories_is_used() -> None:
    env = build_env(engine(), service_env(CACHE_DIRECTORY="/var/cache/tunerd:/var/cache/other"))
    assert env["VLLM_CACHE_ROOT"] == "/var/cache/tunerd/vllm"


@pytest.mark.parametrize("value", [None, "", "relative/dir"])
def test_without_a_usable_cache_directory_nothing_is_invented(value: str | None) -> None:
    base = service_env()
    if value is None:
        del base["CACHE_DIRECTORY"]
    else:
        base["CACHE_DIRECTORY"] = value
    env = build_env(engine(), base)
    assert not any(key in env for key in CACHE_VARIABLES)


def test_systemds_variables_still_do_not_reach_the_engine() -> None:
    assert "NOTIFY_SOCKET" not in build_env(engine(), service_env())
