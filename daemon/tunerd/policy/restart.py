"""What to do after the engine failed: retry after a backoff, correct, roll back, or give up (FATAL).

Pure: the caller passes the facts (how many failures so far, how long the run lasted, what failed,
whether a last-known-good set exists and is in force); nothing here reads a clock or touches a
process. Modeled on supervisord's BACKOFF/FATAL and Kubernetes' CrashLoopBackOff.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tunerd.config import BackoffConfig
from tunerd.core.failures import BLAMES_PARAMS, UNFIXABLE, EngineFailure
from tunerd.core.params import EngineParams
from tunerd.policy.corrections import Correction


class Action(StrEnum):
    RETRY = "retry"  # same parameters, after `delay_s`
    CORRECT = "correct"  # vLLM said what fits: retry with `params` (e.g. its estimated max_model_len)
    ROLLBACK = "rollback"  # back to the last-known-good parameters
    FATAL = "fatal"  # stop trying until an operator acts


@dataclass(frozen=True, slots=True)
class RestartDecision:
    action: Action
    delay_s: float
    failures: int  # consecutive failures counted against the parameters that will run next
    reason: str
    params: EngineParams | None = None  # the parameters to start with (None for FATAL)
    drop_flags: tuple[str, ...] = ()  # flags to leave out of the command line from now on


def backoff_delay(policy: BackoffConfig, failures: int) -> float:
    """Delay before the next start after `failures` (>= 1) consecutive failures.

    initial × multiplier^(failures-1), capped at max: 10, 20, 40 … 300 s with the defaults.
    """
    if failures < 1:
        return 0.0
    delay = policy.initial_s
    for _ in range(failures - 1):  # multiply step by step: no overflow, stops at the cap
        if delay >= policy.max_s:
            break
        delay *= policy.multiplier
    return min(policy.max_s, delay)


def consecutive_failures(policy: BackoffConfig, failures_before: int, ran_for_s: float | None) -> int:
    """The failure count including this failure: a run that lasted `reset_after_s` starts afresh."""
    if ran_for_s is not None and ran_for_s >= policy.reset_after_s:
        failures_before = 0
    return failures_before + 1


def decide_after_failure(
    policy: BackoffConfig,
    *,
    failures_before: int,
    ran_for_s: float | None,
    failure: EngineFailure | None,
    params: EngineParams,
    known_good: EngineParams | None,
    correction: Correction | None = None,
) -> RestartDecision:
    """Decide the next step after the engine failed (start failure, crash, hang, wedge, OOM kill).

    - A failure vLLM says cannot be cured by retrying (model missing, bad flags) rolls back when
      different known-good parameters exist, else goes FATAL at once: no retry loop.
    - A start-up failure that says what would fit (`correction`, policy/corrections.py: vLLM's estimated
      max_model_len, the free share of the GPU, a flag this vLLM does not know …) → one corrected
      start, counted as a failure like any other, before anything else.
    - Otherwise retry with exponential, capped backoff; after `max_failures` consecutive failures,
      roll back to last-known-good if those are not the ones failing, else FATAL.
    """
    failures = consecutive_failures(policy, failures_before, ran_for_s)
    can_roll_back = known_good is not None and known_good != params
    kind = failure.kind if failure is not None else None

    if correction is not None and failures < policy.max_failures:
        return RestartDecision(
            Action.CORRECT, 0.0, failures, correction.reason, correction.params, correction.drop_flags
        )

    if kind in UNFIXABLE:
        if can_roll_back:
            return RestartDecision(Action.ROLLBACK, 0.0, 0, f"{kind}: back to last-known-good", known_good)
        return RestartDecision(Action.FATAL, 0.0, failures, f"{kind}: retrying cannot help")

    if kind in BLAMES_PARAMS and can_roll_back:
        return RestartDecision(Action.ROLLBACK, 0.0, 0, f"{kind}: these parameters failed", known_good)

    if failures >= policy.max_failures:
        if can_roll_back:
            reason = f"{failures} consecutive failures: back to last-known-good"
            return RestartDecision(Action.ROLLBACK, 0.0, 0, reason, known_good)
        return RestartDecision(Action.FATAL, 0.0, failures, f"{failures} consecutive failures")

    delay = backoff_delay(policy, failures)
    return RestartDecision(
        Action.RETRY, delay, failures, f"failure {failures} of {policy.max_failures}", params
    )
