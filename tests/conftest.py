"""Fixtures every tier shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 of vllm-facts.md (2 layers, 2 KV heads, head_dim 32: 512 bytes of KV cache per
    token), written once per session by `scripts/make-tiny-model.py`. Tests only read it."""
    target = tmp_path_factory.mktemp("models") / "qwen3-tiny"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make-tiny-model.py"), str(target)],
        check=True,
        capture_output=True,
    )
    return target
