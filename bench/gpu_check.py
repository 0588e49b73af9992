#!/usr/bin/env python3
"""tunerd's GPU collector next to nvidia-smi, on a GPU host, while tunerd runs real vLLM.

    python bench/gpu_check.py --model DIR [--command "vllm serve"] [--out DIR] [-- EXTRA VLLM ARGS]

1. nvidia-smi and the collector while nothing runs;
2. `tunerd run` with vLLM (gpu_memory_utilization 0.5 unless given); once it serves: the collector
   (memory total/used/free, utilization, PCIe TX/RX, power, the engine's per-process memory, NUMA
   node) beside nvidia-smi's numbers, idle and under a burst of requests;
3. a tuning-style restart to gpu_memory_utilization 0.6 (`tunerd restart --set …`), so the two
   start-up logs show how vLLM sized the KV cache at each utilization (the planner's calibration);
4. SIGTERM: every process gone, GPU memory returned.
Everything is printed and written to --out (status documents, journal, engine logs, nvidia-smi).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "daemon"))

from tunerd.observe.gpu import GpuCollector  # noqa: E402
from tunerd.procfs import processes as procfs  # noqa: E402

SMI_QUERY = "memory.total,memory.used,memory.free,utilization.gpu,power.draw,pci.bus_id"


def say(text: str) -> None:
    print(text, flush=True)


def smi(out: Path, name: str) -> dict[str, Any]:
    """nvidia-smi's view: the query fields, the compute apps, and one PCIe throughput sample (dmon)."""
    query = subprocess.run(
        ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    dmon = subprocess.run(["nvidia-smi", "dmon", "-s", "t", "-c", "1"], capture_output=True, text=True).stdout
    (out / f"nvidia_smi_{name}.txt").write_text(query + "\n\n" + apps + "\n\n" + dmon)
    fields = dict(zip(SMI_QUERY.split(","), (v.strip() for v in query.split(",")), strict=False))
    rows = [line for line in dmon.splitlines() if line.strip() and not line.startswith("#")]
    pcie = rows[-1].split() if rows else []
    return {
        "query": fields,
        "apps": apps.splitlines(),
        "dmon_rx_tx_MBps": pcie[1:3] if len(pcie) >= 3 else pcie,
    }


def collector(gpu: GpuCollector, pids: list[int]) -> dict[str, Any]:
    sample = gpu.sample(pids)
    devices = [asdict(d) for d in sample.devices]
    for device in devices:
        device["unsupported"] = sorted(device.get("unsupported") or ())
    return {
        "available": sample.available,
        "reason": sample.reason,
        "devices": devices,
        "readings": sample.as_readings(),
    }


def compare(label: str, col: dict[str, Any], nvsmi: dict[str, Any]) -> None:
    mib = 1 << 20
    if not col["devices"]:
        say(f"{label}: collector: {col['reason']}")
        return
    d = col["devices"][0]
    q = nvsmi["query"]

    def m(v: Any) -> str:
        return "—" if v is None else f"{v / mib:,.0f} MiB"

    say(f"{label}:")
    say(f"   memory total   collector {m(d['mem_total_bytes'])}  nvidia-smi {q.get('memory.total')} MiB")
    say(f"   memory used    collector {m(d['mem_used_bytes'])}  nvidia-smi {q.get('memory.used')} MiB")
    say(f"   memory free    collector {m(d['mem_free_bytes'])}  nvidia-smi {q.get('memory.free')} MiB")
    say(f"   utilization    collector {d['util_percent']} %  nvidia-smi {q.get('utilization.gpu')} %")
    say(f"   power          collector {d['power_watts']} W  nvidia-smi {q.get('power.draw')} W")
    tx, rx = d["pcie_tx_bytes_per_s"], d["pcie_rx_bytes_per_s"]
    say(f"   PCIe TX/RX     collector {tx} / {rx} B/s  nvidia-smi dmon rx/tx {nvsmi['dmon_rx_tx_MBps']} MB/s")
    say(f"   engine memory  collector {m(d['engine_mem_bytes'])}  nvidia-smi apps {nvsmi['apps']}")
    say(f"   NUMA node      collector {d['numa_node']}  (bus {d['pci_bus_id']}, source {d['memory_source']})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tunerd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tunerd", *args], capture_output=True, text=True, timeout=60)


def wait_running(config: Path, not_pid: int | None = None, timeout: float = 400) -> dict[str, Any]:
    """The status once vLLM serves (a process other than `not_pid`, after a restart)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = tunerd("status", "--json", "--config", str(config))
        if done.returncode == 0:
            status = json.loads(done.stdout)
            if status["engine"]["state"] == "RUNNING" and status["engine"]["pid"] != not_pid:
                return status
            if status["engine"]["state"] == "FATAL":
                raise SystemExit(f"FATAL: {status['engine']['fatal_reason']}")
        time.sleep(2)
    raise SystemExit("vLLM did not come up in time")


def burst(port: int, model: str, n: int = 32, tokens: int = 256) -> None:
    body = {"model": model, "prompt": "Hello there", "max_tokens": tokens, "ignore_eos": True}
    threads = [
        threading.Thread(
            target=lambda: httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
        )
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--command", default="vllm serve")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="gpu-check-")))
    parser.add_argument("--utilization", type=float, default=0.5)
    parser.add_argument("extra", nargs="*", help="extra vLLM arguments (after --)")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = f"{REPO / 'daemon'}:{os.environ.get('PYTHONPATH', '')}"
    gpu = GpuCollector()

    say("== idle, no vLLM")
    compare("idle", collector(gpu, []), smi(out, "idle"))

    port = free_port()
    config = out / "tunerd.toml"
    config.write_text(
        f"""[engine]
command = {json.dumps(shlex.split(args.command))}
model = "{args.model}"
port = {port}
extra_args = {json.dumps(args.extra)}
[engine.params]
max_model_len = 4096
gpu_memory_utilization = {args.utilization}
[timeouts]
startup_s = 400.0
[paths]
state_dir = "{out / "state"}"
[export]
port = 0
[logging]
format = "json"
"""
    )
    log = open(out / "tunerd.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    daemon = subprocess.Popen(
        [sys.executable, "-m", "tunerd", "run", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        say(f"== tunerd run (vLLM at gpu_memory_utilization {args.utilization}); waiting for RUNNING")
        status = wait_running(config)
        pids = procfs.process_tree_pids(status["engine"]["pid"])
        (out / "status_running.json").write_text(json.dumps(status, indent=2))
        compare("vLLM serving, idle", collector(gpu, pids), smi(out, "running"))
        load = threading.Thread(target=burst, args=(port, args.model))
        load.start()
        time.sleep(1.0)
        compare("vLLM under a burst of 32 x 256 tokens", collector(gpu, pids), smi(out, "load"))
        load.join()
        status = json.loads(tunerd("status", "--json", "--config", str(config)).stdout)
        (out / "status_after_load.json").write_text(json.dumps(status, indent=2))
        say(
            "   daemon signals: "
            + json.dumps({k: v["value"] for k, v in status["signals"].items() if k.startswith("gpu.")})
        )

        say("== tuning-style restart to gpu_memory_utilization 0.6")
        print(
            tunerd("restart", "--set", "gpu_memory_utilization=0.6", "--config", str(config)).stdout.strip()
        )
        wait_running(config, not_pid=status["engine"]["pid"])
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=120)
    time.sleep(1)
    marker = json.loads((out / "state" / "state.json").read_text())["instance_id"]
    left = procfs.pids_with_env("TUNERD_INSTANCE", marker)
    say(f"== tunerd stopped with exit code {code}; processes of its vLLM left: {left}")
    compare("after stop", collector(gpu, []), smi(out, "after"))
    journal = tunerd("journal", "--config", str(config)).stdout
    (out / "journal.txt").write_text(journal)
    shutil.copytree(out / "state" / "engine-logs", out / "engine-logs", dirs_exist_ok=True)
    for line in journal.splitlines():
        if any(
            k in line
            for k in ("engine.ready", "engine.identity", "preflight.passed", "engine.stopped", "intent")
        ):
            say("   " + line[:300])
    gpu.close()
    say(f"== captures in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
