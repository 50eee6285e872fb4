"""deploy/: both overlays render, every object is valid Kubernetes, and the things that must be
there are there (probes, hardening, limits, GPU placement, network policy, autoscaling)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.support import DEPLOY, OVERLAYS, render_kustomization

NAMESPACE = "vbs-serve"
# The oldest Kubernetes minor these manifests are meant for, and the newest schemas shipped.
K8S_VERSIONS = ("1.29.0", "latest")
POD_KINDS = {"Deployment", "StatefulSet", "Job"}
GPU = "nvidia.com/gpu"
GPU_PRODUCT = "nvidia.com/gpu.product"

Render = Callable[[str], list[dict[str, Any]]]
Obj = dict[str, Any]


# ------------------------------------------------------------------------------------- helpers
def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def by_component(objects: list[Obj], kind: str, component: str) -> list[Obj]:
    return [o for o in of_kind(objects, kind)
            if o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
            == component]


def one(items: list[Obj], what: str) -> Obj:
    assert len(items) == 1, f"expected exactly one {what}, found {len(items)}"
    return items[0]


def pod_templates(objects: list[Obj]) -> Iterator[tuple[str, Obj]]:
    for o in objects:
        if o["kind"] in POD_KINDS:
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]


def containers(template: Obj) -> list[Obj]:
    spec = template["spec"]
    return list(spec["containers"]) + list(spec.get("initContainers", []))


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def selector_matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels + matchExpressions) against a label set."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def worker_of(objects: list[Obj]) -> tuple[Obj, Obj]:
    deployment = one(by_component(objects, "Deployment", "worker"), "worker Deployment")
    container = one([c for c in deployment["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "worker"], "worker container")
    return deployment, container


def planner_of(objects: list[Obj]) -> tuple[Obj, Obj]:
    job = one(by_component(objects, "Job", "planner"), "planner Job")
    container = one([c for c in job["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "planner"], "planner container")
    return job, container


def config_map(objects: list[Obj]) -> dict[str, str]:
    cm = one([o for o in of_kind(objects, "ConfigMap")
              if o["metadata"]["name"].startswith("vbs-config")], "vbs-config ConfigMap")
    return cm["data"]


# ------------------------------------------------------------------------ render and validate
@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


def test_overlay_renders_into_its_namespace(render: Render, overlay: str) -> None:
    objects = render(overlay)
    assert objects, f"deploy/overlays/{overlay} rendered nothing"
    one([o for o in of_kind(objects, "Namespace") if o["metadata"]["name"] == NAMESPACE],
        f"Namespace {NAMESPACE}")
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, \
                f"{o['kind']}/{o['metadata']['name']} is not in namespace {NAMESPACE}"
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(
        render: Render, overlay: str, k8s_version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate is not installed: pip install -e '.[test]'")
    version = kv.latest_version() if k8s_version == "latest" else k8s_version
    errors = []
    for o in render(overlay):
        where = f"{o['kind']}/{o['metadata']['name']}"
        try:
            kv.validate(o, version, strict=True)  # strict: unknown fields (typos) are errors
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{where}: {path}: {exc.message}")
        except kv.utils.SchemaNotFoundError as exc:
            errors.append(f"{where}: {exc.message}")
    assert not errors, f"overlay {overlay} against Kubernetes {version}:\n" + "\n".join(errors)


def test_the_validator_rejects_what_it_must() -> None:
    """Guards the check above from passing vacuously: a typo and a wrong type both fail."""
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate is not installed: pip install -e '.[test]'")
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}},
                                 "spec": {"containers": [{"name": "c", "image": "i",
                                                          "readinessProbe": {"periodSecond": 5}}]}}}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[0], strict=True)
    bad["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[0], strict=True)


def test_the_expected_objects_are_there(render: Render, overlay: str) -> None:
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    for kind in ("Namespace", "ConfigMap", "Secret", "Service", "StatefulSet", "Deployment", "Job",
                 "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"):
        assert kind in kinds, f"overlay {overlay} has no {kind}"
    one(by_component(objects, "StatefulSet", "redis"), "redis StatefulSet")
    worker_of(objects)
    planner_of(objects)


def test_references_resolve_to_objects_in_the_render(render: Render, overlay: str) -> None:
    """Every ConfigMap/Secret a pod reads exists (or is optional), every Service selects pods and
    targets a named port that exists, every selector matches its own pod template."""
    objects = render(overlay)
    present = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for where, template in pod_templates(objects):
        for c in containers(template):
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    assert ("ConfigMap", source["configMapRef"]["name"]) in present, where
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ("Secret", ref["name"]) in present, f"{where}: Secret {ref['name']}"
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            assert selector_matches(o["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"])
    for svc in of_kind(objects, "Service"):
        selected = [t for _, t in pod_templates(objects)
                    if selector_matches({"matchLabels": svc["spec"]["selector"]},
                                        t["metadata"]["labels"])]
        assert selected, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            for t in selected:
                names = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in names, \
                    f"Service {svc['metadata']['name']}: no container port named {port['targetPort']}"


# ------------------------------------------------------------------------------- the worker
def test_worker_probes_hit_the_health_endpoints(render: Render, overlay: str) -> None:
    _, worker = worker_of(render(overlay))
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports.get("http") == 8000
    assert ports.get("grpc") == 8001 == int(config_map(render(overlay))["VBS_GRPC_PORT"])
    expected = {"startupProbe": "/v2/health/live", "livenessProbe": "/v2/health/live",
                "readinessProbe": "/v2/health/ready"}
    for probe, path in expected.items():
        assert probe in worker, f"worker has no {probe}"
        get = worker[probe]["httpGet"]
        assert get["path"] == path, f"{probe} hits {get['path']}, not {path}"
        assert ports.get(get["port"], get["port"]) == 8000


def test_pods_are_hardened(render: Render, overlay: str) -> None:
    """Non-root, read-only root filesystem, no privilege escalation, no capabilities, the
    runtime's seccomp profile, no service-account token, no service links (they would inject
    VBS_REDIS_PORT=tcp://... style variables under the settings prefix)."""
    for where, template in pod_templates(render(overlay)):
        spec = template["spec"]
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert spec.get("automountServiceAccountToken") is False, where
        assert spec.get("enableServiceLinks") is False, where
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), f"{where}: {key}"
        assert not any("hostPath" in v for v in spec.get("volumes", [])), where
        for c in containers(template):
            sc = c.get("securityContext", {})
            at = f"{where} container {c['name']}"
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, at
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, at
            assert sc.get("readOnlyRootFilesystem") is True, at
            assert sc.get("allowPrivilegeEscalation") is False, at
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], at
            assert not sc.get("capabilities", {}).get("add"), at
            assert not sc.get("privileged"), at


def test_vbs_pods_run_as_the_image_user_with_writable_cache_and_tmp(render: Render,
                                                                     overlay: str) -> None:
    objects = render(overlay)
    cache_dir = config_map(objects)["VBS_CACHE_DIR"]
    for obj, c in (worker_of(objects), planner_of(objects)):
        spec = obj["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == 10001
        empty_dirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for path in (cache_dir, "/tmp"):
            assert mounts.get(path) in empty_dirs, f"{c['name']}: no emptyDir at {path}"


def test_every_container_has_requests_and_limits(render: Render, overlay: str) -> None:
    for where, template in pod_templates(render(overlay)):
        for c in containers(template):
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    assert resource in res.get(part, {}), \
                        f"{where} container {c['name']}: no {part}.{resource}"


def test_worker_memory_limit_comes_from_its_container_limit(render: Render, overlay: str) -> None:
    _, worker = worker_of(render(overlay))
    env = env_of(worker)
    if overlay == "gpu":
        # GPU memory is not the container's RAM: a GPU worker plans for what CUDA has free.
        assert "VBS_MEMORY_LIMIT_BYTES" not in env
        return
    assert "VBS_MEMORY_LIMIT_BYTES" in env, "worker has no VBS_MEMORY_LIMIT_BYTES"
    ref = env["VBS_MEMORY_LIMIT_BYTES"]["valueFrom"]["resourceFieldRef"]
    assert ref["resource"] == "limits.memory"
    assert ref.get("containerName", worker["name"]) == worker["name"]
    assert str(ref.get("divisor", "1")) == "1", "the value must be in bytes"


def test_store_url_carries_the_redis_password_from_the_secret(render: Render, overlay: str) -> None:
    objects = render(overlay)
    redis_service = one([s for s in of_kind(objects, "Service")
                         if s["spec"]["selector"].get("app.kubernetes.io/component") == "redis"],
                        "redis Service")
    for _, c in (worker_of(objects), planner_of(objects)):
        names = [e["name"] for e in c["env"]]
        env = env_of(c)
        store = env["VBS_STORE"]["value"]
        assert re.fullmatch(rf"redis://:\$\(REDIS_PASSWORD\)@{redis_service['metadata']['name']}"
                            r":6379/\d+", store), store
        # $(VAR) expands only from variables defined earlier in the list.
        assert names.index("REDIS_PASSWORD") < names.index("VBS_STORE")
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "vbs-redis-auth"


def test_prometheus_scrapes_the_workers(render: Render, overlay: str) -> None:
    deployment, worker = worker_of(render(overlay))
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/path") == "/metrics"
    assert int(annotations.get("prometheus.io/port", 0)) in {p["containerPort"] for p in worker["ports"]}


def test_hpa_scales_the_worker_on_cpu_and_pdb_covers_it(render: Render, overlay: str) -> None:
    objects = render(overlay)
    deployment, _ = worker_of(objects)
    hpa = one(of_kind(objects, "HorizontalPodAutoscaler"), "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    metrics = [m for m in hpa["spec"]["metrics"]
               if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
    assert metrics and metrics[0]["resource"]["target"]["type"] == "Utilization"
    assert "replicas" not in deployment["spec"], "the HPA owns replicas; kubectl apply would fight it"

    pdb = one(of_kind(objects, "PodDisruptionBudget"), "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert selector_matches(pdb["spec"]["selector"],
                            deployment["spec"]["template"]["metadata"]["labels"])
    assert "maxUnavailable" in pdb["spec"] or "minAvailable" in pdb["spec"]


# ------------------------------------------------------------------------------- network
def test_only_workers_and_planners_reach_redis(render: Render, overlay: str) -> None:
    objects = render(overlay)
    redis_labels = one(by_component(objects, "StatefulSet", "redis"),
                       "redis")["spec"]["template"]["metadata"]["labels"]
    policies = of_kind(objects, "NetworkPolicy")
    on_redis = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and selector_matches(p["spec"]["podSelector"], redis_labels)]
    assert on_redis, "no NetworkPolicy selects the redis pods"

    def admitted(pod_labels: dict[str, str], port: int) -> bool:
        for p in on_redis:
            for rule in p["spec"].get("ingress", []):
                ports = {x.get("port") for x in rule.get("ports", [])} or {port}
                peers = rule.get("from")
                if port in ports and (peers is None or any(
                        "podSelector" in peer and "namespaceSelector" not in peer
                        and selector_matches(peer["podSelector"], pod_labels) for peer in peers)):
                    return True
        return False

    for obj, _ in (worker_of(objects), planner_of(objects)):
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert admitted(labels, 6379), f"{obj['metadata']['name']} cannot reach redis on 6379"
        assert not admitted(labels, 6380)
    assert not admitted({"app.kubernetes.io/name": "something-else"}, 6379), \
        "redis takes connections from pods that are neither worker nor planner"
    # Nothing else in the namespace is let in by default.
    assert any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
               and "Ingress" in p["spec"]["policyTypes"] for p in policies), "no default deny"


def test_workers_take_ingress_on_8000_and_8001(render: Render, overlay: str) -> None:
    objects = render(overlay)
    deployment, _ = worker_of(objects)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    ports = {x.get("port") for p in of_kind(objects, "NetworkPolicy")
             if selector_matches(p["spec"]["podSelector"], labels) and p["spec"]["podSelector"]
             for rule in p["spec"].get("ingress", []) for x in rule.get("ports", [])}
    assert {8000, 8001} <= ports


def test_the_worker_service_carries_http_and_grpc(render: Render, overlay: str) -> None:
    service = one([s for s in of_kind(render(overlay), "Service")
                   if s["metadata"]["name"] == "vbs-worker"], "vbs-worker Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert (ports["http"]["port"], ports["grpc"]["port"]) == (8000, 8001)
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c", "gRPC is cleartext HTTP/2"


# ------------------------------------------------------------------------------- redis
def test_redis_requires_the_password_from_the_secret(render: Render, overlay: str) -> None:
    objects = render(overlay)
    redis = one(by_component(objects, "StatefulSet", "redis"), "redis StatefulSet")
    c = one(redis["spec"]["template"]["spec"]["containers"], "redis container")
    assert re.search(r":\d", c["image"].split("/")[-1]) and not c["image"].endswith(":latest")
    assert "requirepass" in " ".join(c.get("command", []) + c.get("args", []))
    ref = env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    secret = one([s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == ref["name"]],
                 "redis Secret")
    assert ref["key"] in secret.get("data", {}) or ref["key"] in secret.get("stringData", {})
    assert "readinessProbe" in c and "livenessProbe" in c
    assert redis["spec"].get("volumeClaimTemplates"), "redis keeps its data on a volume"


# ------------------------------------------------------------------------------- CPU vs GPU
def test_gpus_are_requested_only_in_the_gpu_overlay(render: Render) -> None:
    cpu, gpu = render("cpu"), render("gpu")
    for where, template in pod_templates(cpu):
        for c in containers(template):
            assert GPU not in repr(c.get("resources", {})), f"cpu overlay {where} asks for a GPU"
        assert GPU_PRODUCT not in repr(template["spec"].get("nodeSelector", {})), where
    assert config_map(cpu)["VBS_DEVICE"] == "cpu"
    assert config_map(gpu)["VBS_DEVICE"] == "cuda"
    for obj, c in (worker_of(gpu), planner_of(gpu)):
        assert int(c["resources"]["limits"][GPU]) == 1, f"{obj['metadata']['name']}: no GPU limit"


def test_gpu_planner_and_workers_sit_on_one_gpu_product(render: Render) -> None:
    """Plan tables are keyed by a fingerprint that includes the device name: the planner must
    profile on the product the workers serve on, so both select the same product label."""
    gpu = render("gpu")
    job, _ = planner_of(gpu)
    deployment, _ = worker_of(gpu)
    planner_product = job["spec"]["template"]["spec"].get("nodeSelector", {}).get(GPU_PRODUCT)
    worker_product = deployment["spec"]["template"]["spec"].get("nodeSelector", {}).get(GPU_PRODUCT)
    assert planner_product, "the gpu planner Job has no nvidia.com/gpu.product node selector"
    assert worker_product == planner_product


def test_images_differ_per_overlay(render: Render) -> None:
    def images(objects: list[Obj]) -> set[str]:
        return {c["image"] for obj in (worker_of(objects), planner_of(objects)) for c in [obj[1]]}
    cpu, gpu = images(render("cpu")), images(render("gpu"))
    assert len(cpu) == 1 and len(gpu) == 1 and cpu != gpu
    assert all(not i.endswith(":latest") and ":" in i for i in cpu | gpu)


def test_a_second_gpu_product_is_a_copied_pool(tmp_path: Path) -> None:
    """The recipe in deploy/README.md: copy the h100 pool, change suffix, label and product, list
    it in the gpu overlay. The two pools must not select each other's pods, and share one Redis."""
    if shutil.which("kubectl") is None and shutil.which("kustomize") is None:
        pytest.skip("neither kubectl nor kustomize is on PATH: install kubectl to render deploy/")
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    gpu = copy / "overlays" / "gpu"
    pool = (gpu / "h100" / "kustomization.yaml").read_text()
    (gpu / "a100").mkdir()
    (gpu / "a100" / "kustomization.yaml").write_text(
        pool.replace("-h100", "-a100").replace("pool: h100", "pool: a100")
            .replace("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB"))
    top = (gpu / "kustomization.yaml").read_text()
    assert "  - h100\n" in top
    (gpu / "kustomization.yaml").write_text(top.replace("  - h100\n", "  - h100\n  - a100\n"))

    objects = render_kustomization(gpu)
    deployments = by_component(objects, "Deployment", "worker")
    jobs = by_component(objects, "Job", "planner")
    assert len(deployments) == 2 and len(jobs) == 2
    assert len(by_component(objects, "StatefulSet", "redis")) == 1
    products = {j["spec"]["template"]["spec"]["nodeSelector"][GPU_PRODUCT] for j in jobs}
    assert products == {"NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB"}
    for d in deployments:
        others = [o for o in deployments if o is not d]
        for o in others:
            assert not selector_matches(d["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"])
        for pdb in of_kind(objects, "PodDisruptionBudget"):
            if pdb["metadata"]["name"] == d["metadata"]["name"]:
                assert not selector_matches(pdb["spec"]["selector"],
                                            others[0]["spec"]["template"]["metadata"]["labels"])
    hpa_targets = {h["spec"]["scaleTargetRef"]["name"] for h in of_kind(objects, "HorizontalPodAutoscaler")}
    assert hpa_targets == {d["metadata"]["name"] for d in deployments}
