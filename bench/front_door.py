#!/usr/bin/env python3
"""The front door's cost, side by side in one run against the same real vLLM (CPU build, tiny model).

    .venv/bin/python bench/front_door.py [--model DIR] [--repeats 5] [--requests 200] [--streams 64]

Starts real vLLM (`python -m vllm.entrypoints.openai.api_server --model DIR --port P --max-model-len 512
--kv-cache-memory-bytes 100000000 --block-size 32`; a tiny model by scripts/make-tiny-model.py unless
--model is given; never --enforce-eager), then, each in a process of its own, tunerd's door as the daemon
runs it (tokenizer and max_model_len set, event loop "auto", every generation request timed for the
objective: door/meter.py), the same door with that per-request accounting off ("door-unmetered": the door
before it, the "before" of the accounting's cost) and, for the choice of stack, a minimal ASGI
pass-through (uvicorn + httpx.AsyncClient). The client is this process (aiohttp, one keep-alive session
per target); targets are interleaved request by request, the order rotating.

Against vLLM, `--repeats` times (printed: median over the repeats, (min..max)): p50/p99 latency of
`--requests` short non-streaming completions per target, one at a time, and added = target - direct;
the same for the time to the first streamed body chunk (the door sends a stream's headers with its first
chunk); tokens/s of `--streams` concurrent streams x `--stream-requests` x `--stream-tokens`, ratio to
direct; the door's own tunerd_door_added_latency_seconds histogram. Then the proxies alone against a null
upstream (a fixed JSON answer at once): added latency and each serving process's CPU time per request
(/proc), for the door on asyncio's loop and on uvloop, unmetered, and the ASGI pass-through. Last, what the
per-request accounting adds: the door's added latency minus the unmetered door's, per repeat.
Targets: added latency p50 < 0.6 ms, p99 < 3 ms (time to first byte likewise), with the accounting on;
throughput ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
BODY = {"prompt": "The quick brown fox", "max_tokens": 1}


def say(text: str) -> None:
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


UNMETERED = ":unmetered"  # a door loop name's suffix: the door with its per-request accounting off


# -- the servers under test, each in a process of its own ----------------------------------------------------


def serve_door(upstream: str, port: int, metrics_port: int, model: str, loop: str) -> None:
    """tunerd's door as the daemon runs it, with its metrics on `metrics_port`; `loop` ending in
    UNMETERED: without its per-request accounting (the proxy times a request only when the door gives
    it a recorder)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from tunerd.door import Door, DoorConfig

    class Unmetered(Door):
        _record = None  # type: ignore[assignment]

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # for sigwait, in every thread
    registry = CollectorRegistry()
    loop, metered = loop.removesuffix(UNMETERED), not loop.endswith(UNMETERED)
    config = DoorConfig(port=port, event_loop=loop)  # type: ignore[arg-type]
    kind = Door if metered else Unmetered
    door = kind(config, post=lambda event: None, registry=registry, model_dir=model)
    door.start()
    door.set_max_model_len(512)
    door.set_upstream(upstream, "serving")
    start_http_server(metrics_port, "127.0.0.1", registry=registry)
    while not door.limits_state().tokenizer_loaded:
        time.sleep(0.05)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    door.stop()


def serve_asgi(upstream: str, port: int) -> None:
    """The alternative stack, minimal: uvicorn (its defaults: httptools, uvloop) + a raw ASGI app +
    httpx.AsyncClient, streaming both ways. No admission, no metrics: a floor for that stack."""
    import httpx
    import uvicorn

    hop = set(b"connection keep-alive proxy-connection te trailer transfer-encoding upgrade".split())
    state: dict[str, httpx.AsyncClient] = {}

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if "client" not in state:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=2.0)
            state["client"] = httpx.AsyncClient(timeout=None, limits=limits)
        client = state["client"]
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in hop | {b"content-length"}]
        query = scope["query_string"].decode()
        target = upstream + scope["raw_path"].decode() + (f"?{query}" if query else "")
        request = client.build_request(scope["method"], target, headers=headers, content=body)
        response = await client.send(request, stream=True)
        out = [(k, v) for k, v in response.headers.raw if k.lower() not in hop]
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        await response.aclose()

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_null(port: int) -> None:
    """An upstream that costs nothing: a fixed answer at once (aiohttp)."""
    from aiohttp import web

    answer = b'{"choices":[{"text":"y","finish_reason":"length"}]}'

    async def handle(request: web.BaseRequest) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async def main() -> None:
        runner = web.ServerRunner(web.Server(handle, access_log=None))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


# -- the client ---------------------------------------------------------------------------------------------


async def one(session: aiohttp.ClientSession, url: str, body: dict, stream: bool) -> tuple[float, int]:
    """(seconds to the first body chunk for a stream, else to the whole answer; tokens received)."""
    started = time.perf_counter()
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.read())[:200]!r}")
        if not stream:
            await response.read()
            return time.perf_counter() - started, 1
        first, tokens = None, 0
        async for chunk in response.content.iter_any():
            if first is None:
                first = time.perf_counter() - started
            tokens += chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
        assert first is not None
        return first, tokens


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def latency_round(sessions: dict, urls: dict, body: dict, n: int, stream: bool) -> dict[str, list]:
    """`n` requests per target, one at a time, the targets interleaved (their order rotates)."""
    seen: dict[str, list[float]] = {t: [] for t in urls}
    order = list(urls)
    for i in range(n):
        for target in order[i % len(order) :] + order[: i % len(order)]:
            seen[target].append((await one(sessions[target], urls[target], body, stream))[0])
    return seen


async def throughput(session: aiohttp.ClientSession, url: str, body: dict, streams: int, each: int) -> float:
    async def client() -> int:
        return sum([(await one(session, url, body, True))[1] for _ in range(each)])

    started = time.perf_counter()
    got = await asyncio.gather(*(client() for _ in range(streams)))
    return sum(got) / (time.perf_counter() - started)


def spread(values: list[float], unit: str = "ms", scale: float = 1e3) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):8.3f} {unit} ({min(v):.3f}..{max(v):.3f})"


def sessions_for(urls: dict) -> dict[str, aiohttp.ClientSession]:
    # Keep-alive shorter than uvicorn's 5 s: a POST on a connection the server is closing is not retried.
    return {
        t: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)) for t in urls
    }


def added_lines(title: str, urls: dict, p50: dict, p99: dict, limit50: float, limit99: float) -> None:
    say(title)
    for t in urls:
        say(f"  {t:12s} p50 {spread(p50[t])}   p99 {spread(p99[t])}")
    for t in urls:
        if t == "direct":
            continue
        add50 = [a - b for a, b in zip(p50[t], p50["direct"], strict=True)]
        add99 = [a - b for a, b in zip(p99[t], p99["direct"], strict=True)]
        ok50 = "PASS" if statistics.median(add50) < limit50 else "MISS"
        ok99 = "PASS" if statistics.median(add99) < limit99 else "MISS"
        say(f"  added by {t:12s} p50 {spread(add50)} [< {limit50 * 1e3:g} ms: {ok50}]")
        say(f"  {'':21s} p99 {spread(add99)} [< {limit99 * 1e3:g} ms: {ok99}]")


def accounting_lines(title: str, metered: str, p50: dict, p99: dict) -> None:
    """What the per-request accounting adds: `metered`'s latency minus the unmetered door's, per repeat
    (both measured in the same rounds, interleaved)."""
    add50 = [a - b for a, b in zip(p50[metered], p50["door-unmetered"], strict=True)]
    add99 = [a - b for a, b in zip(p99[metered], p99["door-unmetered"], strict=True)]
    say(f"  per-request accounting ({title}: {metered} - door-unmetered)")
    say(f"  {'':21s} p50 {spread(add50)}   p99 {spread(add99)}")


async def against_vllm(args: argparse.Namespace, urls: dict[str, str], model: str) -> None:
    plain = {"model": model, **BODY}
    streamed = {"model": model, "prompt": BODY["prompt"], "max_tokens": 4, "stream": True, "ignore_eos": True}
    heavy = {**streamed, "max_tokens": args.stream_tokens}
    sessions = sessions_for(urls)
    try:
        say("warm-up")
        for body, stream in ((plain, False), (streamed, True)):
            await latency_round(sessions, urls, body, 20, stream)
        for t in urls:
            await throughput(sessions[t], urls[t], {**heavy, "max_tokens": 8}, args.streams, 1)
        stats: dict[str, dict[str, list[float]]] = {
            k: {t: [] for t in urls} for k in ("p50", "p99", "t50", "t99")
        }
        tput: dict[str, list[float]] = {t: [] for t in urls}
        for r in range(args.repeats):
            lat = await latency_round(sessions, urls, plain, args.requests, False)
            ttfb = await latency_round(sessions, urls, streamed, args.requests, True)
            for t in urls:
                stats["p50"][t].append(pct(lat[t], 0.5))
                stats["p99"][t].append(pct(lat[t], 0.99))
                stats["t50"][t].append(pct(ttfb[t], 0.5))
                stats["t99"][t].append(pct(ttfb[t], 0.99))
            for t in list(urls)[r % len(urls) :] + list(urls)[: r % len(urls)]:
                tput[t].append(
                    await throughput(sessions[t], urls[t], heavy, args.streams, args.stream_requests)
                )
            say(f"  repeat {r + 1}/{args.repeats} done (load average {os.getloadavg()[0]:.2f})")
    finally:
        for s in sessions.values():
            await s.close()
    say("")
    say(f"against vLLM: {args.repeats} repeats x {args.requests} requests per target and kind")
    added_lines(
        "non-streaming request latency (max_tokens 1)", urls, stats["p50"], stats["p99"], 0.6e-3, 3e-3
    )
    accounting_lines("request latency", "door", stats["p50"], stats["p99"])
    added_lines("time to first streamed byte", urls, stats["t50"], stats["t99"], 0.6e-3, 3e-3)
    accounting_lines("time to first byte", "door", stats["t50"], stats["t99"])
    shape = (
        f"{args.streams} concurrent streams x {args.stream_requests} requests x {args.stream_tokens} tokens"
    )
    say(f"throughput: {shape}")
    for t in urls:
        say(f"  {t:12s} {spread(tput[t], 'tok/s', 1.0)}")
    for t in urls:
        if t != "direct":
            ratio = [a / b for a, b in zip(tput[t], tput["direct"], strict=True)]
            verdict = "PASS" if statistics.median(ratio) >= 0.95 else "MISS"
            say(f"  ratio {t:12s}/direct {spread(ratio, '', 1.0)} [>= 0.95: {verdict}]")


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def against_null(args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int]) -> None:
    n = args.null_requests
    sessions = sessions_for(urls)
    p50: dict[str, list[float]] = {t: [] for t in urls}
    p99: dict[str, list[float]] = {t: [] for t in urls}
    cpu: dict[str, list[float]] = {t: [] for t in urls}
    try:
        await latency_round(sessions, urls, BODY, 200, False)
        for _ in range(args.repeats):
            before = {t: proc_cpu_s(pid) for t, pid in pids.items()}
            lat = await latency_round(sessions, urls, BODY, n, False)
            for t in urls:
                p50[t].append(pct(lat[t], 0.5))
                p99[t].append(pct(lat[t], 0.99))
                served = n * (len(urls) if t == "direct" else 1)  # the upstream serves every target
                cpu[t].append((proc_cpu_s(pids[t]) - before[t]) / served)
    finally:
        for s in sessions.values():
            await s.close()
    say("")
    say(f"the proxies alone, against a null upstream: {args.repeats} repeats x {n} requests per target")
    added_lines("request latency", urls, p50, p99, 0.6e-3, 3e-3)
    accounting_lines("request latency", "door-uvloop", p50, p99)
    say("CPU time per request of the serving process (user + system; direct: the null upstream itself)")
    for t in urls:
        say(f"  {t:12s} {spread(cpu[t], 'us', 1e6)}")


def door_histogram(metrics_url: str) -> str:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "tunerd_door_added_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
    total = buckets[float("inf")]
    shares = ", ".join(
        f"<= {le * 1e3:g} ms {100 * buckets[le] / total:.1f} %" for le in (0.0005, 0.001, 0.003)
    )
    return f"{int(total)} requests: {shares}"


# -- processes ----------------------------------------------------------------------------------------------


class Children:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        out = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.procs.append(proc)
        return proc

    def serve(self, name: str, args: list[str], health: str) -> int:
        """Start this script in a serving mode; wait until `health` answers 200; return its pid."""
        proc = self.start(name, [sys.executable, str(Path(__file__).resolve()), *args])
        wait_http(health, proc, self.work / f"{name}.log", 60)
        return proc.pid

    def proxies(
        self, upstream: str, model: Path, loops: dict[str, str | None], metrics_port: int
    ) -> tuple[dict[str, str], dict[str, int]]:
        """The targets: `upstream` direct, and a door (on the named event loop) or the ASGI pass-through
        (loop None) in front of it; their completion URLs and the proxies' pids."""
        urls, pids = {"direct": f"{upstream}/v1/completions"}, {}
        for name, loop in loops.items():
            port = free_port()
            mode = ["--serve-door", upstream, str(port), str(metrics_port), str(model), loop] if loop else []
            mode = mode or ["--serve-asgi", upstream, str(port)]
            pids[name] = self.serve(name, mode, f"http://127.0.0.1:{port}/health")
            urls[name] = f"http://127.0.0.1:{port}/v1/completions"
            metrics_port = free_port()  # only the first door's metrics are read
        return urls, pids

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, budget_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited {proc.returncode}; see {log}")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer 200 within {budget_s:g} s; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--null-requests", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stream-requests", type=int, default=2)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--upstream", help="a vLLM already serving --model (e.g. http://127.0.0.1:8000)")
    parser.add_argument(
        "--serve-door", nargs=5, metavar=("UPSTREAM", "PORT", "METRICS_PORT", "MODEL", "LOOP")
    )
    parser.add_argument("--serve-asgi", nargs=2, metavar=("UPSTREAM", "PORT"))
    parser.add_argument("--serve-null", metavar="PORT")
    args = parser.parse_args()
    if args.serve_door:
        up, port, metrics_port, model, loop = args.serve_door
        return serve_door(up, int(port), int(metrics_port), model, loop)
    if args.serve_asgi:
        return serve_asgi(args.serve_asgi[0], int(args.serve_asgi[1]))
    if args.serve_null:
        return serve_null(int(args.serve_null))
    if args.upstream and args.model is None:
        parser.error("--upstream needs --model (the model it serves)")

    work = Path(tempfile.mkdtemp(prefix="front-door-bench-"))
    say(
        f"machine: {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at the start; work dir {work}"
    )
    model = args.model or work / "tiny"
    if args.model is None:
        script = str(REPO / "scripts" / "make-tiny-model.py")
        subprocess.run([sys.executable, script, str(model)], check=True, capture_output=True)
    children = Children(work)
    try:
        upstream = args.upstream.rstrip("/") if args.upstream else start_vllm(children, model)
        metrics_port = free_port()
        doors = {"door": "auto", "door-unmetered": "auto" + UNMETERED, "asgi": None}
        urls, pids = children.proxies(upstream, model, doors, metrics_port)
        asyncio.run(against_vllm(args, urls, str(model)))
        histogram = door_histogram(f"http://127.0.0.1:{metrics_port}/metrics")
        say(f"door's own added-latency histogram: {histogram}")

        null_port = free_port()
        null_pid = children.serve(
            "null", ["--serve-null", str(null_port)], f"http://127.0.0.1:{null_port}/health"
        )
        loops = {
            "door-asyncio": "asyncio",
            "door-uvloop": "uvloop",
            "door-unmetered": "uvloop" + UNMETERED,
            "asgi": None,
        }
        urls, pids = children.proxies(f"http://127.0.0.1:{null_port}", model, loops, free_port())
        asyncio.run(against_null(args, urls, {**pids, "direct": null_pid}))
        say(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    finally:
        children.stop()


def start_vllm(children: Children, model: Path) -> str:
    """Real vLLM on the CPU, as the issue prescribes (never --enforce-eager); its URL once it serves."""
    upstream = f"http://127.0.0.1:{free_port()}"
    work = children.work
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.setdefault("VLLM_CACHE_ROOT", str(work / "cache" / "vllm"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "cache" / "inductor"))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--port", upstream.rsplit(":", 1)[1], "--max-model-len", "512"]
    cmd += ["--kv-cache-memory-bytes", "100000000", "--block-size", "32"]
    say("starting vLLM (30-90 s on a CPU)")
    started = time.monotonic()
    wait_http(f"{upstream}/health", children.start("vllm", cmd, env), work / "vllm.log", 900)
    say(f"vLLM serving after {time.monotonic() - started:.0f} s")
    return upstream


if __name__ == "__main__":
    main()
