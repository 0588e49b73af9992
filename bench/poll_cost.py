#!/usr/bin/env python3
"""What the daemon's once-a-second observation costs, against real vLLM, checked against its budget.

    .venv/bin/python bench/poll_cost.py [--polls 300] [--model DIR] [--daemon-seconds 60]

Budget (absolute): the whole daemon, polling at 1 Hz, uses at most 1.5 % of one core, and its resident
memory stays under 100 MB.

Starts `tunerd run` on real vLLM (CPU build, a tiny model made on the spot unless --model is given),
waits until it serves and puts some load through it so the histograms hold data. Then:

- For information, in this process, alternating N times (CPU time, `time.process_time`, user + system,
  so the kernel's loopback work counts), medians with spread:
    full parse  `prometheus_client.parser.text_string_to_metric_families` over the whole /metrics text
                (fetched untimed just before)
    extract     `extract` over the filtered answer the poll gets: what a poll parses when vLLM's
                figures moved (a busy server)
    poll cycle  one tunerd poll: scrape of vLLM (name[]-filtered, keep-alive) + extraction + host
                sample + GPU sample + signal-window update, what the daemon's poll job and main loop do;
                vLLM is idle here, so its answer repeats and is not parsed again (`SameBodySameSample`):
                how many of the cycles' answers repeated the one before is printed too
  and a breakdown of the cycle.
- The verdict: the running `tunerd run` process itself, left alone for --daemon-seconds: its CPU share
  (utime + stime from /proc/<pid>/stat over that interval, in percent of one core) and its resident
  memory (VmRSS now and VmHWM, the peak, from /proc/<pid>/status; the peak is what is checked), each
  printed against the budget with PASS or MISS. Exits 1 if either misses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tunerd.observe.poller import Poller, PollTarget
from tunerd.observe.signals import SignalWindow
from tunerd.observe.vllm_metrics import extract, filtered_metrics_url, scrape

REPO = Path(__file__).resolve().parents[1]


def say(text: str) -> None:
    print(text, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(work: Path, model: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cache = work / "cache"
    config = work / "tunerd.toml"
    config.write_text(
        f"""
[engine]
command = ["{sys.executable}", "-m", "vllm.entrypoints.openai.api_server"]
model = "{model}"
port = {port}
[engine.env]
HF_HUB_OFFLINE = "1"
VLLM_CACHE_ROOT = "{cache}/vllm"
TORCHINDUCTOR_CACHE_DIR = "{cache}/inductor"
[engine.params]
max_model_len = 512
kv_cache_memory_bytes = 1000000
block_size = 32
max_num_seqs = 16
[timeouts]
startup_s = 600.0
[observe]
poll_interval_s = 1.0
[paths]
state_dir = "{work}/state"
[export]
port = 0
[logging]
format = "json"
"""
    )
    log = open(work / "tunerd.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    daemon = subprocess.Popen(
        [sys.executable, "-m", "tunerd", "run", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return daemon, port


def wait_running(work: Path, daemon: subprocess.Popen[bytes]) -> dict:
    started = time.monotonic()
    while True:
        if daemon.poll() is not None:
            raise SystemExit(f"tunerd exited with {daemon.returncode}; see {work}/tunerd.log")
        try:
            address = (work / "state" / "export.addr").read_text().strip()
            status = httpx.get(f"http://{address}/status", timeout=2).json()
            if status["engine"]["state"] == "RUNNING":
                say(f"   vLLM serving after {time.monotonic() - started:.0f} s")
                return status
        except (OSError, httpx.HTTPError, KeyError, ValueError):
            pass
        if int(time.monotonic() - started) % 15 == 0:
            say(f"   waiting for vLLM to come up ({time.monotonic() - started:.0f} s)")
        time.sleep(1)


def warm_up(base_url: str, model: Path) -> None:
    body = {"model": str(model), "prompt": "The quick brown fox", "max_tokens": 64, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: httpx.post(f"{base_url}/v1/completions", json=body, timeout=120), range(8)))


def cpu_ms(fn: Callable[[], object]) -> float:
    started = time.process_time_ns()
    fn()
    return (time.process_time_ns() - started) / 1e6


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_memory(pid: int) -> dict[str, float]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10)
    return f"median {statistics.median(values):.3f} ms  (p10 {q[0]:.3f}, p90 {q[-1]:.3f}, n={len(values)})"


def measure(base_url: str, root_pid: int, polls: int) -> None:
    poller = Poller(None)
    poller.target = PollTarget(1, base_url, root_pid)
    window = SignalWindow(60.0)
    client = httpx.Client(trust_env=False)
    full, parsed, cycle, scrape_only, host_only, gpu_only, window_only = [], [], [], [], [], [], []
    sizes, answers = [], []
    filtered = filtered_metrics_url(base_url, cache_config=False)
    for i in range(polls):
        text = client.get(f"{base_url}/metrics").text
        sizes.append(text.count("\n"))
        full.append(cpu_ms(lambda t=text: list(text_string_to_metric_families(t))))
        answer = client.get(filtered).text
        parsed.append(cpu_ms(lambda a=answer: extract(a)))

        def one_cycle() -> None:
            sample = poller.poll()
            window.update(sample.taken_at, sample.scrape.sample if sample.scrape else None, sample.readings)
            answers.append(sample.scrape.sample if sample.scrape else None)

        cycle.append(cpu_ms(one_cycle))
        if i % 3 == 0:  # the parts, on their own, for the breakdown
            scrape_only.append(cpu_ms(lambda: poller._scrape(poller.target)))
            host_only.append(cpu_ms(lambda: poller.host.sample(poller._pids)))
            gpu_only.append(cpu_ms(lambda: poller.gpu.sample(poller._pids)))
            sample = poller.poll()
            engine = sample.scrape.sample if sample.scrape else None
            window_only.append(cpu_ms(lambda s=sample, e=engine: window.update(s.taken_at, e, s.readings)))
        time.sleep(0.02)
    last = poller.poll()
    assert last.scrape is not None and last.scrape.error is None, last.scrape
    # What the first scrape of a run asks for on top: vllm:cache_config_info, static for a run.
    first = scrape(client, filtered_metrics_url(base_url, cache_config=True))
    say(
        f"\n/metrics: {statistics.median(sizes):.0f} lines in full; the poll asks for "
        f"{last.scrape.body_bytes} bytes of it (name[] filter; {first.body_bytes} bytes on a run's first "
        "poll, with vllm:cache_config_info)"
    )
    repeated = sum(1 for before, now in itertools.pairwise(answers) if now is before)
    say(f"full parse of the page (prometheus_client.parser)      {spread(full)}")
    say(f"extract of the poll's answer (vLLM's figures moved)    {spread(parsed)}")
    say(f"one poll cycle (scrape+extract+host+GPU+signals)       {spread(cycle)}")
    say(
        f"   idle vLLM: {repeated} of the {len(answers) - 1} answers after the first repeated the one"
        " before and were not parsed again"
    )
    say(
        f"   scrape {statistics.median(scrape_only):.3f} ms"
        f" · host {statistics.median(host_only):.3f} ms"
        f" · GPU {statistics.median(gpu_only):.3f} ms ({'no GPU' if not last.gpu.available else 'NVML'})"
        f" · signal window {statistics.median(window_only):.3f} ms"
    )
    say(
        "   (the parts are timed on their own right after a cycle, with warmer caches than the cycle's"
        " own, which starts cold after the sleep: they may add up to less than the cycle)"
    )
    poller.close()


CPU_BUDGET_PERCENT = 1.5  # of one core, the whole daemon polling at 1 Hz
RSS_BUDGET_MB = 100.0


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def judge_daemon(pid: int, seconds: float) -> bool:
    """Print the daemon's CPU share and RSS against the budget; True if both are within it."""
    cpu_before, wall_before = proc_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    cpu_used, wall = proc_cpu_seconds(pid) - cpu_before, time.monotonic() - wall_before
    memory = proc_memory(pid)
    share = 100 * cpu_used / wall
    cpu_ok, rss_ok = share <= CPU_BUDGET_PERCENT, memory["VmHWM"] < RSS_BUDGET_MB
    say(
        f"DAEMON CPU  {share:.2f} % of one core ({cpu_used:.2f} s of CPU in {wall:.1f} s, pid {pid})"
        f"   budget <= {CPU_BUDGET_PERCENT} %: {verdict(cpu_ok)}"
    )
    say(
        f"DAEMON RSS  peak {memory['VmHWM']:.1f} MB (now {memory['VmRSS']:.1f} MB)"
        f"   budget < {RSS_BUDGET_MB:.0f} MB: {verdict(rss_ok)}"
    )
    return cpu_ok and rss_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--polls", type=int, default=300)
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny one made now)")
    parser.add_argument(
        "--daemon-seconds", type=float, default=60.0, help="how long to watch the daemon's CPU"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tunerd-poll-cost-"))
    model = args.model
    if model is None:
        model = work / "model"
        say("1. making a tiny model")
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "make-tiny-model.py"), str(model)],
            check=True,
            capture_output=True,
        )
    say("2. starting tunerd on real vLLM (30-90 s on a CPU)")
    daemon, port = start_daemon(work, model)
    try:
        status = wait_running(work, daemon)
        base_url = f"http://127.0.0.1:{port}"
        say("3. warming vLLM up (8 requests) so its histograms hold data")
        warm_up(base_url, model)
        say(f"4. {args.polls} alternating measurements in this process")
        measure(base_url, status["engine"]["pid"], args.polls)
        say(f"5. the daemon itself, polling every 1 s, left alone for {args.daemon_seconds:.0f} s")
        passed = judge_daemon(daemon.pid, args.daemon_seconds)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
    say(json.dumps({"work_dir": str(work)}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
