"""The operator's commands as the loop receives them (faces/operator.py parses them off the unix socket,
commands.py carries them out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMMANDS = frozenset({"resume", "restart", "pause", "probe", "explore", "door", "curve", "cache-reset"})


@dataclass(frozen=True)
class Command:
    """An operator command for the loop: its name and its validated payload."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    names: tuple[str, ...] = ()  # `explore`: the parameters to explore
