"""`[door]` of tunerd.toml: the front door's port, its admission limits and timeouts (docs/door.md).

Its own module so that `tunerd.door` imports only this of the config (and `tunerd.core`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DoorConfig(BaseModel):
    """The front door (docs/door.md). Frozen; unknown keys are errors, like every section of the config.

    With the door enabled clients keep the port they knew (`port`, vLLM's usual 8000) and vLLM listens on
    `[engine] host:port`, which must then be loopback and another port (the shipped config: 18000). Off
    unless the config turns it on (the shipped tunerd.toml does).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port (tests); `Door.address` says which
    # Requests forwarded to vLLM at once; the rest wait in the door's queue. None: no cap of the door's own
    # (vLLM's scheduler queues what exceeds max_num_seqs, as it does without the door). Changeable on the
    # running door (`Door.set_max_in_flight`) without a restart of anything.
    max_in_flight: int | None = Field(default=None, ge=1)
    # Under a goodput objective ([objective] targets) and with `max_in_flight` unset, the door steers its
    # cap live toward the targets (door/limit.py, docs/door.md "the cap steered live"): never below
    # `min_in_flight`, never above the max_num_seqs in force; one step at most every `steer_interval_s`,
    # judged on at least `steer_min_samples` requests forwarded since the last change.
    min_in_flight: int = Field(default=1, ge=1)
    steer_interval_s: float = Field(default=5.0, gt=0)
    steer_min_samples: int = Field(default=10, ge=1)
    # Requests waiting in the door at once (engine down or draining, cap reached); one more gets 503.
    max_queue: int = Field(default=1024, ge=0)
    # The longest a request waits in the door, whatever it waits for; then 503. Above a restart's duration.
    hold_timeout_s: float = Field(default=300.0, gt=0)
    # The order waiting requests are released in. "arrival": first come, first served. "on_time_first"
    # (under a goodput objective with a TTFT target): a request that has waited that target already missed
    # it, so it goes only when no request that can still meet it waits — in arrival order a backlog makes
    # every request late (docs/door.md). The late ones still wait, up to hold_timeout_s.
    order: Literal["arrival", "on_time_first"] = "arrival"
    # Before a planned restart: how long in-flight requests may take to finish; what is still in flight
    # then is counted (`drain_cut`) and the loop stops vLLM anyway.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # Prompt tokens (counted with the model's tokenizer.json); None: the max_model_len in force.
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    # `Retry-After` (integer seconds, RFC 9110 delay-seconds) on every 503 the door answers.
    retry_after_s: int = Field(default=5, ge=0)
    # The largest request body the door accepts (it keeps each body for a replay); a larger one gets 413.
    max_body_bytes: int = Field(default=64 << 20, ge=1024)
    # The door's event loop: uvloop where it is installed (it comes with vLLM's uvicorn[standard]; 5-13 %
    # less CPU per request in bench/front_door.py), else asyncio's own; or either one by name.
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
