"""Engine parameters: their vLLM flags, validation, differences and backend constraints."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tunerd.core.params import EngineParams, backend_problems


def test_unset_params_give_no_flags() -> None:
    assert EngineParams().to_argv() == []
    assert EngineParams().as_dict() == {}


def test_integer_param_becomes_flag_and_value() -> None:
    assert EngineParams(max_model_len=512).to_argv() == ["--max-model-len", "512"]


def test_true_boolean_becomes_bare_flag() -> None:
    assert EngineParams(enable_prefix_caching=True).to_argv() == ["--enable-prefix-caching"]


def test_false_boolean_becomes_negated_flag() -> None:
    assert EngineParams(enable_prefix_caching=False).to_argv() == ["--no-enable-prefix-caching"]
    assert EngineParams(enable_chunked_prefill=False).to_argv() == ["--no-enable-chunked-prefill"]


def test_floats_keep_their_decimal_form() -> None:
    assert EngineParams(gpu_memory_utilization=0.85).to_argv() == ["--gpu-memory-utilization", "0.85"]
    assert EngineParams(cpu_offload_gb=4).to_argv() == ["--cpu-offload-gb", "4.0"]


def test_string_param_is_passed_as_is() -> None:
    assert EngineParams(kv_cache_dtype="fp8").to_argv() == ["--kv-cache-dtype", "fp8"]


def test_flags_come_in_field_order() -> None:
    params = EngineParams(
        enable_prefix_caching=True,
        block_size=32,
        max_model_len=512,
        kv_cache_memory_bytes=1_000_000,
        max_num_seqs=16,
    )
    assert params.to_argv() == [
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "16",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        "1000000",
        "--enable-prefix-caching",
    ]


def test_replace_returns_a_changed_copy_and_leaves_the_original() -> None:
    original = EngineParams(max_model_len=4096, block_size=32)
    changed = original.replace(max_model_len=1920)
    assert changed == EngineParams(max_model_len=1920, block_size=32)
    assert original.max_model_len == 4096


def test_replace_can_unset_a_param() -> None:
    assert EngineParams(max_model_len=4096).replace(max_model_len=None) == EngineParams()


@pytest.mark.parametrize(
    "changes",
    [
        {"gpu_memory_utilization": 1.5},
        {"gpu_memory_utilization": 0},
        {"max_model_len": 0},
        {"max_num_seqs": -1},
        {"cpu_offload_gb": -0.5},
        {"swap_space": 4},
    ],
    ids=lambda c: next(iter(c)),
)
def test_replace_validates_the_new_values(changes: dict) -> None:
    with pytest.raises(ValidationError):
        EngineParams(max_model_len=512).replace(**changes)


def test_params_are_immutable() -> None:
    params = EngineParams(max_model_len=512)
    with pytest.raises(ValidationError):
        params.max_model_len = 1024  # type: ignore[misc]


def test_as_dict_holds_only_set_params() -> None:
    assert EngineParams(max_model_len=512, enable_prefix_caching=False).as_dict() == {
        "max_model_len": 512,
        "enable_prefix_caching": False,
    }


def test_block_size_16_is_a_problem_on_cpu() -> None:
    problems = backend_problems(EngineParams(block_size=16), "cpu")
    assert problems == ["block_size 16 is not a multiple of 32 on cpu"]


def test_block_size_16_is_fine_on_cuda() -> None:
    assert backend_problems(EngineParams(block_size=16), "cuda") == []


def test_block_size_24_is_a_problem_on_cuda() -> None:
    assert backend_problems(EngineParams(block_size=24), "cuda") == [
        "block_size 24 is not a multiple of 16 on cuda"
    ]


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_block_size_32_and_unset_block_size_are_fine_everywhere(backend: str) -> None:
    assert backend_problems(EngineParams(block_size=32), backend) == []  # type: ignore[arg-type]
    assert backend_problems(EngineParams(), backend) == []  # type: ignore[arg-type]
