"""Autoscaling on load: deploy/overlays/cpu-keda (a KEDA ScaledObject on queue depth from
Prometheus, instead of the CPU HPA) and deploy/overlays/cpu-queue-hpa (the HPA on the Pods metric
vbs_queue_depth through prometheus-adapter) render; every Kubernetes object validates against
the Kubernetes schemas; the ScaledObject has only the fields KEDA defines (its CRD's schema is
not available offline) and the ones it requires; every query names a series the service
exports; the recipe for a GPU pool (deploy/README.md) targets that pool's Deployment."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import (DEPLOY, exported_metric_names, promql_metrics,
                                  render_kustomization)

K8S_VERSIONS = ("1.29.0", "latest")
# KEDA v2's ScaledObject (keda.sh/v1alpha1), field by field
SCALED_OBJECT_SPEC = {"scaleTargetRef", "pollingInterval", "cooldownPeriod",
                      "initialCooldownPeriod", "idleReplicaCount", "minReplicaCount",
                      "maxReplicaCount", "fallback", "advanced", "triggers"}
SCALE_TARGET = {"apiVersion", "kind", "name", "envSourceContainerName"}
ADVANCED = {"restoreToOriginalReplicaCount", "horizontalPodAutoscalerConfig", "scalingModifiers"}
TRIGGER = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
PROMETHEUS = {"serverAddress", "query", "threshold", "activationThreshold", "namespace",
              "customHeaders", "ignoreNullValues", "unsafeSsl", "queryParameters"}
# the README's recipe for a GPU pool: the component, and the ScaledObject aimed at the pool
GPU_POOL_PATCH = """  - target:
      kind: ScaledObject
      name: vbs-worker
    patch: |-
      - op: replace
        path: /spec/scaleTargetRef/name
        value: vbs-worker-h100
      - op: replace
        path: /spec/triggers/0/metadata/query
        value: sum(vbs_queue_depth{namespace="vbs-serve", pod=~"vbs-worker-h100-[a-z0-9]+-[a-z0-9]+"})
"""

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def keda() -> list[Obj]:
    return render_kustomization(DEPLOY / "overlays" / "cpu-keda")


@pytest.fixture(scope="module")
def queue_hpa() -> list[Obj]:
    return render_kustomization(DEPLOY / "overlays" / "cpu-queue-hpa")


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def worker(objects: list[Obj]) -> Obj:
    [deployment] = [d for d in of_kind(objects, "Deployment")
                    if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    return deployment


def validate(obj: Obj) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
    for version in K8S_VERSIONS:
        kv.validate(obj, kv.latest_version() if version == "latest" else version, strict=True)


def subset(found: Any, allowed: set[str], where: str) -> None:
    assert isinstance(found, dict), f"{where} must be a mapping"
    unknown = sorted(set(found) - allowed)
    assert not unknown, f"{where}: {unknown} are not fields KEDA defines ({sorted(allowed)})"


def check_scaled_object(so: Obj, deployment: Obj) -> None:
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    subset(spec, SCALED_OBJECT_SPEC, "spec")
    target = spec["scaleTargetRef"]
    subset(target, SCALE_TARGET, "spec.scaleTargetRef")
    assert (target.get("kind", "Deployment"), target["name"]) == ("Deployment",
                                                                  deployment["metadata"]["name"])
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    subset(spec.get("advanced", {}), ADVANCED, "spec.advanced")
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    validate({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
              "metadata": {"name": "x"},
              "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": 2,
                       "behavior": behavior}})
    assert spec["triggers"], "a ScaledObject needs a trigger"
    for i, trigger in enumerate(spec["triggers"]):
        subset(trigger, TRIGGER, f"spec.triggers[{i}]")
        assert trigger["type"] == "prometheus"
        assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")
        meta = trigger["metadata"]
        subset(meta, PROMETHEUS, f"spec.triggers[{i}].metadata")
        assert {"serverAddress", "query", "threshold"} <= set(meta), "prometheus needs these"
        assert all(isinstance(v, str) for v in meta.values()), "KEDA's metadata are strings"
        assert float(meta["threshold"]) > 0 and meta["serverAddress"].startswith("http")
        assert promql_metrics(meta["query"]) == {"vbs_queue_depth"}
        assert promql_metrics(meta["query"]) <= exported_metric_names()


def test_keda_scales_the_workers_on_queue_depth_instead_of_cpu(keda: list[Obj]) -> None:
    assert not of_kind(keda, "HorizontalPodAutoscaler"), \
        "KEDA owns the HPA it makes; a second HPA on the Deployment would fight it"
    [so] = of_kind(keda, "ScaledObject")
    deployment = worker(keda)
    check_scaled_object(so, deployment)
    assert "replicas" not in deployment["spec"]
    query = so["spec"]["triggers"][0]["metadata"]["query"]
    assert 'namespace="vbs-serve"' in query and "vbs-worker-[a-z0-9]+-[a-z0-9]+" in query


def test_the_keda_overlay_is_otherwise_valid_kubernetes(keda: list[Obj]) -> None:
    for obj in keda:
        if obj["kind"] != "ScaledObject":
            validate(obj)


def test_the_hpa_scales_on_queue_depth_through_prometheus_adapter(queue_hpa: list[Obj]) -> None:
    [hpa] = of_kind(queue_hpa, "HorizontalPodAutoscaler")
    validate(hpa)
    assert hpa["spec"]["scaleTargetRef"]["name"] == worker(queue_hpa)["metadata"]["name"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    # prometheus-adapter serves it from the rule shipped beside the component
    values = yaml.safe_load((DEPLOY / "components" / "queue-hpa" /
                             "prometheus-adapter-values.yaml").read_text())
    [rule] = values["rules"]["custom"]
    assert rule["name"]["as"] == name
    assert promql_metrics(rule["seriesQuery"]) == {name} <= exported_metric_names()
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    for obj in queue_hpa:
        validate(obj)


def test_a_gpu_pool_scales_with_keda_by_the_readme_recipe(tmp_path: Path) -> None:
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    pool = copy / "overlays" / "gpu" / "h100" / "kustomization.yaml"
    text = pool.read_text()
    assert "  - ../../../components/gpu\n" in text and "\npatches:\n" in text
    text = text.replace("  - ../../../components/gpu\n",
                        "  - ../../../components/gpu\n  - ../../../components/keda\n")
    pool.write_text(text.replace("\npatches:\n", "\npatches:\n" + GPU_POOL_PATCH))
    objects = render_kustomization(copy / "overlays" / "gpu")
    assert not of_kind(objects, "HorizontalPodAutoscaler")
    [so] = of_kind(objects, "ScaledObject")
    check_scaled_object(so, worker(objects))
    assert so["metadata"]["name"] == "vbs-worker-h100"
    assert "vbs-worker-h100-[a-z0-9]+" in so["spec"]["triggers"][0]["metadata"]["query"]
