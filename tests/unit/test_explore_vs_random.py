"""The exploration against random search at equal restarts, on seeded landscapes with this box's noise
(issue 22, Done-when: "the explorer beats random search at equal restarts on the median of ≥ 20 seeded
landscapes"). The real search (`policy/explore.Search`) is driven probe by probe, as tune/explorer.py
drives it; what is compared is the TRUE value of each one's final choice.

The landscapes: generation throughput over `max_num_seqs` (1..256) × `max_num_batched_tokens`
(256..16384), both powers-of-two ladders as `policy/explore.ladder` builds them. Each is a product of
two bumps in log2 of the value, the peak anywhere within the ladder: a narrow side (1–2.5 octaves) and a
wide one (1.5–6 octaves; at the wide end a plateau, like the CPU grid of docs/benchmarks.md where every
`max_num_seqs` ≥ 8 served within the noise); `max_num_batched_tokens` matters less (2–6 octaves). The
search starts from a random ladder point (the configuration in force).

The noise, multiplicative and log-normal, from this box (docs/benchmarks.md, bench/probe_spread.py):
- between starts, σ = 0.10: vLLM's defaults measured 156.2, 171.7, 151.9 and 132.5 tok/s in four
  starts (a relative standard deviation of 0.105, its window's noise included);
- between probes of one start, σ = 0.42: five `tunerd probe` runs on the quickstart model spread 99 %
  around their median, and the range of five normal draws is about 2.33 σ.
The search is told the first (`start_noise`, what an operator sets in `tuning.start_noise`) and
estimates the second from its own probes.

Random search: the same number of restarts as the exploration spent, at distinct random points of the
same ladder grid, each measured once (one start, one probe) with the same noise; the best measured one
(or the configuration in force, measured as the exploration measured it, if none beats it) is chosen.
Its expected result on a landscape is the mean over many such draws.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

from tunerd.policy.explore import Search, ladder, start
from tunerd.policy.objective import Throughput

START_NOISE = 0.10  # σ of log throughput between starts: docs/benchmarks.md, four starts of the defaults
PROBE_NOISE = 0.42  # σ of log throughput between probes of one start: bench/probe_spread.py's 99 % range
PROBES = 3  # tuning.explore_probes' default
FLOOR = 0.03  # tuning.explore_tolerance's default
LANDSCAPES = 100
RANDOM_DRAWS = 50

SEQS = ladder("max_num_seqs", 1, backend="cpu", bounds={"max_num_seqs": (1, 256)})
TOKENS = ladder("max_num_batched_tokens", 256, backend="cpu", bounds={"max_num_batched_tokens": (256, 16384)})
Config = dict[str, float]
Landscape = Callable[[Config], float]


def bump(rng: random.Random, low: float, high: float, narrow: tuple[float, float], wide: tuple[float, float]):
    """A unimodal factor in log2 of a value: its peak in [low, high], one side narrow, one wide."""
    peak, a, b = rng.uniform(low, high), rng.uniform(*narrow), rng.uniform(*wide)
    left, right = (a, b) if rng.random() < 0.5 else (b, a)

    def factor(value: float) -> float:
        x = math.log2(value) - peak
        return math.exp(-((x / (left if x < 0 else right)) ** 2) / 2)

    return factor


def landscape(seed: int) -> tuple[Landscape, Config]:
    """A seeded throughput surface and the configuration in force where its search starts."""
    rng = random.Random(seed)
    seqs = bump(rng, 0, 8, (1.0, 2.5), (1.5, 6.0))
    tokens = bump(rng, 8, 14, (2.0, 4.0), (2.0, 6.0))
    top = rng.uniform(100, 4000)  # tok/s: a small CPU model to an H200's

    def truth(config: Config) -> float:
        return top * seqs(config["max_num_seqs"]) * tokens(config["max_num_batched_tokens"])

    return truth, {"max_num_seqs": rng.choice(SEQS), "max_num_batched_tokens": rng.choice(TOKENS)}


class Engine:
    """Measures a configuration as this box does: one noise draw per start, one per probe."""

    def __init__(self, truth: Landscape, rng: random.Random) -> None:
        self.truth, self.rng, self.start_effect = truth, rng, 1.0

    def restart(self) -> None:
        self.start_effect = math.exp(self.rng.gauss(0, START_NOISE))

    def probe(self, config: Config) -> float:
        return self.truth(config) * self.start_effect * math.exp(self.rng.gauss(0, PROBE_NOISE))


def explore(
    truth: Landscape,
    current: Config,
    rng: random.Random,
    ladders: dict[str, tuple[float, ...]] | None = None,
) -> tuple[Config, int, float]:
    """The real search over `ladders` (default: max_num_seqs and max_num_batched_tokens) to its end:
    (its choice, the restarts it spent, the mean of the baseline's probes)."""
    ladders = ladders or {"max_num_seqs": SEQS, "max_num_batched_tokens": TOKENS}
    engine = Engine(truth, rng)
    engine.restart()
    baseline = [engine.probe(current) for _ in range(PROBES)]
    search: Search = start(
        list(ladders), current, ladders,
        goal=Throughput(tolerance=FLOOR), objective=statistics.fmean(baseline), samples=baseline,
        probes=PROBES, start_noise=START_NOISE,
    )  # fmt: skip
    restarts = 0
    while True:
        search, point = search.next_point()
        if point is None:
            break
        param, value = point
        config = {**current, **search.best, param: value}
        engine.restart()
        restarts += 1
        search = search.record(param, value, engine.probe(config))
        while search.again == point:  # confirmations: more probes of the same start
            search = search.record(param, value, engine.probe(config))
    return {**current, **search.best}, restarts, statistics.fmean(baseline)


GRID = [{"max_num_seqs": s, "max_num_batched_tokens": t} for s in SEQS for t in TOKENS]


def random_search(
    truth: Landscape, current: Config, baseline: float, restarts: int, rng: random.Random, probes: int = 1
) -> Config:
    """`restarts` distinct random grid points, each one start and `probes` probes (their mean); the best
    measured wins."""
    engine = Engine(truth, rng)
    best, best_measured = current, baseline
    for config in rng.sample([c for c in GRID if c != current], restarts):
        engine.restart()
        measured = statistics.fmean(engine.probe(config) for _ in range(probes))
        if measured > best_measured:
            best, best_measured = config, measured
    return best


def compare(probes: int) -> tuple[list[float], list[int]]:
    """Per landscape: the true value of the exploration's choice over random search's expected one (at
    the restarts the exploration spent, its points measured with `probes` probes each), and those
    restarts."""
    ratios, restarts_spent = [], []
    for seed in range(LANDSCAPES):
        truth, current = landscape(seed)
        rng = random.Random(1000 + seed)
        choice, restarts, baseline = explore(truth, current, rng)
        theirs = [
            truth(random_search(truth, current, baseline, restarts, rng, probes)) for _ in range(RANDOM_DRAWS)
        ]
        ratios.append(truth(choice) / statistics.fmean(theirs))
        restarts_spent.append(restarts)
    return ratios, restarts_spent


def say(what: str, ratios: list[float], restarts: list[int]) -> None:
    wins, quartiles = sum(r > 1 for r in ratios), statistics.quantiles(ratios, n=4)
    print(
        f"\nexplorer vs {what}, at equal restarts, {LANDSCAPES} landscapes (start noise {START_NOISE}, "
        f"probe noise {PROBE_NOISE}, {PROBES} probes, floor {FLOOR}): win rate {wins}/{LANDSCAPES} = "
        f"{wins / LANDSCAPES:.0%}, median ratio {statistics.median(ratios):.3f} "
        f"(quartiles {quartiles[0]:.3f}..{quartiles[2]:.3f}); "
        f"restarts median {statistics.median(restarts)} ({min(restarts)}..{max(restarts)})"
    )


def test_the_explorer_beats_random_search_at_equal_restarts_on_the_median_landscape() -> None:
    ratios, restarts = compare(probes=1)
    say("random search (one probe a point)", ratios, restarts)
    assert statistics.median(ratios) > 1.0
    # Said, not asserted: random search whose points get as many probes as the exploration's may.
    say(f"random search ({PROBES} probes a point)", *compare(probes=PROBES))
