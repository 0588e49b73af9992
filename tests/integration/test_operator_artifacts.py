"""The operators' artifacts beside the daemon: `etc/prometheus/tunerd-alerts.yml` passes `promtool check
rules` and its unit tests (`tests/prometheus/`: every alert fires on series that should fire it, and no
other alert fires there), and every metric the alerts and `etc/grafana/tunerd.json` query is one tunerd
or vLLM exports (tunerd's registry; vLLM's real /metrics captures).

promtool comes from Debian's `prometheus` package, unpacked (not installed: no service is started) into
a cache dir when it is not on PATH; TUNERD_REQUIRE_PROMTOOL=1 (scripts/test.sh) makes a machine where
that fails a failure instead of a skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO
from tunerd.door.metrics import DoorMetrics
from tunerd.observe.signals import SIGNALS
from tunerd.records.metrics import Metrics

ALERTS = REPO / "etc" / "prometheus" / "tunerd-alerts.yml"
ALERT_TESTS = REPO / "tests" / "prometheus" / "tunerd-alerts.test.yml"
DASHBOARD = REPO / "etc" / "grafana" / "tunerd.json"
VLLM_CAPTURES = [*(REPO / "tests" / "fixtures").glob("vllm-*/metrics_*.prom")]
METRIC = re.compile(r"\b(?:tunerd_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def _unpacked_promtool() -> Path:
    """promtool from Debian's prometheus package, unpacked under the user's cache dir (19 MB, once)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tunerd-tests" / "prometheus"
    tool = cache / "usr" / "bin" / "promtool"
    if tool.exists():
        return tool
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise RuntimeError("promtool is not on PATH and there is no apt-get/dpkg to fetch Debian's package")
    with tempfile.TemporaryDirectory() as download:
        fetch = ["apt-get", "download", "-q", "prometheus"]
        done = subprocess.run(fetch, cwd=download, capture_output=True, text=True)
        if done.returncode != 0:  # a fresh machine: no package lists yet
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True)
            done = subprocess.run(fetch, cwd=download, capture_output=True, text=True)
        debs = list(Path(download).glob("prometheus_*.deb"))
        if done.returncode != 0 or not debs:
            raise RuntimeError(f"apt-get download prometheus failed: {done.stderr[-800:]}")
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg", "-x", str(debs[0]), str(cache)], check=True)
    return tool


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    try:
        return str(_unpacked_promtool())
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        if os.environ.get("TUNERD_REQUIRE_PROMTOOL") == "1":
            pytest.fail(f"TUNERD_REQUIRE_PROMTOOL=1 but no promtool: {exc}")
        pytest.skip(f"no promtool: {exc}")


def test_the_alert_rules_pass_promtool_check_and_their_unit_tests(promtool: str) -> None:
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", ALERT_TESTS.name], cwd=ALERT_TESTS.parent, capture_output=True, text=True
    )
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_alert_has_a_case_that_fires_it() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    cases = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t.get("exp_alerts")}
    assert alerts == fired, f"alerts without a firing case: {sorted(alerts - fired)}"


def exported_names() -> set[str]:
    """Every sample name tunerd's exporter can serve, and every one real vLLM served in the captures."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.set_signals({s.name: None for s in SIGNALS}, {s.name: s.unit for s in SIGNALS})
    DoorMetrics(registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = {"up"}
    for family in registry.collect():
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    for capture in VLLM_CAPTURES:
        for family in text_string_to_metric_families(capture.read_text()):
            names |= {sample.name for sample in family.samples}
    return names


def test_every_metric_the_alerts_and_the_dashboard_query_is_exported() -> None:
    assert VLLM_CAPTURES, "the vLLM /metrics captures are missing"
    known = exported_names()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    exprs += [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    unknown = sorted({name for expr in exprs for name in METRIC.findall(expr)} - known)
    assert not unknown, f"queried but exported by neither tunerd nor vLLM: {unknown}"
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert all(METRIC.search(t["expr"]) for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "tunerd"
    # The four indicators the operators watch together are on it.
    queried = " ".join(exprs)
    for indicator in ("memory_used_ratio", "page_fault_rate", "migration_bytes", "kv_cache_usage"):
        assert indicator in queried, indicator
