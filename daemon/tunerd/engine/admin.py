"""vLLM's development endpoints that tunerd uses: the off-peak prefix-cache reset.

vLLM serves `POST /reset_prefix_cache` only when `VLLM_SERVER_DEV_MODE` is set in its environment
(vllm/entrypoints/launchers/api_server/routers.py registers the dev routers only when
`envs.VLLM_SERVER_DEV_MODE`, which vllm/envs.py reads as `bool(int(os.getenv("VLLM_SERVER_DEV_MODE",
"0")))`); without it the route is absent: HTTP 404. The dev endpoints are unauthenticated, so tunerd uses
them only with vLLM on a loopback host (`dev_mode`).

What the reset answers (vllm/entrypoints/serve/dev/cache/api_router.py, 0.32.0): HTTP 200 with
`{"success": true}`, or HTTP 200 with `{"success": false}` while KV blocks are still held — running
requests, in-flight KV offload transfers — because `BlockPool.reset_prefix_cache`
(vllm/v1/core/block_pool.py) refuses while any block but the null block is in use ("Failed to reset
prefix cache because some blocks (N) are not freed yet" in vLLM's log) and `Scheduler.reset_prefix_cache`
passes that on. Seen against a real 0.32.0 server under load: `{"success":false}` five times, then
`{"success":true}` once the requests had finished. Older servers (the endpoint since vLLM PR #12284,
early 2025) answered HTTP 200 with an empty body whether or not the reset happened; a third-party
benchmark (llm-d-benchmark PR #1918) dates the `success` body to v0.26.0. tunerd never passes
`reset_running_requests=true` (vLLM PR #28827): it would preempt live requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from tunerd.core.hosts import is_loopback

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
RESET_TIMEOUT = httpx.Timeout(30.0, connect=2.0)  # the engine answers between two of its steps


def dev_mode(env: Mapping[str, str], host: str) -> tuple[bool, str]:
    """(may tunerd use `POST /reset_prefix_cache`, why): only when vLLM's environment `env` (what it is
    started with: tunerd's own and [engine.env]) sets VLLM_SERVER_DEV_MODE to a non-zero integer (vLLM
    reads it with int()) and vLLM listens on a loopback `host` (127.0.0.0/8, ::1, localhost: its dev
    endpoints are unauthenticated). The reason names every condition that is missing. No I/O: a host
    name other than localhost is not resolved and counts as not loopback."""
    missing = []
    raw = env.get(DEV_MODE_ENV)
    if raw is None:
        missing.append(f"{DEV_MODE_ENV} is not set in vLLM's environment (set it to 1 in [engine.env])")
    else:
        try:
            enabled = int(raw.strip()) != 0
        except ValueError:
            missing.append(f"{DEV_MODE_ENV}={raw!r} is not an integer (vLLM reads it with int(): use 1)")
        else:
            if not enabled:
                missing.append(f"{DEV_MODE_ENV}={raw} turns vLLM's dev endpoints off (use 1)")
    if not is_loopback(host):
        missing.append(
            f"vLLM listens on {host or '(all addresses)'}, not a loopback address: its dev endpoints are "
            "unauthenticated, so tunerd uses them only with engine.host = 127.0.0.1"
        )
    if missing:
        return False, "; ".join(missing)
    return True, f"{DEV_MODE_ENV}={env[DEV_MODE_ENV]} and vLLM on loopback {host}"


@dataclass(frozen=True)
class CacheResetResult:
    """The outcome of `reset_prefix_cache`: `ok` when vLLM reset its prefix cache (or, for a vLLM that
    does not say, answered 200: `detail` says so), `attempts` POSTs made, `detail` what vLLM answered
    last, `seconds` the whole call, retries and their waits included."""

    ok: bool
    attempts: int
    detail: str
    seconds: float


def reset_prefix_cache(
    base_url: str,
    *,
    retries: int,
    retry_after_s: float,
    sleep: Callable[[float], None] = time.sleep,
    client: httpx.Client | None = None,
) -> CacheResetResult:
    """`POST {base_url}/reset_prefix_cache`, retried up to `retries` times, `sleep(retry_after_s)` before
    each retry, while vLLM answers that blocks are still in use (`{"success": false}`). Any other
    failure — 404 (dev mode off), another status, a timeout, no connection — ends it at once. Blocking
    (a worker job's); never raises. `client`: one to reuse (else a private one, without proxies from
    the environment)."""
    started = time.monotonic()
    own = client is None
    http = httpx.Client(trust_env=False, timeout=RESET_TIMEOUT) if client is None else client
    attempts = 0
    try:
        while True:
            attempts += 1
            outcome, detail = _attempt(http, base_url)
            if outcome != "in_use" or attempts > retries:
                if outcome == "in_use":
                    detail = f"{detail}; gave up after {attempts} attempts"
                return CacheResetResult(outcome == "ok", attempts, detail, time.monotonic() - started)
            sleep(retry_after_s)
    except Exception as exc:  # the contract: never raises (a failing `sleep`, a broken client)
        detail = f"{type(exc).__name__}: {exc}"[:200]
        return CacheResetResult(False, attempts, detail, time.monotonic() - started)
    finally:
        if own:
            http.close()


def _attempt(http: httpx.Client, base_url: str) -> tuple[str, str]:
    """("ok" | "in_use" | "failed", what vLLM answered)."""
    try:
        response = http.post(f"{base_url}/reset_prefix_cache")
    except httpx.TimeoutException as exc:
        return "failed", f"timeout: {type(exc).__name__}"
    except (httpx.HTTPError, OSError) as exc:
        return "failed", f"connection: {type(exc).__name__}: {exc}"[:200]
    if response.status_code == 404:
        return "failed", f"HTTP 404: vLLM serves /reset_prefix_cache only with {DEV_MODE_ENV}=1"
    if response.status_code != 200:
        return "failed", f"HTTP {response.status_code}: {response.text.strip()[:100]}"
    text = response.text.strip()
    try:
        success = json.loads(text).get("success") if text else None
    except (ValueError, AttributeError):
        success = None
    if success is True:
        return "ok", 'HTTP 200 {"success": true}'
    if success is False:
        return "in_use", 'HTTP 200 {"success": false}: KV blocks still in use (running requests)'
    return "ok", f"HTTP 200 {text[:60]!r}: this vLLM does not say whether the reset happened (before 0.26?)"
