"""The operator's commands (`tunerd restart`, `pause`, `resume`, `probe`, `explore`, `door`, `curve`):
checked on the socket's handler thread where that needs no loop state (`refusal`), carried out on the
loop (`run`).

A `restart --set` is refused before anything stops when the capacity planner refuses its parameters.
The handler thread does not ask the planner itself (its cache is the loop's and its worker jobs'): it
posts an `Asked` and waits for the answer (`ask`); the loop has the planner check the parameters in a
worker job, as a trial's and a start's are checked, answers, and carries out what it accepted.

What a command cannot say at once — a probe's figures, an exploration's or a curve's progress — goes to the
journal, where the CLI reads it (the command's `reason` is its token there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from tunerd.config import Config
from tunerd.config.objective import in_force
from tunerd.core.commands import Command
from tunerd.observe.probe import ProbeResult
from tunerd.policy.tunables import REGISTRY
from tunerd.records.recorder import Recorder
from tunerd.supervise.capacity import PlanOutcome
from tunerd.supervise.door_link import DoorLink
from tunerd.supervise.lifecycle import Lifecycle
from tunerd.supervise.preflight import Submit
from tunerd.tune.curve import parse_caps
from tunerd.tune.prober import Prober
from tunerd.tune.tuner import Tuner

# How long the handler thread waits for the loop's answer: below the CLI's 5 s, so that the operator
# reads why rather than "cannot reach the daemon".
ANSWER_WAIT_S = 4.0


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
        if command.params.get("steer") is True:
            applies = in_force(config.objective, door_enabled=True)
            if applies.kind != "goodput":
                return (
                    "door: --steer needs the goodput objective with targets ([objective] kind, ttft_s, "
                    f"tpot_s, e2e_s); in force: {applies.kind}"
                )
            return None
        cap = command.params.get("max_in_flight", "missing")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            return f"door: max_in_flight must be a whole number ≥ 1, or null for no cap (got {cap!r})"
    elif command.name == "curve":
        if not config.door.enabled:
            return "the front door is off ([door] enabled = false): the curve moves its cap"
        caps = parse_caps(command.params.get("caps"))
        if isinstance(caps, str):
            return caps
        point_s, settle_s = command.params.get("point_s"), command.params.get("settle_s")
        if not isinstance(point_s, int | float) or isinstance(point_s, bool) or not 1 <= point_s <= 3600:
            return f"curve: point_s must be 1..3600 seconds (got {point_s!r})"
        if not isinstance(settle_s, int | float) or isinstance(settle_s, bool) or not 0 <= settle_s <= 600:
            return f"curve: settle_s must be 0..600 seconds (got {settle_s!r})"
    elif command.name == "explore":
        unknown = [name for name in command.names if name not in REGISTRY]
        if not command.names or unknown:
            return (
                f"explore: name tunable parameters (unknown: {', '.join(unknown) or 'none named'}; "
                f"known: {', '.join(sorted(REGISTRY))})"
            )
    return None


def needs_answer(command: Command) -> bool:
    """Whether the handler must wait for the loop's answer: a `restart --set` (the planner may refuse
    it); every other command is accepted once `refusal` passes it."""
    return command.name == "restart" and bool(command.params)


@dataclass(frozen=True, eq=False)
class Asked:
    """A command posted by the handler thread that waits for the loop's answer: None (accepted, and
    carried out) or why not. The loop answers through `answer`, once (`Commands.ask`)."""

    command: Command
    answer: Future[str | None] = field(default_factory=Future)


def ask(command: Command, post: Callable[[Asked], None], wait_s: float = ANSWER_WAIT_S) -> str | None:
    """Handler thread: post `command` to the loop and wait for its answer (None: accepted). A loop that
    has not taken the question up within `wait_s` never will (the cancel is atomic with its taking it
    up): nothing is done, and the answer says so."""
    asked = Asked(command)
    post(asked)
    try:
        return asked.answer.result(timeout=wait_s)
    except TimeoutError:
        if asked.answer.cancel():
            return f"tunerd did not answer within {wait_s:g} s (nothing was done): ask again"
        return asked.answer.result()  # taken up meanwhile: the answer is being set


def planner_refusal(plan: Future[PlanOutcome]) -> str | None:
    """The capacity planner's refusal of a `restart --set`, from its finished check. The start's
    preflight refuses such a value too, but only after vLLM was stopped: on the H200 a `max_model_len`
    the KV cache cannot hold took the serving engine down (docs/gpu.md). The planner is advice: a
    failure of its own refuses nothing (the preflight asks again, and journals what it finds)."""
    if plan.exception() is not None:
        return None
    outcome = plan.result()
    if outcome.refusal is None:
        return None
    return f"the capacity planner refuses it (nothing was stopped): {outcome.refusal}"


class Commands:
    """Carries out accepted commands on the loop's thread, and answers the handler's questions there."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        tuner: Tuner,
        prober: Prober,
        door_link: Callable[[], DoorLink | None],
        *,
        recorder: Recorder,
        submit: Submit,
        cache_reset: Callable[[str], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.life = lifecycle
        self.tuner = tuner
        self.prober = prober
        self.door_link = door_link
        self.rec = recorder
        self.submit = submit
        self.asked: list[tuple[Asked, Future[PlanOutcome]]] = []  # waiting for the planner's check
        # `tunerd cache-reset`: the off-peak reset now (supervise.cache_reset.CacheReset.due with the
        # loop's signals; its trigger is the command's token).
        self.cache_reset = cache_reset
        self.now = monotonic  # the loop's clock (a curve's points are timed on it)

    def ask(self, asked: Asked) -> None:
        """Loop: a `restart --set` the handler waits on. A change of parameters goes to the planner in a
        worker job (`step` answers once it is done); the same parameters are carried out at once."""
        current = self.life.params
        try:
            params = current.replace(**asked.command.params)
        except ValueError as exc:  # `refusal` passed them against the config's parameters
            self.decline(asked, str(exc).splitlines()[0])
            return
        if params == current:
            self._answer(asked, None)
            return
        check = self.life.capacity.check
        self.asked.append((asked, self.submit(lambda: check(params))))

    def step(self) -> None:
        """Loop: answer the questions whose planner check is done; carry out the accepted ones."""
        waiting = []
        for asked, plan in self.asked:
            if plan.done():
                self._answer(asked, planner_refusal(plan))
            else:
                waiting.append((asked, plan))
        self.asked = waiting

    def decline(self, asked: Asked, why: str) -> None:
        """Loop: answer `asked` with `why` and do nothing (tunerd stopping, parameters that do not
        validate)."""
        if asked.answer.set_running_or_notify_cancel():
            asked.answer.set_result(why)

    def close(self) -> None:
        """Loop, at exit: whoever still waits hears that nothing was done."""
        for asked, _plan in self.asked:
            self.decline(asked, "tunerd is stopping (nothing was done)")
        self.asked = []

    def _answer(self, asked: Asked, why: str | None) -> None:
        if not asked.answer.set_running_or_notify_cancel():
            return  # the handler stopped waiting and told the operator that nothing was done
        asked.answer.set_result(why)
        if why is None:
            self.run(asked.command)

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
            if link is not None and command.params.get("steer") is True:
                link.steer(command.reason or "tunerd door --steer")
            elif link is not None:
                link.set_max_in_flight(command.params.get("max_in_flight"), command.reason or "tunerd door")
        elif command.name == "curve":
            self._curve(command)
        elif command.name == "probe":
            self._probe(command.reason or "operator probe")
        elif command.name == "explore":
            reason = command.reason or "operator explore"
            why = tuner.explore(list(command.names), reason)
            if why is not None:
                self.rec.record("explore.refused", params=list(command.names), reason=why, trigger=reason)
        elif command.name == "cache-reset" and self.cache_reset is not None:
            self.cache_reset(command.reason or "operator cache-reset")

    def _curve(self, command: Command) -> None:
        """`tunerd door --curve`: the door's cap measured cap by cap on the serving vLLM (tune/curve.py);
        why not, when it cannot start, is journaled (`door.curve.refused`)."""
        trigger = command.reason or "operator curve"
        caps = parse_caps(command.params.get("caps"))
        if isinstance(caps, str):
            why: str | None = caps
        else:
            why = self.tuner.measure_curve(
                caps,
                point_s=float(command.params["point_s"]),
                settle_s=float(command.params["settle_s"]),
                trigger=trigger,
                now=self.now(),
            )
        if why is not None:
            self.rec.record("door.curve.refused", reason=why, trigger=trigger)

    def _probe(self, trigger: str) -> None:
        """`tunerd probe`: one probe now; its `probe.result` (or why it did not run) is journaled."""

        def done(result: ProbeResult | None, why: str | None) -> None:
            if result is None:
                self.rec.record("probe.skipped", reason=why, trigger=trigger)

        self.prober.request(trigger, done)
