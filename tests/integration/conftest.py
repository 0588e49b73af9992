"""Integration tier: the real daemon as a child process, driving the fake vLLM (tests/fake_vllm)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import FAKE_VLLM, free_port


def fake_sections(
    tmp_path: Path, *, knobs: dict[str, str] | None = None, **overrides: dict[str, Any]
) -> dict:
    """A config that runs the fake vLLM with fast timeouts; `overrides` replace keys per section."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    sections: dict[str, dict[str, Any]] = {
        "engine": {
            "command": [sys.executable, str(FAKE_VLLM)],
            "model": str(model),
            "port": free_port(),
        },
        "engine.env": {"FAKE_VLLM_STARTUP_S": "0.5", **(knobs or {})},
        "engine.params": {"max_model_len": 512, "kv_cache_memory_bytes": 1_000_000, "block_size": 32},
        "timeouts": {
            "startup_s": 20.0,
            "graceful_stop_s": 3.0,
            "health_interval_s": 0.5,
            "health_timeout_s": 1.0,
            "health_failures": 2,
        },
        "backoff": {
            "initial_s": 0.2,
            "max_s": 1.0,
            "reset_after_s": 60.0,
            "known_good_after_s": 1.0,
            "max_failures": 3,
        },
        "export": {"port": 0},
        "logging": {"format": "json", "level": "debug"},
    }
    for section, values in overrides.items():
        sections.setdefault(section.replace("__", "."), {}).update(values)
    return sections


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
