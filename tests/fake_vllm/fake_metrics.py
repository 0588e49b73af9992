"""What the fake vLLM's API server counts and serves: in-flight requests, the counters, ``/metrics`` text
built on ``metrics_idle.prom``, and the FAKE_VLLM_CONTROL file that tests change while it runs."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import fake_vllm as fv

# ok_start.json: 12 concurrent requests of 400 tokens took 1.43-2.23 s each, ~270 tokens/s per request.
REQUEST_TOKENS_PER_S = 270.0
GARBAGE = b"<html><body><h1>502 Bad Gateway</h1></body></html>\n\x00\xff{{ not prometheus text at all\n"


class Control:
    """FAKE_VLLM_CONTROL: a JSON object read again when the file's mtime, size or inode changes (and while it
    is younger than 1 s, as mtimes are coarse). A half-written file keeps the last good content in force."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.stamp: tuple[int, int, int] | None = None
        self.data: dict[str, Any] = {}
        self.lock = threading.Lock()

    def get(self) -> dict[str, Any]:
        if not self.path:
            return {}
        try:
            st = os.stat(self.path)
        except OSError:
            return self.data
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        with self.lock:
            if stamp != self.stamp or time.time() - st.st_mtime < 1.0:
                try:
                    with open(self.path, encoding="utf-8") as f:
                        data = json.load(f)
                    if isinstance(data, dict):
                        self.data, self.stamp = data, stamp
                except (OSError, ValueError):
                    pass
            return self.data


class MetricsText:
    """metrics_idle.prom with ``model_name`` set to the served model, ``vllm:cache_config_info`` following the
    flags, and the live values patched in; every other line is the fixture's, as captured."""

    LIVE: ClassVar[dict[str, tuple[str, str]]] = {  # key -> (line prefix, text the line must also contain)
        "running": ("vllm:num_requests_running{", ""),
        "waiting": ("vllm:num_requests_waiting{", ""),
        "waiting_capacity": ("vllm:num_requests_waiting_by_reason{", 'reason="capacity"'),
        "kv_usage": ("vllm:kv_cache_usage_perc{", ""),
        "preemptions": ("vllm:num_preemptions_total{", ""),
        "prompt_tokens": ("vllm:prompt_tokens_total{", ""),
        "generation_tokens": ("vllm:generation_tokens_total{", ""),
    }

    def __init__(self, ns: argparse.Namespace, kv: fv.KvPlan) -> None:
        text = (fv.FIXTURES / "metrics_idle.prom").read_text(encoding="utf-8")
        found = re.search(r'model_name="([^"]*)"', text)
        name = fv.served_name(ns).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")
        if found:
            text = text.replace(f'model_name="{found[1]}"', f'model_name="{name}"')
        self.lines = [self._cache_config(x, ns, kv) for x in text.split("\n")]
        self.live: dict[str, tuple[int, str]] = {}
        for key, (prefix, extra) in self.LIVE.items():
            i = next(i for i, x in enumerate(self.lines) if x.startswith(prefix) and extra in x)
            self.live[key] = (i, self.lines[i].rsplit(" ", 1)[0])
        self._padding: bytes | None = None

    @staticmethod
    def _cache_config(line: str, ns: argparse.Namespace, kv: fv.KvPlan) -> str:
        if not line.startswith("vllm:cache_config_info{"):
            return line
        prefix = True if ns.enable_prefix_caching is None else ns.enable_prefix_caching
        labels = {
            "block_size": kv.block_size,
            "effective_attention_block_size": kv.block_size,
            "num_gpu_blocks": kv.num_blocks,
            "kv_cache_size_tokens": kv.tokens,
            "kv_cache_max_concurrency": kv.concurrency,
            "kv_cache_memory_bytes": ns.kv_cache_memory_bytes,
            "gpu_memory_utilization": ns.gpu_memory_utilization,
            "cache_dtype": ns.kv_cache_dtype,
            "enable_prefix_caching": prefix,
        }
        for key, value in labels.items():
            line = re.sub(rf'(?<![\w]){key}="[^"]*"', lambda _m, r=f'{key}="{value}"': r, line)
        return line

    def render(self, values: dict[str, float]) -> bytes:
        lines = list(self.lines)
        for key, (i, head) in self.live.items():
            lines[i] = f"{head} {float(values[key])!r}"
        return "\n".join(lines).encode()

    def body(self, mode: str, values: dict[str, float]) -> bytes:
        """One scrape in FAKE_VLLM_CONTROL's "metrics" mode: ok, garbage, huge or truncated."""
        body = self.render(values)
        if mode == "garbage":
            return GARBAGE
        if mode == "huge":
            return self.huge(body)
        if mode == "truncated":
            return self.truncated(body)
        return body

    def huge(self, body: bytes) -> bytes:
        """About 8 MB: valid samples after the real ones, so only a size limit can reject it."""
        if self._padding is None:
            head = "# HELP vllm:fake_padding Padding.\n# TYPE vllm:fake_padding gauge\n"
            self._padding = (
                head + "".join(f'vllm:fake_padding{{i="{i}"}} 0.0\n' for i in range(280_000))
            ).encode()
        return body + self._padding

    @staticmethod
    def truncated(body: bytes) -> bytes:
        """Cut in the middle of the num_requests_running sample line."""
        return body[: body.index(b"vllm:num_requests_running{") + 20]


@dataclass(eq=False)
class Request:
    """One completion in flight. Compared by identity: `ServeState.step` finds a request's place in the
    queue with `list.index`, and two requests of the same sizes that began together were equal field by
    field — whichever thread stepped first took the other's place, so both ran past `--max-num-seqs` (a
    busy box reorders the threads: an exploration measured max_num_seqs 1 and 2 alike, 371 tok/s)."""

    prompt_tokens: int
    max_tokens: int
    generated: float = 0.0


class ServeState:
    """What the HTTP threads share: in-flight requests, the counters, and the flags that make requests fail
    (engine core dead, shutdown in abort mode)."""

    def __init__(self, ns: argparse.Namespace, kv: fv.KvPlan, control: Control) -> None:
        self.ns, self.kv, self.control = ns, kv, control
        self.metrics = MetricsText(ns, kv)
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.generation = 0.0
        self.prompt = 0
        self.preemptions = 0.0
        self.last = time.monotonic()
        self.engine_dead = threading.Event()
        self.first_ok: float | None = None  # when /health first answered 200 (monotonic)
        self.aborting = False
        self.resets = 0  # POST /reset_prefix_cache answered so far

    def failed(self) -> bool:
        return self.aborting or self.engine_dead.is_set()

    def health(self) -> int:
        """200; 503 once the engine core is dead (engine_killed_run2.json); or the control file's "health"."""
        ctl, _ = self.sample()
        status = 503 if self.engine_dead.is_set() else int(ctl.get("health", 200))
        if status == 200 and self.first_ok is None:
            self.first_ok = time.monotonic()
        return status

    def sample(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Advance the counters to now; return the control settings and the live metric values."""
        ctl = self.control.get()
        with self.lock:
            now = time.monotonic()
            dt, self.last = now - self.last, now
            cap = self.ns.max_num_seqs or 256
            n = len(self.requests)
            running = int(ctl.get("running", 0)) + min(n, cap)
            waiting = int(ctl.get("waiting", 0)) + max(0, n - cap)
            if running > 0 and not ctl.get("wedged"):
                self.generation += float(ctl.get("tokens_per_s", 0)) * dt
            self.preemptions += float(ctl.get("preemptions_per_s", 0)) * dt
            blocks = sum(
                -(-(r.prompt_tokens + int(r.generated)) // self.kv.block_size) for r in self.requests
            )
            usage = ctl.get("kv_cache_usage", min(1.0, blocks / max(1, self.kv.num_blocks)))
            return ctl, {
                "running": running,
                "waiting": waiting,
                "waiting_capacity": waiting,
                "kv_usage": float(usage),
                "preemptions": math.floor(self.preemptions),
                "prompt_tokens": self.prompt,
                "generation_tokens": math.floor(self.generation),
            }

    def begin(self, prompt_tokens: int, max_tokens: int) -> Request:
        req = Request(prompt_tokens, max_tokens)
        with self.lock:
            self.requests.append(req)
            self.prompt += prompt_tokens
        return req

    def step(self, req: Request, dt: float) -> None:
        if self.control.get().get("wedged"):
            return  # wedged: requests stay "running" but no token comes out
        with self.lock:
            if self.requests.index(req) >= (self.ns.max_num_seqs or 256):
                return  # vLLM's scheduler runs at most max_num_seqs at once, first come first served
            rate = float(self.control.get().get("request_tokens_per_s", REQUEST_TOKENS_PER_S))
            tokens = min(rate * dt, req.max_tokens - req.generated)
            req.generated += tokens
            self.generation += tokens

    def end(self, req: Request) -> None:
        with self.lock:
            self.requests.remove(req)

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.requests and time.monotonic() < deadline:
            time.sleep(0.01)

    def models(self) -> dict[str, Any]:
        """models.json, with the real model, served names and max_model_len."""
        doc = json.loads((fv.FIXTURES / "models.json").read_text(encoding="utf-8"))
        entry, now = doc["data"][0], int(time.time())
        perm = {**entry["permission"][0], "id": f"modelperm-{secrets.token_hex(8)}", "created": now}
        names = self.ns.served_model_name or [self.ns.model]
        common = {
            "root": self.ns.model,
            "created": now,
            "max_model_len": self.kv.max_model_len,
            "permission": [perm],
        }
        doc["data"] = [{**entry, "id": name, **common} for name in names]
        return doc
