"""Byte units and how the planner writes byte counts for people (pure)."""

from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20


def gib_text(n: int | float | None) -> str:
    """A byte count for a reason line: GiB with 2 decimals, or MiB / bytes when smaller; "?" for None."""
    if n is None:
        return "?"
    if abs(n) >= GiB / 10:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{int(n):,} bytes"


def bytes_text(n: int | None) -> str:
    """A byte count for a table cell: GiB or MiB with 2 decimals plus the exact bytes; "-" for None."""
    if n is None:
        return "-"
    if abs(n) >= GiB:
        return f"{n / GiB:,.2f} GiB ({n:,} B)"
    if abs(n) >= MiB:
        return f"{n / MiB:,.2f} MiB ({n:,} B)"
    return f"{n:,} B"
