"""deploy/kserve: vbs-serve as a KServe ServingRuntime and an InferenceService that uses it.

The render is checked offline: the Kubernetes objects against the Kubernetes schemas, and the
two KServe objects field by field against what KServe defines and requires (their CRDs'
schemas cannot be fetched here; the fields are those of KServe's ServingRuntimeSpec,
PredictorSpec and ModelSpec, and what is a Container or a PodSpec in them is validated as one).
Then what makes it work: both protocols on named ports (HTTP first, KServe's Service sends port
80 there; gRPC as h2c), probes on the OIP health endpoints, the plan store's URL with the Redis
password, the model served under the InferenceService's name, the network policies letting the
predictor pods reach Redis and take traffic.
"""

from __future__ import annotations

from typing import Any

import pytest

from planner.settings import split_model_entry
from tests.deploy.support import DEPLOY, render_kustomization
from tests.deploy.test_kubernetes import selector_matches

K8S_VERSIONS = ("1.29.0", "latest")
# serving.kserve.io/v1alpha1 ServingRuntimeSpec (with its inline ServingRuntimePodSpec)
RUNTIME_SPEC = {"supportedModelFormats", "multiModel", "disabled", "protocolVersions",
                "workerSpec", "containers", "volumes", "nodeSelector", "affinity", "tolerations",
                "labels", "annotations", "imagePullSecrets", "hostIPC", "grpcEndpoint",
                "grpcDataEndpoint", "httpDataEndpoint", "replicas", "storageHelper",
                "builtInAdapter"}
RUNTIME_POD_SPEC = {"containers", "volumes", "nodeSelector", "affinity", "tolerations",
                    "imagePullSecrets", "hostIPC"}
MODEL_FORMAT = {"name", "version", "autoSelect", "priority"}
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}
# serving.kserve.io/v1beta1 InferenceService: its spec, the PredictorSpec (implementations and
# ComponentExtensionSpec; the rest is an inline PodSpec), and ModelSpec (the rest: a Container)
ISVC_SPEC = {"predictor", "transformer", "explainer"}
PREDICTOR = {"sklearn", "xgboost", "tensorflow", "pytorch", "triton", "onnx", "huggingface",
             "pmml", "lightgbm", "paddle", "model", "workerSpec", "minReplicas", "maxReplicas",
             "scaleTarget", "scaleMetric", "containerConcurrency", "timeout",
             "canaryTrafficPercent", "logger", "batcher", "labels", "annotations",
             "deploymentStrategy"}
MODEL = {"modelFormat", "runtime", "storageUri", "runtimeVersion", "protocolVersion", "storage"}
SCALE_METRICS = {"cpu", "memory", "concurrency", "rps"}

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def objects() -> list[Obj]:
    return render_kustomization(DEPLOY / "kserve")


def one(objects: list[Obj], kind: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def validate(obj: Obj) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
    for version in K8S_VERSIONS:
        kv.validate(obj, kv.latest_version() if version == "latest" else version, strict=True)


def validate_pod_spec(spec: Obj) -> None:
    """``spec`` as a Pod's (strict: a field a PodSpec lacks fails)."""
    validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec})


def known(found: Obj, allowed: set[str], where: str) -> None:
    unknown = sorted(set(found) - allowed)
    assert not unknown, f"{where}: {unknown} are not fields KServe defines"


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def test_the_kubernetes_objects_validate_and_the_pool_workers_are_left_out(
        objects: list[Obj]) -> None:
    kinds = [o["kind"] for o in objects]
    for kind in ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
        assert kind not in kinds, f"KServe makes the predictor's {kind}"
    assert "Job" in kinds and "StatefulSet" in kinds, "the planner Job and Redis stay"
    for obj in objects:
        if not obj["apiVersion"].startswith("serving.kserve.io/"):
            validate(obj)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "vbs-serve"


def test_the_serving_runtime_has_kserve_fields_and_both_protocols(objects: list[Obj]) -> None:
    runtime = one(objects, "ServingRuntime")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    spec = runtime["spec"]
    known(spec, RUNTIME_SPEC, "ServingRuntime spec")
    assert spec["containers"], "KServe requires containers"
    validate_pod_spec({k: v for k, v in spec.items() if k in RUNTIME_POD_SPEC})
    for fmt in spec["supportedModelFormats"]:
        known(fmt, MODEL_FORMAT, "supportedModelFormats[]")
        assert fmt["name"] and fmt.get("priority", 1) >= 1
    assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"]) <= PROTOCOLS
    [container] = spec["containers"]
    assert container["name"] == "kserve-container", "KServe merges the model into this name"
    ports = [(p["name"], p["containerPort"]) for p in container["ports"]]
    assert ports == [("http1", 8000), ("h2c", 8001)], "HTTP first (KServe's port 80), gRPC h2c"
    env = env_of(container)
    assert (env["VBS_PORT"]["value"], env["VBS_GRPC_PORT"]["value"]) == ("8000", "8001")
    for probe, path in (("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live"),
                        ("startupProbe", "/v2/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": 8000}, probe
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and security["runAsNonRoot"]
    assert security["capabilities"]["drop"] == ["ALL"] and not security["allowPrivilegeEscalation"]


def test_the_runtime_reads_the_plan_store_and_settings_that_exist(objects: list[Obj]) -> None:
    container = one(objects, "ServingRuntime")["spec"]["containers"][0]
    env = env_of(container)
    names = [e["name"] for e in container["env"]]
    assert env["VBS_STORE"]["value"] == "redis://:$(REDIS_PASSWORD)@vbs-redis:6379/0"
    assert names.index("REDIS_PASSWORD") < names.index("VBS_STORE")
    present = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("Secret", env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"]) in present
    assert ("Service", "vbs-redis") in present
    [source] = container["envFrom"]
    assert ("ConfigMap", source["configMapRef"]["name"]) in present, "the hashed vbs-config"
    limit = env["VBS_MEMORY_LIMIT_BYTES"]["valueFrom"]["resourceFieldRef"]
    assert (limit["containerName"], limit["resource"]) == ("kserve-container", "limits.memory")


def test_the_inference_service_uses_the_runtime(objects: list[Obj]) -> None:
    runtime = one(objects, "ServingRuntime")
    isvc = one(objects, "InferenceService")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    known(isvc["spec"], ISVC_SPEC, "InferenceService spec")
    predictor = isvc["spec"]["predictor"]
    pod = {k: v for k, v in predictor.items() if k not in PREDICTOR}
    validate_pod_spec({**pod, "containers": [{"name": "kserve-container", "image": "x"}]})
    assert predictor["scaleMetric"] in SCALE_METRICS
    assert 1 <= predictor["minReplicas"] <= predictor["maxReplicas"]
    model = predictor["model"]
    container = {k: v for k, v in model.items() if k not in MODEL}
    validate_pod_spec({"containers": [{"name": "kserve-container", **container}]})
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    # both ports need the raw mode: Knative (serverless mode) exposes one port per container
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    served, name, _ = split_model_entry(env_of(model)["VBS_MODELS"]["value"])
    assert served == isvc["metadata"]["name"] and name


def test_the_predictor_pods_are_let_in_and_reach_redis(objects: list[Obj]) -> None:
    predictor = one(objects, "InferenceService")["spec"]["predictor"]
    labels = predictor["labels"]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    ingress = {x["port"] for p in policies
               if p["spec"]["podSelector"] and selector_matches(p["spec"]["podSelector"], labels)
               for rule in p["spec"].get("ingress", []) for x in rule.get("ports", [])}
    assert {8000, 8001} <= ingress
    [redis] = [p for p in policies if p["metadata"]["name"] == "vbs-redis"]
    peers = [peer["podSelector"] for rule in redis["spec"]["ingress"] for peer in rule["from"]]
    assert any(selector_matches(peer, labels) for peer in peers)
    security = predictor["securityContext"]
    assert security["runAsNonRoot"] and security["seccompProfile"]["type"] == "RuntimeDefault"
    assert predictor["automountServiceAccountToken"] is False
    assert predictor["enableServiceLinks"] is False
