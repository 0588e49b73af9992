"""The front door (docs/door.md): clients talk to tunerd's public port; the door forwards to vLLM on a
private loopback port, holds requests across a restart, replays what a crash cut before any byte of its
answer, and applies the admission limits (in-flight cap, queue length, prompt tokens).

It runs its own asyncio event loop in a daemon thread (`Door`); the main loop drives it through
thread-safe methods only and hears back through events (`events`). Of tunerd it imports only its
config section (`tunerd.config.door`) and `tunerd.core` (import-linter).
"""

from tunerd.config.door import DoorConfig
from tunerd.door.door import Door
from tunerd.door.events import (
    DoorDrained,
    DoorFailed,
    DoorLimit,
    DoorReleased,
    DoorRequests,
    DrainState,
    LimitsState,
    UpstreamState,
)
from tunerd.door.limit import LimitState

__all__ = [
    "Door",
    "DoorConfig",
    "DoorDrained",
    "DoorFailed",
    "DoorLimit",
    "DoorReleased",
    "DoorRequests",
    "DrainState",
    "LimitState",
    "LimitsState",
    "UpstreamState",
]
