"""What stops a fired rule from acting: the restart budget, maintenance windows, the mode, a pause, a
running trial, too little serving time, and flip-flops. Fixed wall times and aware datetimes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from tunerd.config import MaintenanceWindow, TuningConfig
from tunerd.policy.gates import (
    DAY_S,
    HOUR_S,
    Budget,
    budget,
    flip_flop,
    why_not_act,
    window_open,
    window_opened_at,
)

NOW = 1_750_000_000.0  # a wall time (epoch seconds)
NIGHTLY = MaintenanceWindow(cron="0 2 * * *", duration_s=7200)


def at(hour: int, minute: int = 0, tz: timezone = UTC) -> datetime:
    return datetime(2025, 3, 14, hour, minute, tzinfo=tz)


# -- the restart budget ----------------------------------------------------------------------------


def test_no_past_restarts_leave_the_whole_budget() -> None:
    assert budget([], NOW, TuningConfig(restarts_per_hour=4, restarts_per_day=24)) == Budget(4, 24)


def test_restarts_within_the_hour_count_against_both_budgets() -> None:
    left = budget([NOW - 60, NOW - 1800], NOW, TuningConfig(restarts_per_hour=4, restarts_per_day=24))
    assert left == Budget(2, 22)


def test_a_restart_over_an_hour_ago_counts_against_the_day_only() -> None:
    left = budget([NOW - HOUR_S - 1], NOW, TuningConfig(restarts_per_hour=4, restarts_per_day=24))
    assert left == Budget(4, 23)


def test_a_restart_over_a_day_ago_counts_against_neither() -> None:
    left = budget([NOW - DAY_S - 1], NOW, TuningConfig(restarts_per_hour=4, restarts_per_day=24))
    assert left == Budget(4, 24)


def test_a_restart_exactly_an_hour_ago_no_longer_counts_for_the_hour() -> None:
    assert budget([NOW - HOUR_S], NOW, TuningConfig(restarts_per_hour=1)).hour_left == 1


def test_the_budget_left_is_the_smaller_of_hour_and_day() -> None:
    times = [NOW - HOUR_S - 10 * i for i in range(1, 4)]  # three restarts earlier today
    left = budget(times, NOW, TuningConfig(restarts_per_hour=4, restarts_per_day=3))
    assert (left.hour_left, left.day_left, left.left) == (4, 0, 0)


def test_an_overspent_budget_is_zero_not_negative() -> None:
    left = budget([NOW - i for i in range(10)], NOW, TuningConfig(restarts_per_hour=4, restarts_per_day=6))
    assert left == Budget(0, 0)


# -- maintenance windows ---------------------------------------------------------------------------


def test_no_windows_means_always_open() -> None:
    assert window_open([], at(13, 17))


def test_a_window_is_open_inside_its_duration() -> None:
    assert window_open([NIGHTLY], at(2, 30))


def test_a_window_is_closed_after_its_duration() -> None:
    assert not window_open([NIGHTLY], at(5, 0))


def test_a_window_is_closed_before_it_starts() -> None:
    assert not window_open([NIGHTLY], at(1, 59))


def test_a_window_is_open_at_its_start() -> None:
    assert window_open([NIGHTLY], at(2, 0))


def test_any_of_several_windows_opens() -> None:
    lunch = MaintenanceWindow(cron="0 12 * * *", duration_s=1800)
    assert window_open([NIGHTLY, lunch], at(12, 10))
    assert not window_open([NIGHTLY, lunch], at(12, 40))


def test_a_weekday_window_is_closed_on_other_days() -> None:
    sundays = MaintenanceWindow(cron="0 2 * * sun", duration_s=7200)
    assert not window_open([sundays], at(2, 30))  # 2025-03-14 is a Friday
    assert window_open([sundays], datetime(2025, 3, 16, 2, 30, tzinfo=UTC))


def test_a_window_that_opened_yesterday_evening_is_open_past_midnight() -> None:
    late = MaintenanceWindow(cron="0 23 * * *", duration_s=4 * 3600)
    assert window_open([late], at(1, 0))


def test_a_window_reads_the_cron_in_the_timezone_of_now() -> None:
    plus_two = timezone(timedelta(hours=2))
    assert window_open([NIGHTLY], at(2, 30, plus_two))
    assert not window_open([NIGHTLY], at(0, 30, UTC))  # the same instant, in UTC


# -- why not act -----------------------------------------------------------------------------------


def blocked(**changes: Any) -> str | None:
    tuning = changes.pop("tuning", TuningConfig(min_serving_s=300))
    args: dict[str, Any] = {
        "tuning": tuning,
        "paused": False,
        "trial_running": False,
        "budget_left": Budget(4, 24),
        "served_s": 600.0,
        "now": at(13, 0),
    }
    args.update(changes)
    return why_not_act(**args)


def test_nothing_blocks_an_act_when_every_gate_is_open() -> None:
    assert blocked() is None


def test_tuning_mode_off_blocks() -> None:
    assert blocked(tuning=TuningConfig(mode="off")) == "tuning.mode is off"


def test_dry_run_does_not_block() -> None:
    assert blocked(tuning=TuningConfig(mode="dry-run", min_serving_s=300)) is None


def test_a_pause_blocks() -> None:
    assert blocked(paused=True) == "tuning is paused (tunerd resume)"


def test_a_running_trial_blocks() -> None:
    assert blocked(trial_running=True) == "a trial is running"


def test_too_little_serving_time_blocks() -> None:
    reason = blocked(served_s=120.0)
    assert reason is not None
    assert "120 s" in reason
    assert "min_serving_s 300" in reason


def test_unknown_serving_time_blocks() -> None:
    reason = blocked(served_s=None)
    assert reason is not None
    assert "0 s" in reason


def test_a_spent_hourly_budget_blocks() -> None:
    reason = blocked(budget_left=Budget(0, 10))
    assert reason is not None
    assert reason.startswith("restart budget spent")


def test_a_spent_daily_budget_blocks() -> None:
    reason = blocked(budget_left=Budget(3, 0))
    assert reason is not None
    assert reason.startswith("restart budget spent")


def test_outside_the_maintenance_windows_blocks() -> None:
    tuning = TuningConfig(min_serving_s=300, maintenance=[NIGHTLY])
    assert blocked(tuning=tuning, now=at(13, 0)) == "outside the maintenance windows"


def test_inside_a_maintenance_window_does_not_block() -> None:
    tuning = TuningConfig(min_serving_s=300, maintenance=[NIGHTLY])
    assert blocked(tuning=tuning, now=at(2, 30)) is None


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"tuning": TuningConfig(mode="off"), "paused": True, "trial_running": True}, "tuning.mode is off"),
        ({"paused": True, "trial_running": True, "served_s": 1.0}, "tuning is paused (tunerd resume)"),
        ({"trial_running": True, "served_s": 1.0, "budget_left": Budget(0, 0)}, "a trial is running"),
    ],
)
def test_the_first_reason_that_applies_is_given(changes: dict[str, Any], expected: str) -> None:
    assert blocked(**changes) == expected


# -- flip-flops ------------------------------------------------------------------------------------

KEPT = [(NOW - 600, "max_num_seqs", 256, 128)]


def test_undoing_a_change_kept_within_tabu_s_is_a_flip_flop() -> None:
    reason = flip_flop("max_num_seqs", 256, KEPT, NOW, tabu_s=3600)
    assert reason is not None
    assert "max_num_seqs 256 → 128" in reason


def test_undoing_a_change_kept_longer_ago_than_tabu_s_is_not_a_flip_flop() -> None:
    assert flip_flop("max_num_seqs", 256, KEPT, NOW, tabu_s=600) is None


def test_moving_further_in_the_kept_direction_is_not_a_flip_flop() -> None:
    assert flip_flop("max_num_seqs", 64, KEPT, NOW, tabu_s=3600) is None


def test_a_change_of_another_parameter_is_not_a_flip_flop() -> None:
    assert flip_flop("max_num_batched_tokens", 256, KEPT, NOW, tabu_s=3600) is None


def test_undoing_the_latest_of_several_kept_changes_is_a_flip_flop() -> None:
    kept = [(NOW - 3000, "max_num_seqs", 512, 256), *KEPT]
    assert flip_flop("max_num_seqs", 256, kept, NOW, tabu_s=3600) is not None


def test_no_kept_changes_no_flip_flop() -> None:
    assert flip_flop("max_num_seqs", 256, [], NOW, tabu_s=3600) is None


def test_a_window_is_known_by_when_it_opened_so_each_opening_counts_once() -> None:
    opened = at(2, 0).timestamp()
    assert window_opened_at([NIGHTLY], at(2, 0)) == opened
    assert window_opened_at([NIGHTLY], at(3, 59)) == opened  # the same window, later in it
    assert window_opened_at([NIGHTLY], at(4, 1)) is None  # closed after its 2 h
    assert window_opened_at([NIGHTLY], at(1, 59)) is None
    tomorrow = (at(2, 30) + timedelta(days=1)).replace(minute=0)
    assert window_opened_at([NIGHTLY], tomorrow) == opened + DAY_S  # the next night's: a new opening
