"""The operator's commands (`tunerd restart`, `pause`, `resume`, `probe`, `explore`, `door`): checked on
the socket's handler thread where that needs no loop state (`refusal`), carried out on the loop (`run`).

What a command cannot say at once — a probe's figures, an exploration's plan and progress — goes to the
journal, where the CLI reads it (the command's `reason` is its token there).
"""

from __future__ import annotations

from collections.abc import Callable

from tunerd.config import Config
from tunerd.core.commands import Command
from tunerd.observe.probe import ProbeResult
from tunerd.policy.tunables import REGISTRY
from tunerd.records.recorder import Recorder
from tunerd.supervise.door_link import DoorLink
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.tune.prober import Prober
from tunerd.tune.tuner import Tuner


def refusal(command: Command, config: Config) -> str | None:
    """Why `command` cannot be accepted, from what is known without the loop; None: accepted."""
    if command.name == "restart":
        try:
            config.engine.params.replace(**command.params)
        except ValueError as exc:
            return str(exc).splitlines()[0]
    elif command.name == "door":
        if not config.door.enabled:
            return "the front door is off ([door] enabled = false)"
        cap = command.params.get("max_in_flight", "missing")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            return f"door: max_in_flight must be a whole number ≥ 1, or null for no cap (got {cap!r})"
    elif command.name == "explore":
        unknown = [name for name in command.names if name not in REGISTRY]
        if not command.names or unknown:
            return (
                f"explore: name tunable parameters (unknown: {', '.join(unknown) or 'none named'}; "
                f"known: {', '.join(sorted(REGISTRY))})"
            )
    return None


def planner_refusal(command: Command, life: Lifecycle) -> str | None:
    """Handler thread: the capacity planner's refusal of a `restart --set`, asked before anything stops.
    The start's preflight refuses such a value too, but only after vLLM was stopped: on the H200 a
    `max_model_len` the KV cache cannot hold took the serving engine down (docs/gpu.md). The planner is
    advice: a failure of its own refuses nothing."""
    if command.name != "restart" or not command.params:
        return None
    current = life.params
    params = current.replace(**command.params)
    if params == current:
        return None
    try:
        outcome = life.capacity.check(params)
    except Exception:  # the preflight asks again, and journals what it finds
        return None
    if outcome.refusal is None:
        return None
    return f"the capacity planner refuses it (nothing was stopped): {outcome.refusal}"


class Commands:
    """Carries out accepted commands on the loop's thread."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        tuner: Tuner,
        prober: Prober,
        door_link: Callable[[], DoorLink | None],
        *,
        recorder: Recorder,
        cache_reset: Callable[[str], None] | None = None,
    ) -> None:
        self.life = lifecycle
        self.tuner = tuner
        self.prober = prober
        self.door_link = door_link
        self.rec = recorder
        # `tunerd cache-reset`: the off-peak reset now (supervise.cache_reset.CacheReset.due with the
        # loop's signals; its trigger is the command's token).
        self.cache_reset = cache_reset

    def run(self, command: Command) -> None:
        life, tuner = self.life, self.tuner
        if command.name == "pause":
            tuner.pause()
        elif command.name == "resume":
            # Resumes what is stopped: paused tuning, and an engine in FATAL (`tunerd resume` says which).
            tuner.resume()
            life.resume("operator resume")
        elif command.name == "restart":
            params = life.params.replace(**command.params)
            reason = command.reason or "operator restart"
            life.restart(params, reason, action="change" if params != life.params else "restart")
        elif command.name == "door":
            link = self.door_link()
            if link is not None:
                link.set_max_in_flight(command.params.get("max_in_flight"), command.reason or "tunerd door")
        elif command.name == "probe":
            self._probe(command.reason or "operator probe")
        elif command.name == "explore":
            reason = command.reason or "operator explore"
            why = tuner.explore(list(command.names), reason)
            if why is not None:
                self.rec.record("explore.refused", params=list(command.names), reason=why, trigger=reason)
        elif command.name == "cache-reset" and self.cache_reset is not None:
            self.cache_reset(command.reason or "operator cache-reset")

    def _probe(self, trigger: str) -> None:
        """`tunerd probe`: one probe now; its `probe.result` (or why it did not run) is journaled."""

        def done(result: ProbeResult | None, why: str | None) -> None:
            if result is None:
                self.rec.record("probe.skipped", reason=why, trigger=trigger)

        self.prober.request(trigger, done)
