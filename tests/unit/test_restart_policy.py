"""Restart decisions: capped exponential backoff, rollback to last-known-good, FATAL, corrections."""

from __future__ import annotations

import pytest

from tunerd.config import BackoffConfig
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.params import EngineParams
from tunerd.policy.corrections import correction
from tunerd.policy.restart import (
    Action,
    backoff_delay,
    consecutive_failures,
    decide_after_failure,
)

POLICY = BackoffConfig()  # 10 s doubling to 300 s, reset after 600 s, 3 failures
GOOD = EngineParams(max_model_len=4096, max_num_seqs=64)
TUNED = EngineParams(max_model_len=8192, max_num_seqs=128)


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def crash(detail: str = "exited with code 1") -> EngineFailure:
    return EngineFailure(FailureKind.EXITED, detail)


# -- backoff_delay ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(1, 10.0), (2, 20.0), (3, 40.0), (4, 80.0), (5, 160.0), (6, 300.0), (7, 300.0), (50, 300.0)],
)
def test_backoff_doubles_from_initial_and_is_capped_at_max(failures: int, delay: float) -> None:
    assert backoff_delay(POLICY, failures) == delay


def test_backoff_is_zero_before_any_failure() -> None:
    assert backoff_delay(POLICY, 0) == 0.0
    assert backoff_delay(POLICY, -3) == 0.0


def test_backoff_with_multiplier_one_stays_at_initial() -> None:
    policy = BackoffConfig(initial_s=7.0, multiplier=1.0, max_s=100.0)
    assert [backoff_delay(policy, n) for n in (1, 2, 5, 1000)] == [7.0, 7.0, 7.0, 7.0]


def test_backoff_uses_the_configured_initial_multiplier_and_cap() -> None:
    policy = BackoffConfig(initial_s=1.5, multiplier=3.0, max_s=20.0)
    assert [backoff_delay(policy, n) for n in (1, 2, 3, 4)] == [1.5, 4.5, 13.5, 20.0]


def test_backoff_for_a_huge_failure_count_does_not_overflow() -> None:
    assert backoff_delay(POLICY, 10**18) == 300.0


def test_backoff_with_a_large_multiplier_and_huge_count_is_capped_not_overflowing() -> None:
    # The config accepts any multiplier >= 1; initial × multiplier^64 overflows a float past ~66 000.
    policy = BackoffConfig(initial_s=10.0, multiplier=1e6, max_s=300.0)
    assert backoff_delay(policy, 10**9) == 300.0


# -- consecutive_failures --------------------------------------------------------------------------


def test_failure_count_grows_after_a_short_run() -> None:
    assert consecutive_failures(POLICY, 2, ran_for_s=30.0) == 3


def test_failure_count_grows_when_the_engine_never_ran() -> None:
    assert consecutive_failures(POLICY, 4, ran_for_s=None) == 5


def test_failure_count_starts_afresh_after_a_stable_run() -> None:
    assert consecutive_failures(POLICY, 7, ran_for_s=600.0) == 1
    assert consecutive_failures(POLICY, 7, ran_for_s=5000.0) == 1


def test_a_run_just_short_of_reset_after_does_not_reset_the_count() -> None:
    assert consecutive_failures(POLICY, 2, ran_for_s=599.9) == 3


# -- decide_after_failure: retry, rollback, FATAL --------------------------------------------------


def decide(
    failures_before: int,
    *,
    failure: EngineFailure | None = None,
    params: EngineParams = TUNED,
    known_good: EngineParams | None = GOOD,
    ran_for_s: float | None = 5.0,
):
    """The decision as the lifecycle asks for it: with the correction the failure calls for."""
    failure = failure if failure is not None else crash()
    return decide_after_failure(
        POLICY,
        failures_before=failures_before,
        ran_for_s=ran_for_s,
        failure=failure,
        params=params,
        known_good=known_good,
        correction=correction(failure, params, None, "cpu"),
    )


def test_first_failure_retries_same_params_after_initial_delay() -> None:
    decision = decide(0)
    assert decision.action is Action.RETRY
    assert decision.delay_s == 10.0
    assert decision.failures == 1
    assert decision.params == TUNED


def test_second_failure_retries_after_doubled_delay() -> None:
    decision = decide(1)
    assert (decision.action, decision.delay_s, decision.failures) == (Action.RETRY, 20.0, 2)


def test_max_failures_rolls_back_to_last_known_good_when_it_differs() -> None:
    decision = decide(2)
    assert decision.action is Action.ROLLBACK
    assert decision.params == GOOD
    assert decision.failures == 0
    assert decision.delay_s == 0.0
    assert "3 consecutive failures" in decision.reason


def test_max_failures_of_the_last_known_good_itself_is_fatal() -> None:
    decision = decide(2, params=GOOD, known_good=GOOD)
    assert decision.action is Action.FATAL
    assert decision.params is None
    assert decision.failures == 3


def test_max_failures_without_any_last_known_good_is_fatal() -> None:
    decision = decide(2, known_good=None)
    assert decision.action is Action.FATAL
    assert decision.params is None


def test_failure_without_classification_still_retries() -> None:
    decision = decide_after_failure(
        POLICY, failures_before=0, ran_for_s=None, failure=None, params=TUNED, known_good=GOOD
    )
    assert decision.action is Action.RETRY
    assert decision.delay_s == 10.0


def test_a_failure_after_a_stable_run_starts_the_backoff_over() -> None:
    decision = decide(2, ran_for_s=3600.0)
    assert (decision.action, decision.delay_s, decision.failures) == (Action.RETRY, 10.0, 1)


@pytest.mark.parametrize(
    "kind", [FailureKind.MODEL_NOT_FOUND, FailureKind.BAD_ARGUMENTS, FailureKind.SPAWN_FAILED]
)
def test_unfixable_failure_rolls_back_at_once(kind: FailureKind) -> None:
    decision = decide(0, failure=EngineFailure(kind, "evidence"))
    assert decision.action is Action.ROLLBACK
    assert decision.params == GOOD
    assert decision.delay_s == 0.0
    assert str(kind) in decision.reason


@pytest.mark.parametrize(
    "kind", [FailureKind.MODEL_NOT_FOUND, FailureKind.BAD_ARGUMENTS, FailureKind.SPAWN_FAILED]
)
def test_unfixable_failure_of_last_known_good_is_fatal_at_once(kind: FailureKind) -> None:
    decision = decide(0, failure=EngineFailure(kind, "evidence"), params=GOOD, known_good=GOOD)
    assert decision.action is Action.FATAL
    assert decision.params is None
    assert decision.failures == 1


def test_unfixable_failure_without_last_known_good_is_fatal_at_once() -> None:
    failure = EngineFailure(FailureKind.MODEL_NOT_FOUND, "HFValidationError")
    decision = decide(0, failure=failure, known_good=None)
    assert decision.action is Action.FATAL


def test_port_in_use_is_retried_not_fatal() -> None:
    decision = decide(0, failure=EngineFailure(FailureKind.PORT_IN_USE, "Address already in use"))
    assert decision.action is Action.RETRY


# -- decide_after_failure: correcting max_model_len ------------------------------------------------


def kv_too_small(estimate: int | None) -> EngineFailure:
    return EngineFailure(FailureKind.KV_CACHE_TOO_SMALL, "To serve at least one request …", estimate)


def test_kv_cache_too_small_with_estimate_corrects_max_model_len() -> None:
    decision = decide(0, failure=kv_too_small(1920), params=EngineParams(max_model_len=4096, block_size=32))
    assert decision.action is Action.CORRECT
    assert decision.params == EngineParams(max_model_len=1920, block_size=32)
    assert decision.delay_s == 0.0
    assert "1920" in decision.reason


def test_kv_cache_too_small_corrects_when_max_model_len_was_left_to_vllm() -> None:
    decision = decide(0, failure=kv_too_small(1920), params=EngineParams(max_num_seqs=16))
    assert decision.action is Action.CORRECT
    assert decision.params is not None
    assert decision.params.max_model_len == 1920
    assert decision.params.max_num_seqs == 16


@pytest.mark.parametrize("max_model_len", [1920, 1024])
def test_kv_cache_too_small_does_not_correct_when_already_at_or_below_estimate(max_model_len: int) -> None:
    decision = decide(0, failure=kv_too_small(1920), params=EngineParams(max_model_len=max_model_len))
    assert decision.action is Action.RETRY


def test_kv_cache_too_small_without_estimate_retries() -> None:
    decision = decide(0, failure=kv_too_small(None), params=EngineParams(max_model_len=4096))
    assert decision.action is Action.RETRY


def test_estimate_on_another_failure_kind_does_not_correct() -> None:
    failure = EngineFailure(FailureKind.NO_KV_MEMORY, "no memory", 1920)
    decision = decide(0, failure=failure, params=EngineParams(max_model_len=4096))
    assert decision.action is Action.RETRY


# -- a crash loop, step by step --------------------------------------------------------------------


def test_crash_loop_walks_through_retries_then_rollback_then_fatal() -> None:
    clock = FakeClock()
    params, failures = TUNED, 0
    steps: list[tuple[Action, float, EngineParams | None]] = []
    while True:
        started = clock()
        clock.advance(12.0)  # each run dies 12 s after its start: far below reset_after_s
        decision = decide_after_failure(
            POLICY,
            failures_before=failures,
            ran_for_s=clock() - started,
            failure=crash(),
            params=params,
            known_good=GOOD,
        )
        steps.append((decision.action, decision.delay_s, decision.params))
        if decision.action is Action.FATAL:
            break
        assert decision.params is not None
        clock.advance(decision.delay_s)
        params, failures = decision.params, decision.failures
        assert len(steps) < 20, "the crash loop never ended"

    assert steps == [
        (Action.RETRY, 10.0, TUNED),
        (Action.RETRY, 20.0, TUNED),
        (Action.ROLLBACK, 0.0, GOOD),
        (Action.RETRY, 10.0, GOOD),
        (Action.RETRY, 20.0, GOOD),
        (Action.FATAL, 0.0, None),
    ]
    assert clock() == 1000.0 + 6 * 12.0 + 10 + 20 + 10 + 20


def test_a_stable_run_in_the_middle_of_a_crash_loop_resets_the_delays() -> None:
    clock = FakeClock()
    delays = []
    failures = 0
    for ran_for in (5.0, 5.0, 700.0, 5.0):
        started = clock()
        clock.advance(ran_for)
        decision = decide_after_failure(
            POLICY,
            failures_before=failures,
            ran_for_s=clock() - started,
            failure=crash(),
            params=GOOD,
            known_good=GOOD,
        )
        delays.append(decision.delay_s)
        failures = decision.failures
        clock.advance(decision.delay_s)
    assert delays == [10.0, 20.0, 10.0, 20.0]
