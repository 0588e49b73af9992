"""The off-peak reset of vLLM's prefix cache, as the operators' guide advises for long-running servers.

At the `cache_reset.cron` times the loop asks: vLLM serving, idle (no request running or waiting), in
dev mode (`VLLM_SERVER_DEV_MODE=1`, without which vLLM does not serve `POST /reset_prefix_cache`) and on
a loopback host (dev endpoints have no authentication: tunerd refuses otherwise, and says so). Then a
worker job resets it, retrying while vLLM answers that blocks are in use, and the journal gets the
memory figures before and after. A reset that may not run now is journaled as skipped, with why.

`tunerd cache-reset` asks for the same reset now, through the same checks, retries and journal events;
each record names its `trigger` ("cron", or the operator's token), so the CLI finds the one that answers
it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future

from tunerd.config import Config
from tunerd.core.states import EngineState
from tunerd.engine.admin import CacheResetResult, dev_mode, reset_prefix_cache
from tunerd.engine.launch import build_env
from tunerd.records.recorder import Recorder
from tunerd.supervise.lifecycle import Lifecycle

FIGURES = ("kv_cache.usage", "host.mem_available_bytes", "prefix_cache.hit_ratio")


class CacheReset:
    def __init__(
        self,
        config: Config,
        lifecycle: Lifecycle,
        *,
        recorder: Recorder,
        submit: Callable[[Callable[[], CacheResetResult]], Future[CacheResetResult]],
        reset: Callable[..., CacheResetResult] = reset_prefix_cache,
    ) -> None:
        self.config = config
        self.life = lifecycle
        self.rec = recorder
        self.submit = submit
        self.reset = reset  # engine.admin.reset_prefix_cache; a stand-in in the in-process tests
        self.running: tuple[Future[CacheResetResult], dict[str, float | None], str] | None = None

    def due(self, signals: Mapping[str, float | None], trigger: str = "cron") -> None:
        """The cron time came, or an operator asked (`trigger`): reset now, or journal why not."""
        why = self._why_not(signals)
        if why is not None:
            self.rec.record("cache_reset.skipped", reason=why, trigger=trigger)
            return
        run = self.life.engine.run
        assert run is not None
        cfg, base_url, reset = self.config.cache_reset, run.base_url, self.reset
        job = self.submit(lambda: reset(base_url, retries=cfg.retries, retry_after_s=cfg.retry_after_s))
        self.running = (job, {name: signals.get(name) for name in FIGURES}, trigger)

    def _why_not(self, signals: Mapping[str, float | None]) -> str | None:
        if self.running is not None:
            return "a reset is running"
        if self.life.engine.state is not EngineState.RUNNING or self.life.engine.run is None:
            return f"vLLM is {self.life.engine.state.name}"
        if self.life.trial is not None or self.life.hold_promotion:
            return "a trial or an exploration is running"
        engine = self.config.engine
        allowed, why = dev_mode(build_env(engine), engine.host)
        if not allowed:
            return why
        busy = [name for name in ("requests.running", "requests.waiting") if (signals.get(name) or 0) > 0]
        if busy or signals.get("requests.running") is None:
            return "vLLM is not idle" if busy else "vLLM's load is not known (no scrape)"
        return None

    def step(self, signals: Mapping[str, float | None]) -> None:
        """Journal a finished reset with the figures before and after (every loop tick)."""
        if self.running is None or not self.running[0].done():
            return
        job, before, trigger = self.running
        self.running = None
        try:
            result = job.result()
        except Exception as exc:  # the client never raises; a bug in it must not take the loop down
            self.rec.record("cache_reset.failed", detail=f"{type(exc).__name__}: {exc}", trigger=trigger)
            return
        after = {name: signals.get(name) for name in FIGURES}
        self.rec.record(
            "cache_reset.done" if result.ok else "cache_reset.failed",
            attempts=result.attempts,
            detail=result.detail,
            seconds=round(result.seconds, 3),
            before=before,
            after=after,
            trigger=trigger,
        )
