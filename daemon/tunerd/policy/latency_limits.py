"""The latency limits a trial's after window must keep (`[tuning] ttft_p95_max_s`, `itl_p95_max_s`,
`itl_p95_max_increase`): a change that breaks one is reverted whatever its objective gained
(policy/verdict.py). Pure: two windows and the settings in, the broken limit's text out.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunerd.config import TuningConfig
from tunerd.core.signal_window import quantile_bucket_of
from tunerd.policy.evidence import WindowStats


def limit_broken(before: WindowStats, after: WindowStats, tuning: TuningConfig) -> str | None:
    """A latency limit the after window broke: absolute limits where configured, and ITL p95 growing
    beyond `itl_p95_max_increase` of its value before.

    Only what was measured breaks a limit. Where the door timed every request (`door.ttft.p95`,
    `door.tpot.p95`: exact, the clients' view) those figures are read; otherwise vLLM's histogram
    percentiles, which are known only to their bucket: an absolute limit breaks when the after window's
    whole bucket lies above it (lower edge ≥ the limit), the increase only when the after window's bucket
    lies wholly above the one before and the interpolated values grew beyond the share. Issue 21: TTFT p95
    read 2.02 s, interpolated between the 1.0 and 2.5 s edges, while no client waited over 1.26 s; ITL p95
    read 9.5 ms in every window from the 0–10 ms bucket while the clients' ranged 1.6–4.6 ms."""
    ttft = _figure(after, _TTFT, after.ttft_p95)
    if tuning.ttft_p95_max_s is not None and ttft is not None and ttft.above(tuning.ttft_p95_max_s):
        return f"{ttft.what} {ttft.text(1.0, 's', 3)} is above the limit {tuning.ttft_p95_max_s:g} s"
    itl = _figure(after, _ITL, after.itl_p95)
    if tuning.itl_p95_max_s is not None and itl is not None and itl.above(tuning.itl_p95_max_s):
        limit = tuning.itl_p95_max_s * 1000
        return f"{itl.what} {itl.text(1000.0, 'ms', 1)} is above the limit {limit:g} ms"
    growth = tuning.itl_p95_max_increase
    if growth <= 0:
        return None
    b, a = _figure(before, _ITL, before.itl_p95), itl
    if b is None or a is None or b.exact != a.exact:  # like with like: the same statistic on both sides
        b, a = _figure(before, _ITL[1:], before.itl_p95), _figure(after, _ITL[1:], after.itl_p95)
    if b is None or a is None or not b.value or not a.grew(b, growth):
        return None
    return (
        f"{a.what} {b.text(1000.0, 'ms', 1)} → {a.text(1000.0, 'ms', 1)}: more than "
        f"{growth:.0%} worse (tuning.itl_p95_max_increase)"
    )


# (the door's exact signal, its text), then (vLLM's histogram percentile, its text): what a limit reads.
_TTFT = (("door.ttft.p95", "clients' TTFT p95 (door)"), ("ttft.p95", "TTFT p95"))
_ITL = (("door.tpot.p95", "clients' TPOT p95 (door)"), ("itl.p95", "ITL p95"))


@dataclass(frozen=True, slots=True)
class _Figure:
    """A window's latency percentile: exact (the door's per request), or vLLM's with the bucket
    `(lo, hi]` it falls in (None: no edges known, e.g. a window built without them)."""

    value: float
    exact: bool
    bucket: tuple[float, float] | None
    what: str

    def above(self, limit: float) -> bool:
        """Measured above `limit`: the whole bucket where there is one."""
        return self.bucket[0] >= limit if self.bucket is not None else self.value > limit

    def grew(self, before: _Figure, share: float) -> bool:
        """Grew beyond `share` of `before`, and (buckets) into a bucket wholly above before's."""
        if self.value <= before.value * (1 + share):
            return False
        return self.bucket is None or before.bucket is None or self.bucket[0] >= before.bucket[1]

    def text(self, scale: float, unit: str, digits: int) -> str:
        out = f"{self.value * scale:.{digits}f} {unit}"
        if self.bucket is not None:
            lo, hi = self.bucket
            top = "+Inf" if hi == float("inf") else f"{hi * scale:g}"
            out += f" (bucket {lo * scale:g}–{top} {unit})"
        return out


def _figure(window: WindowStats, names: tuple[tuple[str, str], ...], value: float | None) -> _Figure | None:
    """The door's exact figure where `names` has one and the window measured it, else vLLM's percentile
    (the last of `names`; its value `value`, the field the window carries) with its bucket."""
    *door, (name, what) = names
    exact = window.values.get(door[0][0]) if door else None
    if exact is not None:
        return _Figure(exact, True, None, door[0][1])
    if value is None:
        return None
    return _Figure(value, False, quantile_bucket_of(window.values, name), what)
