"""The work people do, as the goodput proof runs it (issue 23): seeded workloads with their latency targets
fixed before any run, and the figures of one window as the clients measured them.

A workload is streamed (TTFT needs the first token), cache-cold and `ignore_eos` (tests/load.py), its
prompt and output lengths drawn per request from its seed:
- `open`: Poisson arrivals at `rate_per_s` whatever is in flight (real traffic does not wait for its last
  answer);
- `closed`: `clients` clients, each sending its next request when the last one is answered;
- `interactive`: a few clients that read each answer for a while (`think_s`, exponential) before the next
  one — the single-team DGX Spark case, where a second request waiting behind the first is a complaint.

A request is good when its TTFT ≤ `ttft_s` and its TPOT ≤ `tpot_s` (a one-token answer has no TPOT and is
judged by its TTFT), as tunerd's door judges it (docs/objective.md) but on the load generator's clock.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from tests.load import Answer, ClosedLoopLoad, OpenLoopLoad


@dataclass(frozen=True)
class Workload:
    """One workload and its targets. `kind`: open | closed | interactive."""

    name: str
    kind: str
    ttft_s: float
    tpot_s: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    rate_per_s: float = 0.0  # open
    clients: int = 0  # closed, interactive
    think_s: float = 0.0  # interactive
    vocab: int = 1000

    def load(self, base_url: str, model: str, seed: int) -> ClosedLoopLoad | OpenLoopLoad:
        """The workload's load generator, not started."""
        common: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.output_tokens,
            "vocab": self.vocab,
            "stream": True,
            "seed": seed,
            "timeout_s": 600.0,
        }
        if self.kind == "open":
            return OpenLoopLoad(base_url, model, rate_per_s=self.rate_per_s, **common)
        return ClosedLoopLoad(base_url, model, clients=self.clients, think_s=self.think_s, **common)

    def describe(self) -> str:
        shape = {
            "open": f"Poisson arrivals at {self.rate_per_s:g} req/s",
            "closed": f"{self.clients} closed-loop clients",
            "interactive": f"{self.clients} clients reading each answer ~{self.think_s:g} s",
        }[self.kind]
        return (
            f"{shape}; prompts {self.prompt_tokens[0]}–{self.prompt_tokens[1]} tokens, answers "
            f"{self.output_tokens[0]}–{self.output_tokens[1]}; targets TTFT ≤ {self.ttft_s:g} s, "
            f"TPOT ≤ {self.tpot_s * 1e3:g} ms"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def good(answer: Answer, workload: Workload) -> bool:
    """The answer met both targets."""
    tpot_ok = answer.tpot_s is None or answer.tpot_s <= workload.tpot_s
    return answer.ttft_s <= workload.ttft_s and tpot_ok


def quantile(values: list[float], share: float) -> float | None:
    """The nearest-rank quantile, None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def window_figures(answers: list[Answer], workload: Workload, start: float, end: float) -> dict[str, Any]:
    """The clients' figures of the answers that ended in [start, end): goodput (good answers a second),
    attainment (good ÷ answered), throughput (their tokens a second), TTFT and TPOT p50/p95."""
    inside = [a for a in answers if start <= a.done < end]
    seconds = end - start
    ok = [a for a in inside if good(a, workload)]
    ttft = [a.ttft_s for a in inside]
    tpot = [a.tpot_s for a in inside if a.tpot_s is not None]
    return {
        "seconds": round(seconds, 1),
        "answered": len(inside),
        "good": len(ok),
        "goodput": len(ok) / seconds,
        "attainment": len(ok) / len(inside) if inside else None,
        "throughput": sum(a.tokens for a in inside) / seconds,
        "ttft_p50": quantile(ttft, 0.5),
        "ttft_p95": quantile(ttft, 0.95),
        "tpot_p50": quantile(tpot, 0.5),
        "tpot_p95": quantile(tpot, 0.95),
    }


def rolling_attainment(
    answers: list[Answer], workload: Workload, start: float, end: float, width_s: float, step_s: float
) -> list[tuple[float, float | None, float, float]]:
    """(seconds from start, attainment, goodput, throughput) of the answers ending in each window of
    `width_s` ending every `step_s`: the time series the plots draw and "first feasible" reads."""
    points = []
    t = start + width_s
    while t <= end:
        f = window_figures(answers, workload, t - width_s, t)
        points.append((t - start, f["attainment"], f["goodput"], f["throughput"]))
        t += step_s
    return points


def spread(values: list[float]) -> dict[str, float | None]:
    """Mean, min, max and CV of repeated figures."""
    if not values:
        return {"mean": None, "min": None, "max": None, "cv": None}
    mean = statistics.fmean(values)
    cv = statistics.stdev(values) / mean if len(values) > 1 and mean else None
    return {"mean": mean, "min": min(values), "max": max(values), "cv": cv}
