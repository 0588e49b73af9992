"""The planner's predictions against the starts other tests of this tier make anyway (test_planner_vs_vllm.py
has the cases that start vLLM themselves): the shared tiny daemon's first start is case A-kv-2000000 (the
same sizing flags), the tuning module's refused start A-refuse-4096. Each is read from a copy of that
start's log (`LoggedStarts`), so this module runs after them (tests/engine/conftest._engine_order), on
the same worker; a case no logged start serves fails here, naming it (a test changed its flags).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.engine.conftest import LoggedStarts
from tests.engine.planner_harness import DEFAULT_CASES, CaseResult, format_table, run_all
from tests.engine.test_planner_vs_vllm import LOGGED, assert_kv_tokens_exact, assert_refusal_estimate_exact

pytestmark = pytest.mark.engine

CASES = tuple(c for c in DEFAULT_CASES if c.name in LOGGED)


@pytest.fixture(scope="session")
def logged_results(
    tmp_path_factory: pytest.TempPathFactory, logged_starts: LoggedStarts
) -> dict[str, CaseResult]:
    starts = logged_starts.starts
    missing = [c.name for c in CASES if not any(start.serves(c) for start in starts)]
    assert not missing, f"no logged start has the flags of {missing}: {[s.argv for s in starts]}"
    results = run_all(tmp_path_factory.mktemp("planner-vs-logged"), CASES, known=logged_starts.starts)
    return {r.case.name: r for r in results}


def test_kv_tokens_equal_the_tiny_daemons_first_start(
    logged_results: dict[str, CaseResult], figures: Callable[[str], None]
) -> None:
    figures(format_table(list(logged_results.values())))
    assert_kv_tokens_exact(logged_results["A-kv-2000000"])


def test_estimated_max_model_len_equals_the_refused_start(logged_results: dict[str, CaseResult]) -> None:
    assert_refusal_estimate_exact(logged_results["A-refuse-4096"])
