"""The coordinate search on synthetic objective surfaces: it finds the optimum within tolerance, measures
no point twice, and costs about the sum of each parameter's steps."""

from __future__ import annotations

import math
from collections.abc import Callable

from tunerd.policy.explore import Search, ladder, limit_excess, midpoint, start
from tunerd.policy.objective import Throughput

Scored = tuple[float | None, float | None]  # (objective, limit excess)
Surface = Callable[[dict[str, object]], float | Scored | None]


def explore(search: Search, surface: Surface, limit: int = 200) -> tuple[Search, list[tuple[str, object]]]:
    """Run a search to its end against `surface` (an objective, or (objective, limit excess)); returns it
    and the points it measured, in order."""
    visited: list[tuple[str, object]] = []
    for _ in range(limit):
        search, point = search.next_point()
        if point is None:
            return search, visited
        param, value = point
        assert point not in visited, f"{point} measured twice"
        visited.append(point)
        scored = surface({**search.best, param: value})
        objective, excess = scored if isinstance(scored, tuple) else (scored, None)
        search = search.record(param, value, objective, excess)
    raise AssertionError("the search did not end")


def seqs_search(current: int, objective: float | None, tolerance: float = 0.03) -> Search:
    values = ladder("max_num_seqs", current, backend="cpu", bounds={"max_num_seqs": (1, 256)})
    return start(
        ["max_num_seqs"],
        {"max_num_seqs": current},
        {"max_num_seqs": values},
        goal=Throughput(tolerance=tolerance),
        objective=objective,
    )


def peak_at(best: float) -> Surface:
    """Throughput that falls off on both sides of `best` (log scale): unimodal."""
    return lambda config: (
        3000.0 * math.exp(-((math.log2(float(config["max_num_seqs"])) - math.log2(best)) ** 2) / 2)
    )


def test_the_ladder_is_powers_of_two_within_the_bounds_with_the_current_value() -> None:
    assert ladder("max_num_seqs", 24, backend="cpu", bounds={"max_num_seqs": (4, 64)}) == (
        4,
        8,
        16,
        24,
        32,
        64,
    )
    assert ladder("block_size", 32, backend="cpu") == (32, 64, 128)
    assert ladder("enable_chunked_prefill", True, backend="cuda") == (False, True)
    util = ladder("gpu_memory_utilization", 0.9, backend="cuda", unified=True, unified_cap=0.85)
    assert max(util) == 0.9 and 0.85 in util and all(v <= 0.85 for v in util if v != 0.9)


def test_a_midpoint_is_geometric_and_none_between_neighbours() -> None:
    assert midpoint(8, 16, True) == 11
    assert midpoint(16, 8, True) == 11
    assert midpoint(2, 3, True) is None
    assert midpoint(0.8, 0.85, False) == 0.825


def test_a_unimodal_surface_is_climbed_to_its_peak_from_above() -> None:
    surface = peak_at(16)
    search, visited = explore(seqs_search(128, surface({"max_num_seqs": 128})), surface)
    assert search.best["max_num_seqs"] == 16
    assert search.done
    # 128 → 64 → 32 → 16 → 8 (worse): steps down, then the midpoints around 16 (23, 11).
    assert [v for _, v in visited] == [256, 64, 32, 16, 8, 23, 11]


def test_the_peak_between_ladder_values_is_found_by_the_midpoints() -> None:
    surface = peak_at(11.3)
    search, _ = explore(seqs_search(32, surface({"max_num_seqs": 32})), surface)
    assert search.best["max_num_seqs"] == 11
    assert search.best_objective == surface({"max_num_seqs": 11})


def test_a_plateau_stops_after_one_step_each_way_and_the_midpoints() -> None:
    search, visited = explore(seqs_search(32, 2000.0), lambda _c: 2000.0)
    assert search.best["max_num_seqs"] == 32
    assert len(visited) == 4  # 64 and 16, then 45 and 23: nothing improved by more than the tolerance


def test_noise_within_the_tolerance_does_not_move_the_best() -> None:
    wobble = iter([1.02, 0.99, 1.01, 0.98, 1.02, 1.0, 0.97, 1.01])
    search, _ = explore(seqs_search(32, 2000.0, tolerance=0.05), lambda _c: 2000.0 * next(wobble))
    assert search.best["max_num_seqs"] == 32


def test_a_region_that_fails_is_never_chosen_and_not_crossed() -> None:
    def surface(config: dict[str, object]) -> float | None:
        n = float(config["max_num_seqs"])  # type: ignore[arg-type]
        return None if n > 64 else 100.0 * n  # more is better, until the start fails (out of memory)

    search, visited = explore(seqs_search(16, 1600.0), surface)
    assert search.best["max_num_seqs"] == 64
    assert ("max_num_seqs", 128) in visited and ("max_num_seqs", 256) not in visited
    assert search.measured[("max_num_seqs", 128)] is None


def test_known_points_are_not_measured_again() -> None:
    surface = peak_at(16)
    first, visited_first = explore(seqs_search(64, surface({"max_num_seqs": 64})), surface)
    values = ladder("max_num_seqs", 64, backend="cpu", bounds={"max_num_seqs": (1, 256)})
    again = start(
        ["max_num_seqs"], {"max_num_seqs": 64}, {"max_num_seqs": values},
        goal=Throughput(tolerance=0.03), objective=surface({"max_num_seqs": 64}), known=first.measured,
    )  # fmt: skip
    second, visited_second = explore(again, surface)
    assert second.best == first.best
    assert len(visited_second) < len(visited_first)
    assert not visited_second  # everything it would measure is known already


def test_two_parameters_cost_the_sum_of_their_steps_not_the_product() -> None:
    def surface(config: dict[str, object]) -> float:
        seqs = math.log2(float(config["max_num_seqs"]))  # type: ignore[arg-type]
        tokens = math.log2(float(config["max_num_batched_tokens"]))  # type: ignore[arg-type]
        return 5000.0 - 100 * (seqs - 4) ** 2 - 100 * (tokens - 11) ** 2  # best at 16 and 2048

    current = {"max_num_seqs": 64, "max_num_batched_tokens": 8192}
    ladders = {
        "max_num_seqs": ladder("max_num_seqs", 64, backend="cpu", bounds={"max_num_seqs": (1, 256)}),
        "max_num_batched_tokens": ladder(
            "max_num_batched_tokens", 8192, backend="cpu", bounds={"max_num_batched_tokens": (256, 16384)}
        ),
    }
    search = start(
        list(current), current, ladders, goal=Throughput(tolerance=0.01), objective=surface(current)
    )
    search, visited = explore(search, surface)
    assert search.best == {"max_num_seqs": 16, "max_num_batched_tokens": 2048}
    grid = len(ladders["max_num_seqs"]) * len(ladders["max_num_batched_tokens"])
    assert len(visited) <= 16 < grid  # a handful of steps each, against the grid's 54 points


def test_block_size_visits_only_the_backends_allowed_values() -> None:
    # The CPU run of bench/tuner_vs_sweep.py explored block_size 64, then the "midpoint" 91, which vLLM
    # refuses (a multiple of 32 on CPU): a parameter with choices has no midpoints.
    values = ladder("block_size", 128, backend="cpu")
    search = start(
        ["block_size"],
        {"block_size": 128},
        {"block_size": values},
        goal=Throughput(tolerance=0.03),
        objective=100.0,
    )
    _, visited = explore(search, lambda _c: 100.0)
    assert visited == [("block_size", 64)]


def ttft_surface(ttft_of: Callable[[int], float], limit: float) -> Callable[[dict[str, object]], Scored]:
    """A point's (objective, limit excess): throughput 100·n while TTFT meets `limit`, else infeasible."""

    def surface(config: dict[str, object]) -> Scored:
        n = int(config["max_num_seqs"])  # type: ignore[call-overload]
        ttft = ttft_of(n)
        excess = limit_excess(ttft, None, ttft_max=limit, itl_max=None)
        return (100.0 * n if excess is None else None), excess

    return surface


def test_limit_excess_is_the_worst_limit_broken_and_none_within_the_limits() -> None:
    assert limit_excess(19.5, 0.1, ttft_max=10.0, itl_max=0.2) == 1.95
    assert limit_excess(5.0, 0.5, ttft_max=10.0, itl_max=0.2) == 2.5
    assert limit_excess(9.9, 0.19, ttft_max=10.0, itl_max=0.2) is None
    assert limit_excess(99.0, 9.0, ttft_max=None, itl_max=None) is None


def test_a_start_over_the_latency_limit_moves_towards_the_limit_until_a_point_meets_it() -> None:
    # bench/tuner_vs_sweep.py, seed 1: the defaults broke the TTFT limit (19.5 s against 10 s), every
    # point the exploration tried broke it too, and with nothing feasible to rank tunerd stood still.
    surface = ttft_surface(lambda n: 0.6 * n, limit=10.0)  # fewer sequences queue less: TTFT falls with n
    objective, excess = surface({"max_num_seqs": 32})
    assert objective is None and excess is not None
    values = ladder("max_num_seqs", 32, backend="cpu", bounds={"max_num_seqs": (1, 256)})
    search = start(
        ["max_num_seqs"], {"max_num_seqs": 32}, {"max_num_seqs": values},
        goal=Throughput(tolerance=0.05), objective=objective, excess=excess,
    )  # fmt: skip
    search, visited = explore(search, surface)
    assert ("max_num_seqs", 16) in visited and ("max_num_seqs", 64) in visited
    assert search.best == {"max_num_seqs": 16} and search.best_objective == 1600.0  # 9.6 s: feasible
    assert search.best_excess is None


def test_when_nothing_meets_the_limit_the_least_excess_wins_and_a_failure_never_does() -> None:
    def surface(config: dict[str, object]) -> Scored:
        n = int(config["max_num_seqs"])  # type: ignore[call-overload]
        if n >= 64:
            return None, None  # these starts fail (out of memory)
        return None, limit_excess(10.0 + abs(n - 8), None, ttft_max=5.0, itl_max=None)  # 2.0× at best

    values = ladder("max_num_seqs", 32, backend="cpu", bounds={"max_num_seqs": (1, 64)})
    search = start(
        ["max_num_seqs"], {"max_num_seqs": 32}, {"max_num_seqs": values},
        goal=Throughput(tolerance=0.05), objective=None, excess=surface({"max_num_seqs": 32})[1],
    )  # fmt: skip
    search, visited = explore(search, surface)
    assert visited[0] == ("max_num_seqs", 64) and search.measured[("max_num_seqs", 64)] is None
    assert search.best == {"max_num_seqs": 8} and search.best_objective is None
    assert search.best_excess == 2.0


def test_a_feasible_best_is_never_traded_for_an_infeasible_point() -> None:
    search = seqs_search(16, 1600.0)
    moved = search.record("max_num_seqs", 32, None, 1.01)
    assert moved.best == {"max_num_seqs": 16} and moved.best_objective == 1600.0
