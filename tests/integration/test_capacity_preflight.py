"""The capacity planner inside every start's preflight: a configuration it refuses is a journal entry
with the figures, not a launch; one that fits is started, with the prediction beside vLLM's report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO, alive, running_daemon
from tests.integration.conftest import fake_sections

CONFIGS = REPO / "tests" / "unit" / "model_configs"


def llama_70b_without_weights(target: Path) -> Path:
    """Llama 3 70B's real config.json and a shard index declaring its 141 GB (no weights needed)."""
    target.mkdir()
    config = json.loads((CONFIGS / "llama-3-70b.json").read_text())
    (target / "config.json").write_text(json.dumps(config))
    index = {
        "metadata": {"total_size": 141_107_412_992},
        "weight_map": {"lm_head.weight": "model-00030-of-00030.safetensors"},
    }
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def test_a_configuration_the_planner_refuses_is_never_launched(workdir: Path) -> None:
    sections = fake_sections(workdir)
    sections["engine"]["model"] = str(llama_70b_without_weights(workdir / "llama-70b"))
    with running_daemon(workdir, sections) as daemon:
        status = daemon.wait_state("FATAL")
        refused = daemon.wait_event("preflight.refused")
        assert refused["feasible"] is False and refused["band"] == "never"
        assert refused["weights_bytes"] >= 130 << 30 and refused["ratio"] > 2
        assert refused["reasons"], "the figures and the reasons are in the journal"
        assert "plan_refused" in status["engine"]["fatal_reason"]
        assert "engine.spawned" not in daemon.events()
        outcome = daemon.wait_record(lambda r: r["event"] == "outcome" and r["result"] == "failed")
        assert outcome["failure"]["kind"] == "plan_refused"


def test_a_configuration_that_fits_is_started_with_its_prediction_and_checks_journaled(
    workdir: Path, tiny_model: Path
) -> None:
    sections = fake_sections(workdir)
    sections["engine"]["model"] = str(tiny_model)
    with running_daemon(workdir, sections) as daemon:
        daemon.wait_state("RUNNING")
        plan = daemon.wait_event("preflight.plan")
        assert plan["feasible"] is True and plan["kv_bytes_per_token"] == 512
        assert plan["kv_cache_tokens"] == 1952  # 1,000,000 bytes // (32 x 512) = 61 blocks
        # The operator's checks come with the first start's plan, each with a verdict and its detail.
        checks = {c["check"]: c for c in plan["checks"]}
        assert {"swap", "memory"} <= set(checks)
        assert all(c["verdict"] in ("ok", "warn", "fail") and c["detail"] for c in checks.values())
        ready = daemon.wait_event("engine.ready")
        assert ready["predicted_kv_cache_tokens"] == ready["kv_cache_tokens"] == 1952
        calibrated = daemon.wait_event("planner.calibrated")
        assert calibrated["kv_cache_tokens"] == 1952
    assert (daemon.state_dir / "planner-calibration.json").exists()


def test_a_restart_to_a_value_the_planner_refuses_is_refused_before_anything_stops(
    workdir: Path, tiny_model: Path
) -> None:
    # On the H200 a `restart --set max_model_len=100000` stopped vLLM, then the preflight refused it.
    sections = fake_sections(workdir)
    sections["engine"]["model"] = str(tiny_model)
    with running_daemon(workdir, sections) as daemon:
        pid = daemon.wait_state("RUNNING")["engine"]["pid"]
        after = daemon.last_seq()
        config = str(daemon.config_path)
        asked = subprocess.run(
            [sys.executable, "-m", "tunerd", "restart", "--set", "max_model_len=100000", "--config", config],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert asked.returncode != 0 and "capacity planner refuses" in asked.stdout + asked.stderr, asked
        assert "max_model_len 100,000" in asked.stdout + asked.stderr
        assert not [r for r in daemon.records() if r["seq"] > after and r["event"] == "intent"]
        engine = daemon.status()["engine"]
        assert (engine["state"], engine["pid"], engine["params"]["max_model_len"]) == ("RUNNING", pid, 512)
        assert alive(pid)
