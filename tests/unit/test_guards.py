"""The pure guards of policy/guards.py with synthetic numbers: the host-memory emergency, the
memory-return gate, forward progress and the wedge verdict. Unknown readings never trigger."""

from __future__ import annotations

import pytest

from tunerd.core.machine import MemoryReading
from tunerd.policy.guards import (
    MemoryFloor,
    MemoryGate,
    Progress,
    memory_emergency,
    memory_returned,
    track_progress,
    wedged,
)

GIB = 1 << 30
FLOOR = MemoryFloor(min_available_bytes=2 * GIB, min_available_ratio=0.03, max_psi_full_avg10=60.0)


# -- memory_emergency ---------------------------------------------------------------------------------


def test_memavailable_under_the_byte_floor_is_an_emergency() -> None:
    reading = MemoryReading(64 * GIB, GIB, None, None)  # 3 % of 64 GiB = 1.92 GiB < 2 GiB
    assert memory_emergency(reading, FLOOR) == "MemAvailable 1.00 GiB below the floor of 2.00 GiB"


def test_the_ratio_floor_applies_when_it_is_the_larger() -> None:
    reading = MemoryReading(512 * GIB, 10 * GIB, None, None)  # 3 % of 512 GiB = 15.36 GiB
    assert memory_emergency(reading, FLOOR) == "MemAvailable 10.00 GiB below the floor of 15.36 GiB"
    assert memory_emergency(MemoryReading(512 * GIB, 16 * GIB, None, None), FLOOR) is None


def test_just_at_the_floor_is_no_emergency() -> None:
    assert memory_emergency(MemoryReading(64 * GIB, 2 * GIB, None, None), FLOOR) is None


def test_without_memtotal_only_the_byte_floor_applies() -> None:
    assert memory_emergency(MemoryReading(None, 3 * GIB, None, None), FLOOR) is None
    assert memory_emergency(MemoryReading(None, GIB, None, None), FLOOR) is not None


def test_full_pressure_above_the_ceiling_is_an_emergency_some_pressure_is_not() -> None:
    assert memory_emergency(MemoryReading(64 * GIB, 30 * GIB, 99.0, 60.0), FLOOR) is None
    assert (
        memory_emergency(MemoryReading(64 * GIB, 30 * GIB, 0.0, 60.5), FLOOR)
        == "memory pressure full avg10 60.5% above 60.0%"
    )


def test_unknown_readings_never_trigger_the_emergency() -> None:
    assert memory_emergency(MemoryReading(None, None, None, None), FLOOR) is None
    assert memory_emergency(MemoryReading(64 * GIB, None, 100.0, None), FLOOR) is None


# -- memory_returned ------------------------------------------------------------------------------------

GATE = MemoryGate(baseline_available_bytes=60 * GIB, tolerance_bytes=GIB, baseline_gpu_free_bytes=None)


def test_the_gate_holds_while_memavailable_is_below_baseline_minus_tolerance() -> None:
    back, why = memory_returned(GATE, 50 * GIB)
    assert not back
    assert why == "MemAvailable 50.00 GiB, waiting for 59.00 GiB (baseline 60.00 GiB - 1.00 GiB)"


def test_the_gate_opens_at_baseline_minus_tolerance() -> None:
    assert memory_returned(GATE, 59 * GIB) == (True, "memory back within tolerance of its baseline")
    assert memory_returned(GATE, 59 * GIB - 1)[0] is False


def test_an_unknown_reading_does_not_hold_the_gate() -> None:
    assert memory_returned(GATE, None)[0] is True


def test_the_gate_waits_for_gpu_memory_where_the_baseline_has_it() -> None:
    gate = MemoryGate(60 * GIB, GIB, baseline_gpu_free_bytes=140 * GIB)
    back, why = memory_returned(gate, 60 * GIB, 100 * GIB)
    assert not back and why == "GPU free 100.00 GiB, waiting for 139.00 GiB"
    assert memory_returned(gate, 60 * GIB, 139 * GIB)[0] is True
    assert memory_returned(gate, 60 * GIB, None)[0] is True  # NVML said nothing: not held


# -- track_progress / wedged ------------------------------------------------------------------------------


def test_missing_engine_data_leaves_the_progress_state_untouched() -> None:
    state = Progress(last_tokens=5.0, progress_at=10.0)
    assert track_progress(state, 99.0, running=None, generation_tokens=7.0) is state
    assert track_progress(state, 99.0, running=2.0, generation_tokens=None) is state


def test_the_first_sample_starts_the_clock() -> None:
    assert track_progress(Progress(), 5.0, running=2.0, generation_tokens=100.0) == Progress(100.0, 5.0, None)


def test_moving_tokens_idle_and_a_counter_reset_count_as_progress() -> None:
    start = Progress(last_tokens=100.0, progress_at=0.0)
    assert track_progress(start, 50.0, running=2.0, generation_tokens=101.0).progress_at == 50.0
    assert track_progress(start, 50.0, running=0.0, generation_tokens=100.0).progress_at == 50.0
    assert track_progress(start, 50.0, running=2.0, generation_tokens=3.0).progress_at == 50.0  # restart


def test_standing_tokens_with_requests_running_keep_the_old_progress_time() -> None:
    stalled = track_progress(Progress(100.0, 0.0), 50.0, running=2.0, generation_tokens=100.0)
    assert stalled.progress_at == 0.0 and stalled.last_tokens == 100.0


def test_a_busy_changing_gpu_is_progress_a_flat_one_is_not() -> None:
    state = Progress(100.0, 0.0, last_gpu_util=40.0)
    busy = track_progress(state, 50.0, running=2.0, generation_tokens=100.0, gpu_util=55.0)
    assert busy.progress_at == 50.0
    flat = track_progress(state, 50.0, running=2.0, generation_tokens=100.0, gpu_util=40.0)
    assert flat.progress_at == 0.0
    idle_gpu = track_progress(state, 50.0, running=2.0, generation_tokens=100.0, gpu_util=0.0)
    assert idle_gpu.progress_at == 0.0


@pytest.mark.parametrize(
    ("state", "running", "now"),
    [
        (Progress(), 2.0, 1000.0),  # never sampled
        (Progress(100.0, 0.0), None, 1000.0),  # running unknown
        (Progress(100.0, 0.0), 0.0, 1000.0),  # idle
        (Progress(100.0, 0.0), 2.0, 119.9),  # not long enough
    ],
    ids=["no-sample", "running-unknown", "idle", "short"],
)
def test_wedged_is_none_unless_requests_ran_stalled_for_after_s(
    state: Progress, running: float | None, now: float
) -> None:
    assert wedged(state, now, running=running, after_s=120.0) is None


def test_wedged_names_the_requests_the_counter_and_the_stall() -> None:
    reason = wedged(Progress(100.0, 0.0), 120.0, running=3.0, after_s=120.0)
    assert reason == "3 request(s) running but generation_tokens_total stuck at 100 for 120 s"


def test_a_stall_fed_sample_by_sample_turns_wedged_at_after_s() -> None:
    state = Progress()
    verdicts = []
    for now in range(0, 31, 5):
        state = track_progress(state, float(now), running=1.0, generation_tokens=42.0)
        verdicts.append(wedged(state, float(now), running=1.0, after_s=30.0))
    assert verdicts[:-1] == [None] * 6
    assert verdicts[-1] == "1 request(s) running but generation_tokens_total stuck at 42 for 30 s"
