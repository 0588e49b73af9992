"""The Helm chart `deploy/kubernetes/`, rendered and validated offline: `helm lint --strict`, `helm template`
(Helm's own Go SDK through the `helm-python-sdk` wheel: no helm binary, no cluster), every object against
the Kubernetes JSON schemas `kubernetes-validate` ships (strict: an unknown field is an error), the
Prometheus operator's objects against `cloudcoil-models-prometheus-operator`'s models of its CRDs, and
the tunerd.toml and rules.toml the chart writes loaded by tunerd's own config loader.

The tools come with pyproject's `test` extra (scripts/test.sh installs it). Without them the tests skip,
except under TUNERD_REQUIRE_HELM=1 (scripts/test.sh), where a missing tool is a failure.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO
from tunerd.config import load_all

CHART = REPO / "deploy" / "kubernetes"
ALERTS = REPO / "etc" / "prometheus" / "tunerd-alerts.yml"
DASHBOARD = REPO / "etc" / "grafana" / "tunerd.json"
RULES = REPO / "etc" / "tunerd" / "rules.toml"
# The oldest Kubernetes release the chart is checked against, and the newest kubernetes-validate knows.
OLDEST_KUBERNETES = "1.30.0"

# Everything the chart can switch on at once: a StatefulSet on claims, the model from a claim, the
# shared memory's credentials from a Secret, the operator's own additions.
EVERYTHING = {
    "workload": "StatefulSet",
    "replicas": 4,
    "storage": {"state": {"type": "pvc", "storageClassName": "local"}, "cache": {"type": "pvc"}},
    "models": {"existingClaim": "models"},
    "memory": {"credentialsSecret": "tunerd-memory"},
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
    "podAnnotations": {"example.com/team": "inference"},
    "runtimeClassName": "nvidia",
    "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
    "monitoring": {
        "podMonitor": {"labels": {"release": "kps"}},
        "prometheusRule": {"labels": {"release": "kps"}},
    },
    "tunerd": {
        "door": {"port": 8080, "drain_timeout_s": 45, "max_in_flight": 32},
        "export": {"port": 9500},
        "timeouts": {"graceful_stop_s": 25},
        "engine": {"params": {"max_num_seqs": 64, "kv_cache_memory_bytes": 40_000_000_000}},
        "tuning": {"maintenance": [{"cron": "0 2 * * *", "duration_s": 7200}], "tolerance": 0.05},
        "objective": {"kind": "goodput", "ttft_s": 2, "tpot_s": 0.05},
        "paths": {"engine_log_max_bytes": 16777216},
    },
    "terminationGracePeriodSeconds": 120,
}
VARIANTS = {
    "defaults": {},
    "everything": EVERYTHING,
    "model-on-the-node": {"models": {"hostPath": "/srv/models"}},
}


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("TUNERD_REQUIRE_HELM") == "1":
            pytest.fail(f"TUNERD_REQUIRE_HELM=1 but {module} is missing (pyproject's test extra): {exc}")
        pytest.skip(f"{module} is not installed (pyproject's test extra): {exc}")


@pytest.fixture(scope="module")
def helm() -> Any:
    return _require("helm_python")


def render(helm: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`helm template` with these values: the objects, in the order of their templates."""
    rendered = helm.Chart.load(str(CHART)).render(
        copy.deepcopy(values), name="tunerd", namespace="inference", is_install=True
    )
    return [doc for name in sorted(rendered) for doc in yaml.safe_load_all(rendered[name]) if doc]


def one(objects: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind}*{suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    workloads = [o for o in objects if o["kind"] in ("DaemonSet", "StatefulSet")]
    assert len(workloads) == 1
    return workloads[0]["spec"]["template"]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (tunerd,) = pod_of(objects)["spec"]["containers"]
    return tunerd


def config_files(objects: list[dict[str, Any]], directory: Path) -> Path:
    """The ConfigMap's tunerd.toml and rules.toml written out as the pod sees them in /etc/tunerd."""
    data = one(objects, "ConfigMap", "tunerd")["data"]
    assert set(data) == {"tunerd.toml", "rules.toml"}
    for name, text in data.items():
        (directory / name).write_text(text)
    return directory / "tunerd.toml"


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


# -- helm lint and the schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_chart_passes_helm_lint_strict(helm: Any, variant: str) -> None:
    report = helm.lint(str(CHART), copy.deepcopy(VARIANTS[variant]) or None, strict=True)
    # Helm's severities: 1 info ("icon is recommended"), 2 warning, 3 error.
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert not serious and not report["errors"], report


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_validates_against_the_kubernetes_schemas(helm: Any, variant: str) -> None:
    kubernetes_validate = _require("kubernetes_validate")
    objects = render(helm, VARIANTS[variant])
    core = [o for o in objects if not o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {o["kind"] for o in core} >= {"ConfigMap", "Service"}
    for version in (OLDEST_KUBERNETES, kubernetes_validate.latest_version()):
        for obj in core:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {version}): {exc.message}")


def test_the_schema_check_catches_a_misspelt_field(helm: Any) -> None:
    """The validator is strict: a field Kubernetes does not know fails, as the apiserver would."""
    kubernetes_validate = _require("kubernetes_validate")
    pod = one(render(helm), "DaemonSet")
    pod["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, OLDEST_KUBERNETES, strict=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_prometheus_operator_objects_fit_its_crds(helm: Any, variant: str) -> None:
    """kubernetes-validate has no schemas for custom resources: the PodMonitor and the PrometheusRule are
    read by the models generated from the Prometheus operator's CRDs, and nothing may be dropped on the
    way (the models ignore unknown fields, so a misspelt one shows as missing from the round trip)."""
    models = _require("cloudcoil.models.prometheus_operator.v1")
    objects = render(helm, VARIANTS[variant])
    for kind in ("PodMonitor", "PrometheusRule"):
        obj = one(objects, kind)
        model = getattr(models, kind).model_validate(obj)
        again = model.model_dump(mode="json", by_alias=True, exclude_none=True)
        assert again["spec"] == obj["spec"], f"{kind}: fields the CRD does not know were dropped"


# -- what the pod runs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_config_the_chart_writes_loads_in_tunerd(helm: Any, variant: str, tmp_path: Path) -> None:
    loaded = load_all(config_files(render(helm, VARIANTS[variant]), tmp_path))
    config = loaded.config
    # The keys the chart owns: reachable from the Service and the kubelet, the state on its volume.
    assert config.door.enabled and config.door.host == "0.0.0.0"
    assert config.export.enabled and config.export.host == "0.0.0.0"
    assert str(config.paths.state_dir) == "/var/lib/tunerd"
    assert config.engine.host == "127.0.0.1"  # vLLM's port stays private to the pod
    assert loaded.rules is not None and loaded.rules_path == str(tmp_path / "rules.toml")


def test_values_reach_tunerd_toml_with_their_types(helm: Any, tmp_path: Path) -> None:
    """Helm reads every number of a values file as a float; the chart writes whole numbers as TOML
    integers (a strict integer key rejects 8000.0) and keeps fractions, lists and inline tables."""
    config = load_all(config_files(render(helm, EVERYTHING), tmp_path)).config
    assert config.door.port == 8080 and config.door.max_in_flight == 32
    assert config.export.port == 9500
    assert config.engine.params.max_num_seqs == 64
    assert config.engine.params.kv_cache_memory_bytes == 40_000_000_000
    assert config.paths.engine_log_max_bytes == 16777216
    assert config.objective.tpot_s == 0.05 and config.objective.ttft_s == 2.0
    assert [(w.cron, w.duration_s) for w in config.tuning.maintenance] == [("0 2 * * *", 7200.0)]
    assert "8080.0" not in (tmp_path / "tunerd.toml").read_text()


def test_the_rules_are_the_shipped_ones_unless_given(helm: Any) -> None:
    shipped = one(render(helm), "ConfigMap", "tunerd")["data"]["rules.toml"]
    assert shipped.strip() == RULES.read_text().strip()
    mine = '[[rule]]\nname = "x"\nall = ["kv_cache.usage_avg > 0.9"]\nfor_s = 60\naction = {kind = "alert"}\n'
    assert one(render(helm, {"rules": mine}), "ConfigMap", "tunerd")["data"]["rules.toml"] == mine


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tunerd_is_the_entrypoint_and_its_ports_are_the_services_and_probes(helm: Any, variant: str) -> None:
    objects = render(helm, VARIANTS[variant])
    tunerd = container(objects)
    assert tunerd["command"][:2] == ["tunerd", "run"]  # vLLM is its child, in this container
    assert len(pod_of(objects)["spec"]["containers"]) == 1  # no sidecar
    toml = tomllib.loads(one(objects, "ConfigMap", "tunerd")["data"]["tunerd.toml"])
    ports = {p["name"]: p["containerPort"] for p in tunerd["ports"]}
    assert ports == {"door": toml["door"]["port"], "export": toml["export"]["port"]}
    service = one(objects, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["door"]
    # Liveness from tunerd's own endpoint, never vLLM's /health (it fails during every trial's restart).
    liveness = tunerd["livenessProbe"]
    assert liveness["httpGet"] == {"path": "/status", "port": "export"}
    assert all(toml["engine"]["port"] != v and v != "/health" for v in walk(liveness))
    readiness = " ".join(tunerd["readinessProbe"]["exec"]["command"])
    assert f"127.0.0.1:{toml['export']['port']}/status" in readiness
    assert "startupProbe" not in tunerd
    monitor = one(objects, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_of(objects)["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod_of(objects)["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "export" and endpoint["path"] == "/metrics"
    # The alerts select job="tunerd" (TunerdDown: up{job="tunerd"} == 0).
    assert {"action": "replace", "targetLabel": "job", "replacement": "tunerd"} in endpoint["relabelings"]
    grace = pod_of(objects)["spec"]["terminationGracePeriodSeconds"]
    assert grace > toml["door"]["drain_timeout_s"] + toml["timeouts"]["graceful_stop_s"] + 10


def test_a_grace_period_within_the_drain_and_stop_is_refused(helm: Any) -> None:
    with pytest.raises(helm.HelmError, match=r"terminationGracePeriodSeconds: 70 must be above .* = 70"):
        render(helm, {"terminationGracePeriodSeconds": 70})
    with pytest.raises(helm.HelmError, match=r"= 100"):  # the drain the operator set counts
        render(helm, {"terminationGracePeriodSeconds": 90, "tunerd": {"door": {"drain_timeout_s": 60}}})


def test_the_front_door_off_is_refused(helm: Any) -> None:
    with pytest.raises(helm.HelmError, match=r"tunerd\.door\.enabled"):
        render(helm, {"tunerd": {"door": {"enabled": False}}})


def test_one_pod_per_node_of_the_hardware_class(helm: Any) -> None:
    daemonset = render(helm)
    spec = pod_of(daemonset)["spec"]
    assert one(daemonset, "DaemonSet")["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    # The GPU product, which NVML reports on GB10 too; never the memory label it cannot fill there.
    assert "nvidia.com/gpu.product" in spec["nodeSelector"]
    assert not any("gpu.memory" in str(node) for node in walk(spec))
    assert container(daemonset)["resources"]["limits"]["nvidia.com/gpu"] == 1
    statefulset = one(render(helm, EVERYTHING), "StatefulSet")
    anti = statefulset["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert statefulset["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]  # the operator's, kept


def test_the_state_directory_outlives_the_pod(helm: Any) -> None:
    """The journal, the state file (last-known-good) and the tuning memory are under /var/lib/tunerd:
    on the node (DaemonSet) or on the pod's own claim (StatefulSet), never in the container."""
    mounts = {m["mountPath"]: m["name"] for m in container(render(helm))["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_of(render(helm))["spec"]["volumes"]}
    assert volumes[mounts["/var/lib/tunerd"]]["hostPath"]["path"] == "/var/lib/tunerd"
    statefulset = one(render(helm, EVERYTHING), "StatefulSet")
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    assert {"state", "cache"} == claims
    assert "state" not in {v["name"] for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    with pytest.raises(helm.HelmError, match=r"storage\.state\.type: pvc needs workload: StatefulSet"):
        render(helm, {"storage": {"state": {"type": "pvc"}}})


def test_a_config_change_rolls_the_pods(helm: Any) -> None:
    def checksum(values: dict[str, Any]) -> str:
        return pod_of(render(helm, values))["metadata"]["annotations"]["checksum/config"]

    before = checksum({})
    assert checksum({}) == before
    assert checksum({"tunerd": {"tuning": {"mode": "dry-run"}}}) != before
    assert checksum({"rules": "# none\n"}) != before
    assert checksum({"image": {"tag": "other"}}) == before  # only the config's own checksum


def test_the_memory_credentials_come_from_a_secret_never_the_configmap(helm: Any) -> None:
    objects = render(helm, EVERYTHING)
    tunerd = container(objects)
    env = {e["name"]: e.get("value") for e in tunerd["env"]}
    assert env["CREDENTIALS_DIRECTORY"] == "/run/credentials/tunerd"
    mounts = {m["name"]: m for m in tunerd["volumeMounts"]}
    assert mounts["credentials"] == {
        "name": "credentials",
        "mountPath": "/run/credentials/tunerd",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in pod_of(objects)["spec"]["volumes"]}
    assert volumes["credentials"]["secret"]["secretName"] == "tunerd-memory"
    assert "tunerd-memory" not in json.dumps(one(objects, "ConfigMap", "tunerd"))
    assert not [o for o in objects if o["kind"] == "Secret"]  # the chart makes none: the operator's own
    assert "CREDENTIALS_DIRECTORY" not in {e["name"] for e in container(render(helm))["env"]}


def test_the_box_is_named_in_the_fleet_by_its_node_not_its_pod(helm: Any) -> None:
    env = {e["name"]: e for e in container(render(helm))["env"]}
    assert env["TUNERD_FLEET_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


# -- the operators' artifacts, from etc/ ---------------------------------------------------------------


def test_the_prometheus_rule_is_etc_prometheus_tunerd_alerts_yml(helm: Any) -> None:
    rule = one(render(helm), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    # Templates never touched: the alerts' own {{ $labels.instance }} reach Prometheus as written.
    assert "{{ $labels.instance }}" in json.dumps(rule)
    assert (CHART / "files" / "tunerd-alerts.yml").resolve() == ALERTS.resolve()


def test_the_dashboard_is_etc_grafana_tunerd_json_for_the_grafana_sidecar(helm: Any) -> None:
    dashboard = one(render(helm), "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["tunerd.json"]) == json.loads(DASHBOARD.read_text())
    assert (CHART / "files" / "tunerd.json").resolve() == DASHBOARD.resolve()


def test_the_monitoring_objects_can_be_left_out(helm: Any) -> None:
    off = {
        "monitoring": {"podMonitor": {"enabled": False}, "prometheusRule": {"enabled": False}},
        "grafana": {"dashboard": {"enabled": False}},
    }
    kinds = sorted(o["kind"] for o in render(helm, off))
    assert kinds == ["ConfigMap", "DaemonSet", "Service"]


def test_the_packaged_chart_carries_the_linked_files(helm: Any, tmp_path: Path) -> None:
    """`helm package` puts the content of files/'s symlinks into the archive: a chart pulled from a
    registry has the alert rules and the dashboard without the repository beside it."""
    archive = helm.package(str(CHART), destination=str(tmp_path))
    rendered = helm.Chart.load(archive).render(None, name="tunerd", namespace="inference", is_install=True)
    objects = [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]
    assert one(objects, "PrometheusRule")["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    dashboard = one(objects, "ConfigMap", "-dashboard")["data"]["tunerd.json"]
    assert json.loads(dashboard) == json.loads(DASHBOARD.read_text())
