"""vLLM's `/health`: 200 = alive; 503 once the engine is dead; connection refused before it serves."""

from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class HealthResult:
    run_id: int
    ok: bool
    detail: str  # "200", "503", "connection refused", "timeout" …


def probe_health(client: httpx.Client, base_url: str, run_id: int, timeout_s: float) -> HealthResult:
    """One GET /health. Never raises: every problem is a failed result with a short reason."""
    try:
        response = client.get(f"{base_url}/health", timeout=timeout_s)
    except httpx.ConnectError:
        return HealthResult(run_id, False, "connection refused")
    except httpx.TimeoutException:
        return HealthResult(run_id, False, "timeout")
    except httpx.HTTPError as exc:
        return HealthResult(run_id, False, type(exc).__name__)
    return HealthResult(run_id, response.status_code == 200, str(response.status_code))
