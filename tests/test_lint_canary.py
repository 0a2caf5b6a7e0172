"""`tuneproof lint`: the image canary's own pool, worker and identity (SECURITY.md, "The image canary").

    python -m pytest -q tests/test_lint_canary.py

As in tests/test_lint_security.py: each test copies deployments/ and prefect.yaml, breaks one part of the
canary's separation from the pipeline the way an engineer could, and asserts exit code 1 and the finding
that names it. The committed files lint clean, so every failure here is the mutation's.
"""

from __future__ import annotations

import json

import yaml

from tests.test_lint_eks import edit, eks_deployment, lint_failed, project
from tests.test_lint_security import TEMPLATE, deploy, template_pod
from tuneproof.core.config import PROJECT_ROOT

__all__ = ["project"]  # the fixture, shared with tests/test_lint_eks.py

CANARY_TEMPLATE = "prefect-k8s-canary-job-template.json"
PIPELINE_WORKER = "system:serviceaccount:tuneproof:prefect-worker"
CANARY_WORKER = "system:serviceaccount:tuneproof:prefect-worker-canary"


def in_canary_role(change):
    return lambda doc: (
        change(doc) if doc.get("kind") == "Role" and doc["metadata"]["name"] == "tuneproof-canary" else None
    )


def in_admission_policy(change):
    return lambda doc: change(doc) if doc.get("kind") == "ValidatingAdmissionPolicy" else None


def account_variable(policy: dict) -> dict:
    return next(v for v in policy["spec"]["variables"] if v["name"] == "account")


def lint_fails(project, capsys, name: str, change) -> str:
    """lint's output for the copy with `change` applied to deployments/<name>; exit 1 asserted."""
    edit(deploy(project, name), change)
    return lint_failed(project, capsys)


# ---------------------------------------------------------------- the canary's RBAC


def test_the_canary_role_writes_nothing_but_create_and_delete_on_rayclusters(project, capsys):
    def widen(role):
        role["rules"][0]["verbs"] += ["patch", "update"]  # edit the standing cluster
        role["rules"][1]["verbs"].append("create")  # start any pod
        role["rules"].append({"apiGroups": ["*"], "resources": ["*"], "verbs": ["delete"]})

    out = lint_fails(project, capsys, "canary.yaml", in_canary_role(widen))
    expected = "expected 'create and delete on ray.io rayclusters, read verbs elsewhere'"
    assert f"Role/tuneproof-canary: rules[0].verbs is ['patch', 'update'], {expected}" in out
    assert f"Role/tuneproof-canary: rules[1].verbs is ['create'], {expected}" in out
    assert f"Role/tuneproof-canary: rules[2].verbs is ['delete'], {expected}" in out  # a wildcard is not rayclusters
    assert "bound to tuneproof-canary, the canary's account" in out


def test_the_pipeline_account_stays_read_only(project, capsys):
    # The canary's rights are its own: granting them to the pipeline's account is still the read-only rule's error.
    def also_pipeline(binding):
        if binding.get("kind") == "RoleBinding" and binding["metadata"]["name"] == "tuneproof-canary":
            binding["subjects"].append(
                {"kind": "ServiceAccount", "name": "tuneproof-pipeline", "namespace": "tuneproof"}
            )

    out = lint_fails(project, capsys, "canary.yaml", also_pipeline)
    assert "Role/tuneproof-canary: rules[0].verbs is ['create', 'delete'], expected ['get', 'list', 'watch']" in out
    assert "bound to tuneproof-pipeline" in out and "the pipeline only reads the cluster" in out


def test_the_canary_role_grants_every_call_the_canary_makes(project, capsys):
    def narrow(doc):
        if doc.get("kind") == "Role" and doc["metadata"]["name"] == "tuneproof-canary":
            doc["rules"][0]["verbs"].remove("delete")
        if doc.get("kind") == "ClusterRoleBinding":  # the nodes and ResourceSlices verify reads
            doc["subjects"][0]["name"] = "someone-else"

    out = lint_fails(project, capsys, "canary.yaml", narrow)
    assert (
        f"{CANARY_TEMPLATE}: Prefect base job template: roles bound to tuneproof-canary is \"missing ['delete "
        "rayclusters.ray.io', 'get nodes', 'list nodes', 'get resourceslices.resource.k8s.io', 'list "
        "resourceslices.resource.k8s.io']\", expected 'each granted'"
    ) in out
    assert "the API server answers 403" in out


# ---------------------------------------------------------------- pools and templates


def test_image_canary_deploys_on_the_canary_pool_and_nothing_else_does(project, capsys):
    def swap(doc):  # the pool names only; each keeps its job variables (copied: YAML anchors share one dict)
        canary, nightly = eks_deployment(doc, "image-canary"), eks_deployment(doc, "eks-nightly")
        canary["work_pool"] = {**canary["work_pool"], "name": "tuneproof-eks"}
        nightly["work_pool"] = {**nightly["work_pool"], "name": "tuneproof-eks-canary"}

    edit(project / "prefect.yaml", swap)
    out = lint_failed(project, capsys)
    assert (
        "deployment image-canary: work_pool.name is 'tuneproof-eks', expected 'tuneproof-eks-canary' (the canary "
        "creates and deletes its RayCluster"
    ) in out
    assert (
        "deployment eks-nightly: work_pool.name is 'tuneproof-eks-canary', expected 'any pool but tuneproof-eks-canary'"
    ) in out
    # each deployment is also checked against its own pool's template: neither can keep its account
    assert (
        "deployment eks-nightly: work_pool.job_variables.service_account_name is 'tuneproof-pipeline', expected "
        "'const: \"tuneproof-canary\"'"
    ) in out
    assert (
        "deployment image-canary: work_pool.job_variables.service_account_name is 'tuneproof-canary', expected "
        "'const: \"tuneproof-pipeline\"'"
    ) in out


def test_the_canary_template_pins_the_canary_account_and_no_other_template_does(project, capsys):
    def pin(account):
        return lambda t: t["variables"]["properties"]["service_account_name"].update(const=account, default=account)

    edit(deploy(project, CANARY_TEMPLATE), pin("tuneproof-pipeline"))
    edit(deploy(project, TEMPLATE), pin("tuneproof-canary"))
    out = lint_failed(project, capsys)
    assert (
        f"{CANARY_TEMPLATE}: Prefect base job template: variables.properties.service_account_name.const is "
        "'tuneproof-pipeline', expected 'tuneproof-canary'"
    ) in out
    assert (
        f"{TEMPLATE}: Prefect base job template: variables.properties.service_account_name.const is "
        "'tuneproof-canary', expected 'any account but tuneproof-canary'"
    ) in out


def test_the_canary_template_is_the_pipelines_but_for_the_account(project, capsys):
    def drift(template):
        template_pod(template)["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
        template["variables"]["properties"]["memory_limit"]["default"] = "64Gi"

    out = lint_fails(project, capsys, CANARY_TEMPLATE, drift)
    assert (
        f"{CANARY_TEMPLATE}: Prefect base job template: differences from {project}/deployments/{TEMPLATE} is "
        "['job_configuration.job_manifest.spec.template.spec.containers[0].securityContext.allowPrivilegeEscalation', "
        "'variables.properties.memory_limit.default'], expected 'none but the service account and the Ray token Secret (and descriptions)'"
    ) in out


def test_the_committed_canary_template_differs_only_in_the_account_and_the_token():
    base = json.loads((PROJECT_ROOT / "deployments" / TEMPLATE).read_text())
    canary = json.loads((PROJECT_ROOT / "deployments" / CANARY_TEMPLATE).read_text())
    tokens = [template_pod(t)["volumes"][0]["secret"].pop("secretName") for t in (base, canary)]
    assert tokens == ["tuneproof-ray-auth", "tuneproof-canary-ray-auth"]
    for template in (base, canary):
        template["variables"].pop("description")
        template["variables"]["properties"].pop("service_account_name")
    assert canary == base


# ---------------------------------------------------------------- admission: identity follows the worker


def test_the_admission_policy_holds_each_worker_to_its_pools_account(project, capsys):
    def cross(policy):
        account_variable(policy)["expression"] = (
            f"{{'{PIPELINE_WORKER}': 'tuneproof-canary', '{CANARY_WORKER}': 'tuneproof-canary'}}"
            "[request.userInfo.username]"
        )

    out = lint_fails(project, capsys, "flow-run-admission.yaml", in_admission_policy(cross))
    assert (
        "ValidatingAdmissionPolicy/tuneproof-flow-run-jobs: "
        f"spec.variables[{PIPELINE_WORKER}] is 'tuneproof-canary', expected 'tuneproof-pipeline'"
    ) in out
    assert "or a flow run could take another pool's identity" in out
    assert f"spec.variables[{CANARY_WORKER}]" not in out  # the canary's own entry is right


def test_a_table_no_validation_reads_holds_nothing(project, capsys):
    def unread(policy):
        policy["spec"]["validations"][0]["expression"] = "has(variables.pod.serviceAccountName)"

    out = lint_fails(project, capsys, "flow-run-admission.yaml", in_admission_policy(unread))
    assert "spec.validations is 'no use of variables.account', expected 'tuneproof-pipeline'" in out
    assert "spec.validations is 'no use of variables.account', expected 'tuneproof-canary'" in out


def test_the_canary_workers_jobs_must_be_matched_by_the_policy(project, capsys):
    def pipeline_worker_only(policy):
        policy["spec"]["matchConditions"][0]["expression"] = f"request.userInfo.username == '{PIPELINE_WORKER}'"

    out = lint_fails(project, capsys, "flow-run-admission.yaml", in_admission_policy(pipeline_worker_only))
    assert (
        f"{CANARY_TEMPLATE}: Prefect base job template: ValidatingAdmissionPolicy for the worker's Jobs is None, "
        f"expected 'a policy bound with validationActions [Deny] matching batch/v1 jobs CREATE by {CANARY_WORKER}'"
    ) in out


def test_a_worker_account_shared_by_two_pools_is_an_error(project, capsys):
    def share(doc):
        if doc.get("kind") == "Deployment":
            doc["spec"]["template"]["spec"]["serviceAccountName"] = "prefect-worker"

    out = lint_fails(project, capsys, "canary.yaml", share)
    assert (
        f"workers polling tuneproof-eks-canary is \"{PIPELINE_WORKER} polls ['tuneproof-eks', "
        "'tuneproof-eks-canary']\", expected 'one service account per worker, each polling one pool'"
    ) in out


# ---------------------------------------------------------------- the canary's worker


def test_the_canary_worker_is_the_pipelines_but_for_name_account_and_pool():
    def worker(file: str) -> dict:
        docs = yaml.safe_load_all((PROJECT_ROOT / "deployments" / file).read_text())
        return next(d for d in docs if d["kind"] == "Deployment")

    canary, pipeline = worker("canary.yaml"), worker("prefect-worker.yaml")
    text = json.dumps(canary)
    for old, new in (
        ('"prefect-worker-canary"', '"prefect-worker"'),
        ('"tuneproof-eks-canary"', '"tuneproof-eks"'),
    ):
        text = text.replace(old, new)
    assert json.loads(text) == pipeline


# ---------------------------------------------------------------- admission: what the canary's RayClusters may be


def in_canary_cluster_policy(change):
    return lambda doc: (
        change(doc)
        if doc.get("kind") == "ValidatingAdmissionPolicy" and doc["metadata"]["name"] == "tuneproof-canary-rayclusters"
        else None
    )


def test_the_canarys_rayclusters_are_held_by_an_admission_policy(project, capsys):
    out = lint_fails(
        project,
        capsys,
        "canary.yaml",
        in_canary_cluster_policy(
            lambda p: p["spec"]["matchConstraints"]["resourceRules"][0].update(operations=["CREATE"])
        ),
    )
    assert (
        f"{CANARY_TEMPLATE}: Prefect base job template: ValidatingAdmissionPolicy for the canary's RayClusters is None, "
        "expected 'a policy bound with validationActions [Deny] matching ray.io rayclusters CREATE and DELETE by "
        "system:serviceaccount:tuneproof:tuneproof-canary'"
    ) in out  # DELETE unmatched: the canary could delete the standing cluster
    assert "delete the standing RayCluster" in out


def test_the_canary_cluster_policy_holds_the_canary_to_its_own_identity(project, capsys):
    def loosen(policy):
        for v in policy["spec"]["validations"]:
            v["expression"] = (
                v["expression"].replace("'tuneproof-canary-ray'", "'default'").replace("'tuneproof-canary-'", "'t'")
            )

    out = lint_fails(project, capsys, "canary.yaml", in_canary_cluster_policy(loosen))
    policy = "ValidatingAdmissionPolicy/tuneproof-canary-rayclusters: spec.validations"
    assert f"{policy} is \"no expression naming 'tuneproof-canary-'\", expected 'tuneproof-canary-'" in out
    assert f"{policy} is \"no expression naming 'tuneproof-canary-ray'\", expected 'tuneproof-canary-ray'" in out
    assert "the canary clusters' pods' own service account" in out
    assert "'tuneproof-canary-ray-auth'\"" not in out  # the token Secret is still named


def test_the_canary_cluster_policy_never_admits_the_standing_clusters_token_or_account(project, capsys):
    def production(policy):  # the canary's RayClusters held to raycluster.yaml's identity, as before issue 32
        for v in policy["spec"]["validations"]:
            v["expression"] = (
                v["expression"]
                .replace("'tuneproof-canary-ray-auth'", "'tuneproof-ray-auth'")
                .replace("'tuneproof-canary-ray'", "'tuneproof-ray'")
            )

    out = lint_fails(project, capsys, "canary.yaml", in_canary_cluster_policy(production))
    policy = "ValidatingAdmissionPolicy/tuneproof-canary-rayclusters: spec.validations"
    assert (
        f"{policy} is \"an expression naming 'tuneproof-ray-auth'\", expected 'none naming tuneproof-ray-auth'" in out
    )
    assert f"{policy} is \"an expression naming 'tuneproof-ray'\", expected 'none naming tuneproof-ray'" in out
    assert "RayCluster/tuneproof's token Secret: a candidate image given it could submit jobs to the standing" in out


def test_the_canary_template_never_mounts_the_standing_clusters_token(project, capsys):
    def production_token(template):
        template_pod(template)["volumes"][0]["secret"]["secretName"] = "tuneproof-ray-auth"

    out = lint_fails(project, capsys, CANARY_TEMPLATE, production_token)
    assert (
        f"{CANARY_TEMPLATE}: Prefect base job template: job_manifest volumes[ray-auth].secret.secretName is "
        "'tuneproof-ray-auth', expected 'tuneproof-canary-ray-auth'"
    ) in out
    assert "would let a candidate's flow run submit jobs to production" in out


def in_canary_ray_account(change):
    return lambda doc: (
        change(doc["metadata"])
        if doc.get("kind") == "ServiceAccount" and doc["metadata"]["name"] == "tuneproof-canary-ray"
        else None
    )


def test_the_canary_clusters_account_has_a_bucket_role_of_its_own(project, capsys):
    standing = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/tuneproof-ray-s3"}
    out = lint_fails(project, capsys, "canary.yaml", in_canary_ray_account(lambda m: m.update(annotations=standing)))
    assert (
        "ServiceAccount/tuneproof-canary-ray: metadata.annotations[eks.amazonaws.com/role-arn] is "
        "'arn:aws:iam::123456789012:role/tuneproof-ray-s3', expected \"an IAM role of its own, not tuneproof-ray's\""
    ) in out


def test_the_canary_clusters_account_must_exist(project, capsys):
    out = lint_fails(project, capsys, "canary.yaml", in_canary_ray_account(lambda m: m.update(name="someone-else")))
    assert "the canary clusters' service account tuneproof-canary-ray is 'tuneproof-canary-ray (not among" in out


def test_the_canary_bucket_policy_writes_only_the_canary_prefix(project, capsys):
    def whole_bucket(policy):
        policy["Statement"][2]["Resource"] = "arn:aws:s3:::tuneproof-artifacts/*"

    out = lint_fails(project, capsys, "s3-canary-policy.json", whole_bucket)
    assert (
        "s3-canary-policy.json: IAMPolicy: Statement[WriteTheCanaryPrefixOnly].Resource is "
        "'arn:aws:s3:::tuneproof-artifacts/*', expected 'arn:aws:s3:::<bucket>/<storage root>/canary/*'"
    ) in out


def test_the_canary_template_without_canary_yaml_names_what_is_missing(project, capsys):
    deploy(project, "canary.yaml").unlink()
    out = lint_failed(project, capsys)
    assert f'{CANARY_TEMPLATE}: Prefect base job template: roles bound to tuneproof-canary is "missing [' in out
    assert "ValidatingAdmissionPolicy for the canary's RayClusters is None" in out
    assert "spec.variables[" not in out  # no canary worker linted: the Jobs policy is not asked to map one
