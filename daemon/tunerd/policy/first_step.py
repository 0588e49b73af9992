"""The first step of `max_num_seqs` under KV pressure, from the KV cache's arithmetic (pure; issue 22).

Halving a limit under KV pressure is blind (1024 → 512 → …, a restart each), while how many requests fit
without preemption is arithmetic: the KV cache in tokens (vLLM's "KV cache size: N tokens" line, else the
planner's prediction) over what one request holds at its end. So the first step goes there, and the rule's
direction (its factor) stays the fallback when the arithmetic has no input or lands nowhere useful. With no
request finished in the before window (a slow box's long requests), the run so far gives the request's
size (the journal's arithmetic says so).

- **What a request holds.** Its prompt plus its whole output, in blocks: vLLM allocates the KV cache in
  blocks of `block_size` tokens, so a request of t tokens holds ceil(t / block_size) blocks, and the pool
  keeps one block out (the BlockPool's null block: planner/kv_math.py). The output counted is the window's
  generated tokens per finished request (policy/evidence: generation over completions — in a steady window
  the tokens of requests in flight, part-way, stand for the part-way tokens the finished ones had before
  it). A request is counted at its full length, not half of it: requests of a closed loop start together
  and stay in phase, so all of them reach their full length at once; the limit where that still fits
  preempts none.
- **Values the backend runs fast.** On CUDA, vLLM replays a CUDA graph only for a batch of a captured size
  (`cudagraph_capture_sizes` in its engine config line, engine/logwatch.CaptureSizes); on the H200,
  max_num_seqs 23 left graphs for 5 sizes (up to 16) and served half of what the door's cap at 24 did on
  the default (issue 22). The value is rounded DOWN to a captured size (down: fewer requests still fit),
  to vLLM's default list (1, 2, 4, then multiples of 8) when the sizes were not logged; with no graphs (an
  eager start's empty list, the CPU backend) any integer runs as fast.
- **Never where it cannot help or already lost**: within the bounds, below the value in force, not a tabu
  value nor past one (a step never jumps over one), and not at or below a concurrency the door's cap
  already lost under this load (`LostCap`: its controller saw requests miss their targets only by the
  door's wait at that cap, door/limit.py `too_low`: vLLM running that many at once is what the cap
  measured, and a smaller limit only moves the wait into vLLM's queue).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tunerd.core.params import Backend

MODEL = "kv model"  # Proposal.proposed_by of a value this module computed
# vLLM's default capture sizes below 8 (its list is 1, 2, 4, then multiples of 8: default_cold.log).
_SMALL_SIZES = (1, 2, 4)


@dataclass(frozen=True, slots=True)
class LostCap:
    """A concurrency the door's cap lost under the load in force: `value` requests in flight missed the
    targets by the door's wait (a larger cap was needed); `why` says where that was seen."""

    value: int
    why: str


@dataclass(frozen=True, slots=True)
class KvShape:
    """What the arithmetic reads: the KV cache in tokens and where that figure comes from, the block size,
    the window's prompt and generated tokens per finished request, and the capture sizes vLLM logged
    (None: not logged; empty: no graphs)."""

    kv_tokens: int | None
    kv_source: str
    block_size: int
    prompt_tokens: float | None
    output_tokens: float | None
    backend: Backend
    capture_sizes: tuple[int, ...] | None = None
    sizes_from: str | None = None  # where the tokens per request come from, when not the before window


@dataclass(frozen=True, slots=True)
class FirstStep:
    """The model's value and its arithmetic, as the journal tells it."""

    value: int
    arithmetic: str


@dataclass(frozen=True, slots=True)
class NoFirstStep:
    """Why the model proposes nothing (the rule's step is the fallback); `arithmetic` when it got that far."""

    reason: str
    arithmetic: str | None = None


def kv_first_step(
    shape: KvShape,
    *,
    current: int,
    bounds: tuple[float, float],
    tabu: Mapping[tuple[str, object], str] | None = None,
    lost: Sequence[LostCap] = (),
) -> FirstStep | NoFirstStep:
    """The max_num_seqs the KV cache holds at the window's tokens per request, rounded down to a value the
    backend runs fast and brought within `bounds`; a NoFirstStep when an input is missing, or the value is
    not below `current`, is tabu, or is one the door's cap already lost (`lost`)."""
    if shape.kv_tokens is None or shape.kv_tokens <= 0:
        return NoFirstStep(
            "the KV cache's size is not known (no 'KV cache size' line, no planner prediction)"
        )
    if not shape.prompt_tokens or not shape.output_tokens or shape.output_tokens <= 0:
        return NoFirstStep("no request has finished yet to size one by")
    block = shape.block_size
    blocks = shape.kv_tokens // block
    usable = blocks - 1  # the BlockPool's null block (planner/kv_math.py)
    tokens = round(shape.prompt_tokens + shape.output_tokens)  # a mean: its nearest whole token count
    per_request = math.ceil(tokens / block)
    ratio = usable / per_request
    fits = math.floor(ratio)
    arithmetic = (
        f"KV cache {shape.kv_tokens:,} tokens ({shape.kv_source}) = {blocks:,} blocks of {block}, "
        f"{usable:,} usable (one is vLLM's null block) ÷ {per_request} blocks per request "
        f"({shape.prompt_tokens:.0f} prompt + {shape.output_tokens:.0f} output = {tokens:,} tokens"
        + (f", {shape.sizes_from}" if shape.sizes_from else "")
        + f") = {ratio:.2f} → {fits}"
    )
    if fits < 1:
        return NoFirstStep("the KV cache holds less than one request of this size", arithmetic)
    value, how = round_down_fast(fits, shape.backend, shape.capture_sizes)
    arithmetic += f"; {how}"
    low, high = bounds
    if value > high:
        value = int(high)
        arithmetic += f"; at the upper bound {value}"
    if value < low:
        value = math.ceil(low)
        arithmetic += f"; at the lower bound {value}"
    if value >= current:
        return NoFirstStep(
            f"the KV cache holds {value} at a time, not fewer than max_num_seqs {current}", arithmetic
        )
    if (why_tabu := _tabu_at_or_above(value, current, tabu or {})) is not None:
        return NoFirstStep(why_tabu, arithmetic)
    if (why_lost := lost_to_door(value, lost)) is not None:
        return NoFirstStep(why_lost, arithmetic)
    return FirstStep(value, arithmetic)


def _tabu_at_or_above(value: int, current: int, tabu: Mapping[tuple[str, object], str]) -> str | None:
    """Why `value` may not be proposed: it is tabu, or a tabu value lies between it and `current` — a step
    never jumps over one (policy/tunables.py): what lost nearer the value in force rules out going past it."""
    if (why := tabu.get(("max_num_seqs", value))) is not None:
        return f"max_num_seqs={value} is tabu: {why}"
    between = [
        (v, why)
        for (param, v), why in tabu.items()
        if param == "max_num_seqs" and isinstance(v, int | float) and value < v < current
    ]
    if not between:
        return None
    nearest, why = min(between, key=lambda item: float(item[0]))
    return f"max_num_seqs={value} would jump over {nearest}, which is tabu: {why}"


def round_down_fast(value: int, backend: Backend, capture_sizes: tuple[int, ...] | None) -> tuple[int, str]:
    """`value` (≥ 1) rounded down to one the backend runs fast, and how (for the arithmetic)."""
    if backend == "cpu":
        return value, f"CPU backend: no CUDA graphs, any value runs as fast → {value}"
    if capture_sizes is not None and not capture_sizes:
        return value, f"vLLM runs eager here (its cudagraph_capture_sizes is []): any value → {value}"
    if capture_sizes is not None:
        below = [s for s in capture_sizes if s <= value]
        rounded = max(below) if below else min(capture_sizes)
        return rounded, f"down to a CUDA-graph capture size in vLLM's log → {rounded}"
    rounded = value // 8 * 8 if value >= 8 else max(s for s in _SMALL_SIZES if s <= value)
    return rounded, f"down to vLLM's default capture sizes (1, 2, 4, multiples of 8; none logged) → {rounded}"


def lost_to_door(value: float, lost: Sequence[LostCap]) -> str | None:
    """Why max_num_seqs = `value` is already lost under this load (None: it is not): the door's cap at a
    concurrency at or above it missed the targets by its wait — vLLM limited to as many, or fewer, at once
    keeps as many waiting, in its own queue."""
    nearest = min((cap for cap in lost if cap.value >= value), key=lambda cap: cap.value, default=None)
    if nearest is None:
        return None
    return (
        f"the door's cap at {nearest.value} already lost under this load ({nearest.why}): "
        f"max_num_seqs={value} runs no more at once"
    )
