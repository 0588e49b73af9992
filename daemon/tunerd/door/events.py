"""What the door tells the main loop (posted through the `post` callable given to `Door`), and the
snapshots the loop may read at any time. All immutable: built in the door's thread, read in the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tunerd.core.slo import RequestSample

UpstreamState = Literal["serving", "draining", "down", "fatal"]
DrainEnd = Literal["idle", "timeout", "superseded"]


@dataclass(frozen=True)
class DrainState:
    """The door at one instant (`Door.drain_state()`): its upstream state, requests forwarded to vLLM and
    not yet answered in full (`in_flight`), requests waiting in the door (`queued`), and since when
    (`time.monotonic()`, the main loop's clock too) a drain runs (None unless draining); `arrivals`:
    requests that have arrived since the door opened (a counter: the offered load's rate)."""

    state: UpstreamState
    in_flight: int
    queued: int
    max_in_flight: int | None
    draining_since: float | None = None
    reason: str = ""
    arrivals: int = 0


@dataclass(frozen=True)
class LimitsState:
    """The prompt limits in force (`Door.limits_state()`): whether the tokenizer is loaded (until then
    prompt lengths are left to vLLM), the max_model_len last set, the door's own max_prompt_tokens."""

    tokenizer_loaded: bool
    max_model_len: int | None
    max_prompt_tokens: int | None


@dataclass(frozen=True)
class DoorDrained:
    """A drain ended (posted once per `draining` period), for the journal (`door.drained`).

    `ended`: "idle" (in-flight reached 0: stop vLLM now, nothing is cut), "timeout" (drain_timeout_s
    passed: `cut` requests are still in flight; stop vLLM anyway) or "superseded" (the loop set another
    state before either). `in_flight_at_start`, `finished` (answered in full meanwhile), `cut` (still in
    flight at the end: counted as `drain_cut`), `queued` (waiting in the door at the end), `seconds`.
    """

    ended: DrainEnd
    in_flight_at_start: int
    finished: int
    cut: int
    queued: int
    seconds: float


@dataclass(frozen=True)
class DoorReleased:
    """The upstream serves again (a `set_upstream(..., "serving")` after another state) and the door
    releases what waited, in arrival order (`door.released` in the journal): `waiting` requests, of which
    `replays` were cut by the upstream before any byte of their answer and are sent again; `longest_wait_s`
    is the longest any of them had waited."""

    waiting: int
    replays: int
    longest_wait_s: float


@dataclass(frozen=True)
class DoorFailed:
    """The door's thread could not serve (its listening socket failed, its loop raised). The main loop
    should journal it; clients of the public port get connection errors until the daemon restarts."""

    error: str


@dataclass(frozen=True)
class DoorRequests:
    """The generation requests the door answered since its last batch (about one batch a second, none
    while idle): one `RequestSample` each (core/slo.py), for the main loop's `SloWindow`."""

    samples: tuple[RequestSample, ...]


@dataclass(frozen=True)
class DoorLimit:
    """The door's steered cap moved (`door.limit` in the journal), at most once per `LIMIT_LOG_S`
    (door/limit.py `LimitLog`): from `old` (before the first step since the last record) to `new`, the
    last step's `why`, and how many steps this record sums (`steps`)."""

    old: int | None
    new: int | None
    why: str
    steps: int
