"""The KV model's first step of max_num_seqs under KV pressure (policy/first_step.py, issue 22): the
arithmetic, the rounding to values the backend runs fast, and what it never proposes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.engine.logwatch import CaptureSizes, classify_line
from tunerd.policy.first_step import (
    FirstStep,
    KvShape,
    LostCap,
    NoFirstStep,
    kv_first_step,
    lost_to_door,
    round_down_fast,
)

H200_LOG = Path(__file__).parents[1] / "fixtures" / "vllm-0.24.0-h200" / "default_cold.log"
BOUNDS = (1.0, 1024.0)


def h200_capture_sizes() -> tuple[int, ...]:
    """The capture sizes of a default start on the H200 (vLLM 0.24), as the run keeps them."""
    events = [classify_line(line) for line in H200_LOG.read_text().splitlines()]
    [sizes] = [e for e in events if isinstance(e, CaptureSizes)]
    return sizes.sizes


def cpu_kv_test(**changes: object) -> KvShape:
    """The CPU KV test's shape: a 1,920-token cache, 16 prompt + 256 output tokens a request, block 128."""
    values: dict[str, object] = {
        "kv_tokens": 1920,
        "kv_source": "vLLM's log",
        "block_size": 128,
        "prompt_tokens": 16.0,
        "output_tokens": 256.0,
        "backend": "cpu",
        "capture_sizes": (),
    }
    values.update(changes)
    return KvShape(**values)  # type: ignore[arg-type]


def h200(kv_tokens: int, **changes: object) -> KvShape:
    """An H200 run (block 16) whose KV cache holds `kv_tokens`, with the default start's capture sizes."""
    values: dict[str, object] = {
        "kv_tokens": kv_tokens,
        "kv_source": "vLLM's log",
        "block_size": 16,
        "prompt_tokens": 16.0,
        "output_tokens": 256.0,
        "backend": "cuda",
        "capture_sizes": h200_capture_sizes(),
    }
    values.update(changes)
    return KvShape(**values)  # type: ignore[arg-type]


def test_cpu_kv_test_shape_counts_whole_blocks_and_the_null_block() -> None:
    # 1,920 tokens ÷ 272 tokens a request is 7.06 in tokens, but vLLM holds whole blocks of 128: 15 blocks,
    # one of them the null block, and a request of 272 tokens holds 3 → 14 ÷ 3 = 4.67 → 4 at once.
    step = kv_first_step(cpu_kv_test(), current=256, bounds=BOUNDS)
    assert isinstance(step, FirstStep) and step.value == 4
    assert step.arithmetic == (
        "KV cache 1,920 tokens (vLLM's log) = 15 blocks of 128, 14 usable (one is vLLM's null block) ÷ "
        "3 blocks per request (16 prompt + 256 output = 272 tokens) = 4.67 → 4; "
        "CPU backend: no CUDA graphs, any value runs as fast → 4"
    )


def test_h200_rounds_down_to_a_capture_size_not_to_23() -> None:
    # The H200 case: the cache holds 23 requests of 272 tokens (408 blocks of 16, 407 usable, 17
    # blocks a request = 23.94), and max_num_seqs 23 left CUDA graphs for sizes up to 16 only: 16.
    step = kv_first_step(h200(408 * 16), current=1024, bounds=BOUNDS)
    assert isinstance(step, FirstStep) and step.value == 16
    assert "= 23.94 → 23; down to a CUDA-graph capture size in vLLM's log → 16" in step.arithmetic


# (one block more: the null block)
SIZES = [(17 * 30 + 1, 30, 24), (17 * 33 + 1, 33, 32), (17 * 300 + 1, 300, 288), (17 * 7 + 1, 7, 4)]


@pytest.mark.parametrize(("blocks", "fits", "value"), SIZES)
def test_h200_capture_sizes_round_down(blocks: int, fits: int, value: int) -> None:
    step = kv_first_step(h200(blocks * 16), current=1024, bounds=BOUNDS)
    assert isinstance(step, FirstStep) and step.value == value
    assert f"→ {fits};" in step.arithmetic


def test_cuda_without_logged_sizes_falls_back_to_vllms_default_list() -> None:
    assert round_down_fast(23, "cuda", None)[0] == 16
    assert round_down_fast(47, "cuda", None)[0] == 40
    assert round_down_fast(7, "cuda", None)[0] == 4
    assert round_down_fast(1, "cuda", None)[0] == 1


def test_an_eager_cuda_start_and_the_cpu_backend_take_any_integer() -> None:
    assert round_down_fast(23, "cuda", ())[0] == 23
    assert round_down_fast(23, "cpu", None)[0] == 23


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        (cpu_kv_test(kv_tokens=None), "the KV cache's size is not known"),
        (cpu_kv_test(prompt_tokens=None), "no request has finished yet"),
        (cpu_kv_test(output_tokens=None), "no request has finished yet"),
        (cpu_kv_test(output_tokens=0.0), "no request has finished yet"),
        (cpu_kv_test(kv_tokens=256), "holds less than one request"),
    ],
)
def test_without_its_inputs_the_model_proposes_nothing(shape: KvShape, reason: str) -> None:
    step = kv_first_step(shape, current=256, bounds=BOUNDS)
    assert isinstance(step, NoFirstStep) and reason in step.reason


def test_never_at_or_above_the_value_in_force() -> None:
    step = kv_first_step(cpu_kv_test(), current=4, bounds=BOUNDS)
    assert isinstance(step, NoFirstStep) and "not fewer than max_num_seqs 4" in step.reason
    assert step.arithmetic is not None and "→ 4" in step.arithmetic  # the journal still shows why


def test_bounds_clamp_the_value() -> None:
    step = kv_first_step(cpu_kv_test(), current=256, bounds=(6.0, 1024.0))
    assert isinstance(step, FirstStep) and step.value == 6 and "at the lower bound 6" in step.arithmetic
    big = kv_first_step(h200(1_182_912), current=1024, bounds=(1.0, 128.0))
    assert isinstance(big, FirstStep) and big.value == 128 and "at the upper bound 128" in big.arithmetic
    above = kv_first_step(cpu_kv_test(), current=8, bounds=(8.0, 1024.0))
    assert isinstance(above, NoFirstStep)  # the lower bound is the value in force: nothing below it


def test_a_tabu_value_is_not_proposed() -> None:
    tabu = {("max_num_seqs", 4): "reverted: throughput worse"}
    step = kv_first_step(cpu_kv_test(), current=256, bounds=BOUNDS, tabu=tabu)
    assert (
        isinstance(step, NoFirstStep) and step.reason == "max_num_seqs=4 is tabu: reverted: throughput worse"
    )


def test_never_jumps_over_a_tabu_value() -> None:
    # 8 lost (tabu) between the model's 4 and the 16 in force: going past what lost is not tried.
    tabu = {("max_num_seqs", 8): "reverted: throughput worse", ("max_num_seqs", 2): "failed"}
    step = kv_first_step(cpu_kv_test(), current=16, bounds=BOUNDS, tabu=tabu)
    assert isinstance(step, NoFirstStep)
    assert step.reason == "max_num_seqs=4 would jump over 8, which is tabu: reverted: throughput worse"
    below = kv_first_step(cpu_kv_test(), current=16, bounds=BOUNDS, tabu={("max_num_seqs", 2): "failed"})
    assert isinstance(below, FirstStep) and below.value == 4  # a tabu value below it is no obstacle


def test_a_concurrency_the_doors_cap_lost_is_lost_for_max_num_seqs() -> None:
    # The door's cap at 23 missed the targets by its wait (a larger cap was needed): max_num_seqs 16 — the
    # value 23 rounds to — runs even fewer at once.
    lost = (LostCap(23, "its requests missed the targets by the door's wait"),)
    step = kv_first_step(h200(408 * 16), current=1024, bounds=BOUNDS, lost=lost)
    assert isinstance(step, NoFirstStep)
    assert step.reason == (
        "the door's cap at 23 already lost under this load (its requests missed the targets by the door's "
        "wait): max_num_seqs=16 runs no more at once"
    )
    assert lost_to_door(24, lost) is None  # above the lost cap: not lost
    assert lost_to_door(23, lost) is not None
