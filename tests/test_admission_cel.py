"""The admission policies' own CEL, evaluated: what the API server would admit and refuse, and why.

    python -m pytest -q tests/test_admission_cel.py

deployments/flow-run-admission.yaml and deployments/canary.yaml hold the flow-run Jobs and the image canary's
RayClusters with `failurePolicy: Fail`: a typo, or a rule reading a field the object never has, would refuse
every flow run or every canary (or admit what it should refuse), and no linter reads CEL. Here cel-python
(module celpy, pinned in the test extra) evaluates each ValidatingAdmissionPolicy as the API server does:
matchConstraints (operation, resource, namespace), then matchConditions (a false one: the policy does not
apply; an error: failurePolicy), then every validation, with `variables` evaluated lazily, once, in the
policy's order (a variable reads only those before it), and `object` / `oldObject` / `request` bound as for
the request (`object` null on DELETE, `oldObject` null on CREATE). A validation that is false refuses with
its message (or messageExpression); one that errors refuses too (failurePolicy Fail).

The objects are the API server's view, not the raw manifests:
- a RayCluster is a custom object: the API server prunes what the KubeRay CRD's schema does not declare and
  fills the schema's defaults before admission, so the rules see exactly the CRD's fields
  (/work/shared/kuberay/ray.io_rayclusters.yaml when present, else lint's copy of its v1 schema). A rule
  guarding a field the CRD lacks would see it pruned and never fire; every refusal below is such a field set
  by a would-be attacker, so such a rule fails its test here.
- a Job is a built-in type: the API server drops the PodSpec fields prefect-kubernetes adds and converts the
  typed object for CEL, where empty strings, lists and maps (omitempty) are absent: `has()` is false for them.

cel-python implements CEL's standard macros and functions (has, all, exists, map, size, startsWith,
matches, in, ternary, error-absorbing && and ||), which is all these policies use; it lacks Kubernetes'
extension libraries (lowerAscii, url, quantity, authorizer, ...): a policy that starts using one errors here,
and must gain its own evaluation before it can be tested.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes
from celpy.evaluation import CELEvalError

from tests.test_flow_run_job import CANARY_TEMPLATE, rendered_job
from tuneproof.app.lint.pools import without_prefect_pod_fields
from tuneproof.control.images import CANARY_CLUSTER_PREFIX
from tuneproof.control.kube_canary import canary_manifest, canary_name
from tuneproof.core.config import PROJECT_ROOT


@pytest.fixture(autouse=True, scope="module")
def _restore_recursion_limit():
    """celpy.Environment() sets the process's recursion limit to 2500; later tests must not inherit it."""
    import sys

    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)


DEPLOYMENTS = PROJECT_ROOT / "deployments"
SHARED_CRD = Path("/work/shared/kuberay/ray.io_rayclusters.yaml")
LINT_CRD = PROJECT_ROOT / "tuneproof" / "app" / "schemas" / "raycluster-v1.json"
PIPELINE_WORKER = "system:serviceaccount:tuneproof:prefect-worker"
CANARY_WORKER = "system:serviceaccount:tuneproof:prefect-worker-canary"
CANARY = "system:serviceaccount:tuneproof:tuneproof-canary"
KUBERAY = "system:serviceaccount:kuberay:kuberay-operator"
CANDIDATE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.2@sha256:" + "b" * 64

# --- the evaluator ---------------------------------------------------------------------------------------------

_ENV = celpy.Environment()


@cache
def _program(expression: str) -> Any:
    return _ENV.program(_ENV.compile(expression))


def _cel(value: Any) -> Any:
    return celpy.json_to_cel(value) if value is not None else None


class _Variables(celtypes.MapType):
    """`variables` as the API server binds it: each evaluated on first read, at most once, errors kept as values
    (`true || error` is true, as in the API server's CEL); a variable sees only those declared before it."""

    def __init__(self, declared: list[dict], activation: dict, values: dict[str, Any] | None = None):
        super().__init__({})
        self._declared = declared
        self._activation = activation
        self._values: dict[str, Any] = {} if values is None else values

    def __getitem__(self, key: Any) -> Any:
        names = [v["name"] for v in self._declared]
        if str(key) not in names:
            raise KeyError(key)
        i = names.index(str(key))
        if names[i] not in self._values:
            earlier = _Variables(self._declared[:i], self._activation, self._values)
            try:
                value = _program(self._declared[i]["expression"]).evaluate({**self._activation, "variables": earlier})
            except CELEvalError as e:
                value = e
            self._values[names[i]] = value
        return self._values[names[i]]

    def __contains__(self, key: object) -> bool:
        return any(v["name"] == str(key) for v in self._declared)


@dataclass(frozen=True)
class Decision:
    applies: bool  # matchConstraints and matchConditions held: the policy judged the request
    refusals: tuple[str, ...]  # each failed validation's message; errors as "error in <expression>: ..."

    @property
    def admitted(self) -> bool:
        return not self.refusals


def _matches(policy: dict, group_version: tuple[str, str], resource: str, operation: str, namespace: str) -> bool:
    """matchConstraints: the namespace (by its name label) and a resource rule for this request."""
    constraints = policy["spec"]["matchConstraints"]
    labels = (constraints.get("namespaceSelector") or {}).get("matchLabels") or {}
    if labels.get("kubernetes.io/metadata.name", namespace) != namespace:
        return False
    group, version = group_version
    return any(
        group in rule["apiGroups"]
        and (version in rule["apiVersions"] or "*" in rule["apiVersions"])
        and resource in rule["resources"]
        and operation in rule["operations"]
        for rule in constraints["resourceRules"]
    )


def admission(
    policy: dict,
    *,
    operation: str,
    username: str,
    obj: dict | None,
    old: dict | None = None,
    group_version: tuple[str, str],
    resource: str,
) -> Decision:
    """The ValidatingAdmissionPolicy's verdict on one request (failurePolicy Fail: errors refuse)."""
    current = obj if obj is not None else old
    assert current is not None
    namespace, name = current["metadata"]["namespace"], current["metadata"].get("name", "")
    if not _matches(policy, group_version, resource, operation, namespace):
        return Decision(False, ())
    request = {
        "kind": {"group": group_version[0], "version": group_version[1], "kind": current["kind"]},
        "resource": {"group": group_version[0], "version": group_version[1], "resource": resource},
        "name": name,
        "namespace": namespace,
        "operation": operation,
        "userInfo": {"username": username, "groups": ["system:serviceaccounts", "system:authenticated"]},
        "dryRun": False,
    }
    activation: dict[str, Any] = {"object": _cel(obj), "oldObject": _cel(old), "request": _cel(request)}
    activation["variables"] = _Variables(policy["spec"].get("variables") or [], activation)
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"

    failed_conditions = []
    for condition in spec.get("matchConditions") or []:
        held = _holds(condition["expression"], activation)
        if isinstance(held, str):
            failed_conditions.append(f"error in matchCondition {condition['name']}: {held}")
        elif not held:
            return Decision(False, ())  # any false condition: the policy does not apply, errors or not
    if failed_conditions:
        return Decision(True, tuple(failed_conditions))

    refusals = []
    for validation in spec["validations"]:
        result = _holds(validation["expression"], activation)
        if isinstance(result, str):
            refusals.append(f"error in {validation['expression']!r}: {result}")
        elif not result:
            refusals.append(_message(validation, activation))
    return Decision(True, tuple(refusals))


def _holds(expression: str, activation: dict) -> bool | str:
    """The expression's value, or the error the API server reports when it raises or is not a bool."""
    try:
        value = _program(expression).evaluate(activation)
    except CELEvalError as e:
        return str(e.args[0])
    if not isinstance(value, celtypes.BoolType):
        return f"not a bool but {value!r}"
    return bool(value)


def _message(validation: dict, activation: dict) -> str:
    if "messageExpression" in validation:
        try:
            return str(_program(validation["messageExpression"]).evaluate(activation))
        except CELEvalError:
            pass  # the API server falls back to message, then to the expression itself
    return " ".join(str(validation.get("message") or f"failed expression: {validation['expression']}").split())


def policy_named(file: str, name: str) -> dict:
    docs = yaml.safe_load_all((DEPLOYMENTS / file).read_text())
    return next(d for d in docs if d and d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == name)


def messages(policy: dict) -> list[str | None]:
    """Each validation's static message, in order (messageExpression ones: None)."""
    return [" ".join(v["message"].split()) if "message" in v else None for v in policy["spec"]["validations"]]


# --- the objects as the API server holds them ------------------------------------------------------------------


@cache
def crd_schema(version: str) -> dict:
    if SHARED_CRD.exists():
        crd = yaml.load(SHARED_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
    if version != "v1":
        pytest.skip(f"lint's schema copy holds v1 only, not {version}: /work/shared/kuberay is absent")
    return json.loads(LINT_CRD.read_text())


def structural(value: Any, schema: dict) -> Any:
    """What the API server keeps of a custom object's field: undeclared fields pruned, declared defaults filled."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(value, dict | list):
        return value
    if isinstance(value, list):
        return [structural(item, schema.get("items") or {}) for item in value]
    properties = schema.get("properties")
    if properties is not None:
        kept = {k: structural(v, properties[k]) for k, v in value.items() if k in properties}
        defaults = {k: copy.deepcopy(p["default"]) for k, p in properties.items() if "default" in p and k not in kept}
        return {**kept, **defaults}
    if isinstance(schema.get("additionalProperties"), dict):
        return {k: structural(v, schema["additionalProperties"]) for k, v in value.items()}
    return value if schema.get("additionalProperties") is True else {}


def stored_raycluster(manifest: dict) -> dict:
    """A RayCluster as admission sees it, in its own apiVersion (the policy matches every version KubeRay serves)."""
    version = manifest["apiVersion"].split("/")[1]
    schema = crd_schema(version)
    spec = structural(manifest.get("spec") or {}, schema["properties"]["spec"])
    return {"apiVersion": manifest["apiVersion"], "kind": "RayCluster", "metadata": manifest["metadata"], "spec": spec}


def typed(value: Any) -> Any:
    """A built-in object as CEL sees it: converted from its Go type, so empty strings, lists and maps are absent."""
    if isinstance(value, dict):
        kept = {k: typed(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, "", [], {})}
    if isinstance(value, list):
        return [typed(item) for item in value]
    return value


# --- flow-run Jobs ---------------------------------------------------------------------------------------------

JOBS = policy_named("flow-run-admission.yaml", "tuneproof-flow-run-jobs")
ACCOUNT, IMAGE, VOLUMES, SECRETS = messages(JOBS)


def worker_job(pool: str) -> dict:
    """The Job the pool's worker creates (a fresh copy of the one rendering per pool)."""
    return copy.deepcopy(_worker_job(pool))


@cache
def _worker_job(pool: str) -> dict:
    """Rendered by prefect-kubernetes from the pool's template, then its auth string made a secretKeyRef by the
    worker's own method, as it does with PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_NAME/_KEY
    set (prefect-worker.yaml, canary.yaml)."""
    from prefect_kubernetes.worker import KubernetesWorker

    with pytest.MonkeyPatch.context() as monkeypatch:
        if pool == "pipeline":
            job = rendered_job(monkeypatch)
        else:
            job = rendered_job(monkeypatch, "image-canary", CANARY_TEMPLATE)
    job["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "PREFECT_API_AUTH_STRING", "value": "admin:s3cret"}
    )

    class Configuration:  # the one attribute the method reads and writes
        job_manifest = job

    replace = KubernetesWorker._replace_env_variable_with_secret
    asyncio.run(replace(None, "PREFECT_API_AUTH_STRING", Configuration, "prefect-api-auth", "auth-string"))
    by_secret = {"secretKeyRef": {"name": "prefect-api-auth", "key": "auth-string"}}
    assert {"name": "PREFECT_API_AUTH_STRING", "valueFrom": by_secret} in pod_of(job)["containers"][0]["env"]
    return job


def job_admission(job: dict, username: str) -> Decision:
    job = {**job, "metadata": {**job["metadata"], "name": job["metadata"].get("generateName", "") + "x7k2p"}}
    return admission(
        JOBS,
        operation="CREATE",
        username=username,
        obj=typed(without_prefect_pod_fields(job)),
        group_version=("batch", "v1"),
        resource="jobs",
    )


def pod_of(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


@pytest.mark.parametrize(("pool", "worker"), [("pipeline", PIPELINE_WORKER), ("canary", CANARY_WORKER)])
def test_each_workers_rendered_job_is_admitted_for_that_worker_only(pool, worker):
    job = worker_job(pool)
    mine = job_admission(job, worker)
    assert mine.applies and mine.refusals == ()

    other = CANARY_WORKER if worker == PIPELINE_WORKER else PIPELINE_WORKER
    theirs = job_admission(job, other)
    account = {PIPELINE_WORKER: "tuneproof-pipeline", CANARY_WORKER: "tuneproof-canary"}[other]
    token = {PIPELINE_WORKER: "tuneproof-ray-auth", CANARY_WORKER: "tuneproof-canary-ray-auth"}[other]
    # Neither the account nor the Ray token crosses pools: a canary run never holds the standing cluster's token.
    assert theirs.refusals == (
        f"a Job of this worker runs as {account}, never as another account of the namespace",
        f"the only volume of a flow-run Job of this worker is its Ray token Secret {token}",
    )
    assert ACCOUNT is None and VOLUMES is None  # the policy's messageExpressions, naming the worker's own


def _image(job: dict) -> None:
    pod_of(job)["containers"][0]["image"] = "123456789012.dkr.ecr.us-west-2.amazonaws.com/tuneproof-flow-run:evil"


def _secret_volume(job: dict) -> None:
    pod_of(job)["volumes"].append({"name": "prefect", "secret": {"secretName": "prefect-api-auth"}})


def _envfrom(job: dict) -> None:
    pod_of(job)["containers"][0]["envFrom"] = [{"secretRef": {"name": "tuneproof-job-env"}}]


def _secret_env(job: dict) -> None:
    pod_of(job)["containers"][0]["env"].append(
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "aws-admin", "key": "secret"}}}
    )


def _init_container(job: dict) -> None:
    pod_of(job)["initContainers"] = [{"name": "setup", "image": pod_of(job)["containers"][0]["image"]}]


def _sidecar(job: dict) -> None:
    pod_of(job)["containers"].append({"name": "sidecar", "image": "busybox:1.37"})


def _account(job: dict) -> None:
    pod_of(job)["serviceAccountName"] = "prefect-worker"


def _no_account(job: dict) -> None:
    del pod_of(job)["serviceAccountName"]  # the namespace's `default` account


@pytest.mark.parametrize("pool", ["pipeline", "canary"])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_image, IMAGE),
        (_init_container, IMAGE),
        (_sidecar, IMAGE),
        (_secret_volume, VOLUMES),
        (_envfrom, SECRETS),
        (_secret_env, SECRETS),
    ],
)
def test_a_changed_flow_run_job_is_refused_with_the_policys_message(pool, change, message):
    job = worker_job(pool)
    change(job)
    worker = PIPELINE_WORKER if pool == "pipeline" else CANARY_WORKER
    token = "tuneproof-ray-auth" if pool == "pipeline" else "tuneproof-canary-ray-auth"
    expected = message or f"the only volume of a flow-run Job of this worker is its Ray token Secret {token}"
    assert job_admission(job, worker).refusals == (expected,)


@pytest.mark.parametrize("change", [_account, _no_account])
def test_a_job_as_another_account_is_refused_even_by_its_own_worker(change):
    job = worker_job("pipeline")
    change(job)
    assert job_admission(job, PIPELINE_WORKER).refusals == (
        "a Job of this worker runs as tuneproof-pipeline, never as another account of the namespace",
    )


def test_jobs_of_anyone_but_the_workers_are_not_the_policys():
    job = worker_job("pipeline")
    _secret_volume(job)
    decision = job_admission(job, "kubernetes-admin")
    assert not decision.applies and decision.admitted


# --- the canary's RayClusters ----------------------------------------------------------------------------------

RAYCLUSTERS = policy_named("canary.yaml", "tuneproof-canary-rayclusters")
NAME, FIELDS, AUTH, HEAD_SERVICE, PODS, POD_VOLUMES, POD_SECRETS, POD_LABELS = messages(RAYCLUSTERS)


def candidate_cluster(short_id: str = "20261201-140000-abc123") -> dict:
    """The manifest tuneproof.control.kube_canary creates for a candidate image."""
    standing = yaml.safe_load((DEPLOYMENTS / "raycluster.yaml").read_text())
    return canary_manifest(standing, CANDIDATE, canary_name(short_id), "tuneproof")


def raycluster_admission(
    manifest: dict | None, username: str = CANARY, operation: str = "CREATE", old: dict | None = None
) -> Decision:
    obj = stored_raycluster(manifest) if manifest is not None else None
    stored = stored_raycluster(old) if old is not None else None
    version = (manifest or old or {})["apiVersion"].split("/")[1]
    return admission(
        RAYCLUSTERS,
        operation=operation,
        username=username,
        obj=obj,
        old=stored,
        group_version=("ray.io", version),
        resource="rayclusters",
    )


def test_the_canarys_own_raycluster_is_admitted():
    decision = raycluster_admission(candidate_cluster())
    assert decision.applies and decision.refusals == ()


def test_deleting_its_own_cluster_is_admitted_and_the_standing_one_refused():
    own = candidate_cluster("t1")
    assert raycluster_admission(None, operation="DELETE", old=own).refusals == ()
    standing = yaml.safe_load((DEPLOYMENTS / "raycluster.yaml").read_text())
    assert raycluster_admission(None, operation="DELETE", old=standing).refusals == (NAME,)
    # the operator (finalizers) and an admin are not held to the canary's shape
    assert not raycluster_admission(None, username=KUBERAY, operation="DELETE", old=standing).applies


def _spec(path: str, value: Any) -> Callable[[dict], None]:
    """Set spec.<path> (dotted) to value."""

    def change(body: dict) -> None:
        node = body["spec"]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    change.__name__ = f"spec.{path}={value!r}"
    return change


def _pods(body: dict) -> list[dict]:
    spec = body["spec"]
    return [spec["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in spec["workerGroupSpecs"])]


def _worker_pod(change: Callable[[dict], None]) -> Callable[[dict], None]:
    """The change on the last worker group's pod only: the policy must read every group, not the head alone."""
    return lambda body: change(_pods(body)[-1])


def _head_container(change: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda body: change(_pods(body)[0]["containers"][0])


def _rename(body: dict) -> None:
    body["metadata"]["name"] = "tuneproof-gpu"


def _standing_name(body: dict) -> None:
    body["metadata"]["name"] = "tuneproof"


REDIS = {"redisAddress": "redis.example:6379"}
REFUSED = [
    (_rename, NAME),
    (_standing_name, NAME),
    (_spec("enableInTreeAutoscaling", True), FIELDS),
    (_spec("autoscalerOptions", {"image": "evil:1"}), FIELDS),
    (_spec("gcsFaultToleranceOptions", REDIS), FIELDS),
    (_spec("historyServerOptions", {"collectorOptions": {"image": "evil:1"}}), FIELDS),
    (
        _spec("headServiceAnnotations", {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internet-facing"}),
        FIELDS,
    ),
    (_spec("networkPolicy", {"head": {}}), FIELDS),
    (_spec("managedBy", "kueue.x-k8s.io/multikueue"), FIELDS),
    (_spec("tlsOptions", {"enabled": True}), FIELDS),
    (_spec("authOptions", {"mode": "disabled"}), AUTH),
    (_spec("authOptions.secretName", "prefect-api-auth"), AUTH),
    # KubeRay then mounts a projected Kubernetes API token for the pods' account into every Ray container
    (_spec("authOptions.enableK8sTokenAuth", True), AUTH),
    (_spec("headGroupSpec.serviceType", "LoadBalancer"), HEAD_SERVICE),
    (_spec("headGroupSpec.serviceType", "NodePort"), HEAD_SERVICE),
    (_spec("headGroupSpec.headService", {"spec": {"type": "LoadBalancer"}}), HEAD_SERVICE),
    (_spec("headGroupSpec.enableIngress", True), HEAD_SERVICE),
    (_spec("headGroupSpec.ingressOptions", {"host": "ray.example"}), HEAD_SERVICE),
    (_worker_pod(lambda pod: pod.update(serviceAccountName="prefect-worker")), PODS),
    (_worker_pod(lambda pod: pod.pop("serviceAccountName")), PODS),
    (_worker_pod(lambda pod: pod.update(automountServiceAccountToken=True)), PODS),
    (_worker_pod(lambda pod: pod.update(initContainers=[{"name": "x", "image": CANDIDATE}])), PODS),
    (
        _worker_pod(lambda pod: pod["volumes"].append({"name": "s", "secret": {"secretName": "prefect-api-auth"}})),
        POD_VOLUMES,
    ),
    (
        _worker_pod(
            lambda pod: pod["volumes"].append(
                {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}
            )
        ),
        POD_VOLUMES,
    ),
    (
        _worker_pod(lambda pod: pod["volumes"].append({"name": "c", "persistentVolumeClaim": {"claimName": "other"}})),
        POD_VOLUMES,
    ),
    (_head_container(lambda c: c["envFrom"].append({"secretRef": {"name": "prefect-api-auth"}})), POD_SECRETS),
    (_head_container(lambda c: c["envFrom"].append({"configMapRef": {"name": "aws-auth"}})), POD_SECRETS),
    (
        _head_container(
            lambda c: c["env"].append(
                {"name": "K", "valueFrom": {"secretKeyRef": {"name": "prefect-api-auth", "key": "k"}}}
            )
        ),
        POD_SECRETS,
    ),
    # labelled as a flow-run pod, a candidate's pods would pass networkpolicy.yaml into the standing cluster
    (
        lambda body: body["spec"]["workerGroupSpecs"][-1]["template"]["metadata"]["labels"].update(
            {"app.kubernetes.io/component": "flow-run"}
        ),
        POD_LABELS,
    ),
    (
        lambda body: body["spec"]["headGroupSpec"]["template"]["metadata"]["labels"].update(
            {"ray.io/cluster": "tuneproof"}
        ),
        POD_LABELS,
    ),
]


@pytest.mark.parametrize(
    ("change", "message"), REFUSED, ids=[f"{i}-{(m or '')[:24]}" for i, (_, m) in enumerate(REFUSED)]
)
def test_a_canary_raycluster_beyond_raycluster_yaml_is_refused_with_the_policys_message(change, message):
    body = candidate_cluster()
    change(body)
    # the field survives the KubeRay CRD's pruning: a rule for a field the CRD lacks would never fire
    assert stored_raycluster(body) != stored_raycluster(candidate_cluster())
    assert raycluster_admission(body).refusals == (message,)


def test_the_operator_and_admins_are_not_held_to_the_canarys_shape():
    body = candidate_cluster()
    body["spec"]["enableInTreeAutoscaling"] = True
    assert not raycluster_admission(body, username=KUBERAY).applies
    assert not raycluster_admission(body, username=PIPELINE_WORKER).applies


def test_a_v1alpha1_canary_raycluster_is_refused_for_want_of_token_auth():
    # the policy matches every served version; v1alpha1 has no authOptions, so its RayClusters run without Ray auth
    body = {**candidate_cluster(), "apiVersion": "ray.io/v1alpha1"}
    assert raycluster_admission(body).refusals == (AUTH,)


def test_every_field_the_canary_policy_guards_is_in_the_kuberay_crd():
    # a has() on a field the CRD lacks is always false after pruning: the rule would guard nothing
    spec = crd_schema("v1")["properties"]["spec"]["properties"]
    head = spec["headGroupSpec"]["properties"]
    text = " ".join(v["expression"] for v in RAYCLUSTERS["spec"]["validations"])
    for path in re.findall(r"has\(object\.spec\.([\w.]+)\)", text):
        node: dict = {"properties": spec}
        for key in path.split("."):
            assert key in (node.get("properties") or {}), f"spec.{path} is not in the KubeRay CRD"
            node = node["properties"][key]
    assert {"serviceType", "headService", "enableIngress", "ingressOptions"} <= set(head)


def test_the_evaluator_refuses_on_an_error_as_failure_policy_fail_does():
    broken = copy.deepcopy(RAYCLUSTERS)
    broken["spec"]["validations"][0]["expression"] = "variables.cluster.metadata.nmae.startsWith('tuneproof-canary-')"
    refusals = admission(
        broken,
        operation="CREATE",
        username=CANARY,
        obj=stored_raycluster(candidate_cluster()),
        group_version=("ray.io", "v1"),
        resource="rayclusters",
    ).refusals
    assert len(refusals) == 1 and refusals[0].startswith("error in ") and "nmae" in refusals[0]


def test_the_canary_prefix_is_the_one_kube_canary_names_its_clusters_with():
    assert f"'{CANARY_CLUSTER_PREFIX}'" in RAYCLUSTERS["spec"]["validations"][0]["expression"]
    assert canary_name(uuid.uuid4().hex).startswith(CANARY_CLUSTER_PREFIX)
