"""The AWS side: the eksctl cluster config, the bucket policy, the walkthrough script, the flow-run image's pins.

- an add-on that calls AWS has an identity: eksctl wires IAM itself only for vpc-cni, EBS and EFS; any other
  (the FSx CSI driver) needs a pod identity association (with the eks-pod-identity-agent add-on) or a role;
- a node group's zones are among the cluster's, and an EFA group sits in one zone;
- the Ray pods, the standing RayCluster's and an image canary's copy of it (tuneproof/control/kube_canary.py),
  fit the node groups their nodeSelectors pick, at most maxSize nodes each;
- no script installs a device plugin eksctl installs itself (NVIDIA for a GPU type, EFA for efaEnabled);
- a security group that admits Lustre admits both its ranges (988, 1018-1023) from itself, as FSx requires;
- a script exports PREFECT_API_URL and the API credential before its first `prefect` command (else the
  command talks to prefect.toml's 127.0.0.1, or unauthenticated);
- the bucket policy lets the writers abort a multipart upload (s3fs and boto3 upload checkpoints in parts);
- the flow-run image's Ray is the cluster's (rayVersion): the job client and the dashboard speak one version;
- role ARNs, subnets and security groups still holding the shipped placeholders are warnings.
"""

from __future__ import annotations

import math

from tuneproof.app.lint.documents import Doc, as_list, group_pod_spec, ray_groups, schema_findings
from tuneproof.app.lint.nodes import (
    DAEMONSET_ALLOWANCE,
    INSTANCE_TYPE_LABEL,
    allocatable,
    efa_hugepages_gib,
    eks_instance_types,
    pod_requests,
)
from tuneproof.control.kube_canary import CANARY_LABEL, NODE_GROUP_LABEL, canary_manifest, canary_name
from tuneproof.control.kube_checks import EFA_RESOURCE, GPU_RESOURCE, group_pod_count
from tuneproof.core.findings import Finding, errors

AWS_ADDONS = ("aws-fsx-csi-driver", "aws-mountpoint-s3-csi-driver", "amazon-cloudwatch-observability")
"""EKS add-ons whose controllers call AWS APIs and that eksctl gives no IAM role by itself."""
ADDON_IDENTITY_KEYS = (
    "podIdentityAssociations",
    "useDefaultPodIdentityAssociations",
    "serviceAccountRoleARN",
    "attachPolicyARNs",
    "attachPolicy",
    "wellKnownPolicies",
)
POD_IDENTITY_AGENT = "eks-pod-identity-agent"
LUSTRE_PORTS = ("988", "1018-1023")
DEVICE_PLUGIN_CHARTS = {
    "nvidia-device-plugin": "the NVIDIA device plugin",
    "efa-k8s-device-plugin": "the EFA device plugin",
}
PREFECT_CREDENTIAL_EXPORTS = ("PREFECT_API_AUTH_STRING", "PREFECT_API_KEY")
OBJECT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload")
PLACEHOLDERS = {
    "123456789012": "the example AWS account id",
    "subnet-0123456789abcdef0": "the example subnet",
    "sg-0123456789abcdef0": "the example security group",
}


def cluster_config_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    return [*addon_identity_findings(doc), *zone_findings(doc), *node_group_fit_findings(doc, docs)]


def addon_identity_findings(doc: Doc) -> list[Finding]:
    """Every add-on that calls AWS has an identity; pod identity needs its agent among the add-ons."""
    addons = [a for a in doc.obj.get("addons") or [] if isinstance(a, dict)]
    names = [a.get("name") for a in addons]
    auto = bool((doc.obj.get("addonsConfig") or {}).get("autoApplyPodIdentityAssociations"))
    findings = []
    for i, addon in enumerate(addons):
        has_identity = auto or any(addon.get(key) for key in ADDON_IDENTITY_KEYS)
        if addon.get("name") in AWS_ADDONS and not has_identity:
            findings.append(
                Finding(
                    doc.subject,
                    f"addons[{addon.get('name')}]",
                    "no identity",
                    "podIdentityAssociations (with the eks-pod-identity-agent add-on) or serviceAccountRoleARN",
                    "eksctl wires IAM only for vpc-cni, EBS and EFS: this add-on's controller gets no AWS "
                    "credentials, and everything it provisions (an FSx claim) stays Pending",
                )
            )
        uses_agent = auto or addon.get("podIdentityAssociations") or addon.get("useDefaultPodIdentityAssociations")
        if uses_agent and POD_IDENTITY_AGENT not in names[:i]:
            findings.append(
                Finding(
                    doc.subject,
                    f"addons[{addon.get('name')}].podIdentityAssociations",
                    names,
                    f"{POD_IDENTITY_AGENT} listed before {addon.get('name')}",
                    "a pod identity association is served by the agent add-on: without it the pods get no credentials",
                )
            )
    return findings


def zone_findings(doc: Doc) -> list[Finding]:
    """A node group's zones are the cluster's; an EFA group has exactly one (EFA traffic stays in a zone)."""
    zones = doc.obj.get("availabilityZones") or []
    findings = []
    for group in node_groups(doc):
        field = f"managedNodeGroups[{group.get('name')}].availabilityZones"
        own = group.get("availabilityZones") or []
        if own and not set(own) <= set(zones):
            findings.append(
                Finding(
                    doc.subject,
                    field,
                    own,
                    f"zones among availabilityZones {zones}",
                    "eksctl makes subnets only in the cluster's zones: a group elsewhere has none, or lands where "
                    "eksctl picked",
                )
            )
        if group.get("efaEnabled") and len(own) != 1:
            findings.append(
                Finding(doc.subject, field, own, "exactly one zone", "EFA traffic cannot cross availability zones")
            )
    return findings


def node_groups(doc: Doc) -> list[dict]:
    spec = doc.obj
    return [g for g in [*(spec.get("managedNodeGroups") or []), *(spec.get("nodeGroups") or [])] if isinstance(g, dict)]


def node_group_fit_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """The Ray pods (each RayCluster's and its canary copy's) fit the node groups they select (first fit).

    Pods are fitted a group at a time, by count: an autoscaling group may reach KubeRay's default maxReplicas
    (2**31 - 1), far too many to list one by one."""
    free = {g.get("name"): _nodes(g) for g in node_groups(doc)}
    findings = []
    for label, pod_spec, count in sorted(ray_pods(docs), key=lambda p: -pod_requests(p[1])[GPU_RESOURCE]):
        need = pod_requests(pod_spec)
        fits = [g for g in node_groups(doc) if _selects(pod_spec, g)]
        placed = 0
        for group in fits:
            placed += _take(free[group.get("name")], need, count - placed)
        if placed < count:
            findings.append(
                Finding(
                    doc.subject,
                    "managedNodeGroups " + (", ".join(str(g.get("name")) for g in fits) or "(none selected)"),
                    f"{placed} of {count} pods of {label} fit",
                    "a node group with room for every Ray pod at maxSize",
                    "the pods that do not fit would stay Pending: give them a node group of their own, or room in "
                    "the one they select (deployments/README.md, 'The image canary's capacity')",
                )
            )
    return findings


def ray_pods(docs: list[Doc]) -> list[tuple[str, dict, int]]:
    """(which group, its pod spec, how many pods) for every group of every RayCluster and of its canary copy."""
    pods = []
    valid = (
        d for d in docs if d.kind == "RayCluster" and not errors(schema_findings(d))
    )  # a broken one: its own finding
    for doc in valid:
        canary = canary_manifest(doc.obj, "candidate", canary_name("lint"), doc.namespace or "default")
        for what, body in ((doc.name, doc.obj), (f"the image canary's copy of {doc.name}", canary)):
            for where, group in ray_groups(body):
                count = 1 if where == "spec.headGroupSpec" else group_pod_count(body, group)
                pods.append((f"{what} {where}", group_pod_spec(group), count))
    return pods


def _nodes(group: dict) -> list[dict[str, float]]:
    """What each node of the group offers pods at maxSize (an unknown instance type offers nothing known)."""
    instance = eks_instance_types().get(str(group.get("instanceType")))
    if instance is None:
        return []
    cores, gib = allocatable(instance)
    room = {
        "cpu": cores - DAEMONSET_ALLOWANCE[0],
        "memory": gib - DAEMONSET_ALLOWANCE[1] - efa_hugepages_gib(instance),
        GPU_RESOURCE: instance["gpus"],
        EFA_RESOURCE: instance["efa"],
    }
    size = group.get("maxSize", group.get("desiredCapacity", 0)) or 0
    return [dict(room) for _ in range(int(size))]


def _take(nodes: list[dict[str, float]], need: dict[str, float], count: int) -> int:
    """Place up to `count` pods that each need `need`, first fit: how many found room (taken from `nodes`).

    Identical pods fill the first node with room before the next, so a node takes as many as it has room for."""
    placed = 0
    for node in nodes:
        taken = _room(node, need, count - placed)
        for k in node:
            node[k] -= taken * need[k]
        placed += taken
    return placed


def _room(node: dict[str, float], need: dict[str, float], most: int) -> int:
    """How many pods that each need `need` the node still has room for, at most `most`."""
    room = most
    for k in node:
        if need[k] > 0:
            room = min(room, math.floor(node[k] / need[k]))
        elif node[k] < need[k]:
            return 0
    return max(room, 0)


def _selects(pod_spec: dict, group: dict) -> bool:
    """The pod's nodeSelector matches the group's nodes, and it tolerates their NoSchedule taints."""
    labels = {**(group.get("labels") or {}), NODE_GROUP_LABEL: group.get("name")}
    labels[INSTANCE_TYPE_LABEL] = group.get("instanceType")
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    tolerations = pod_spec.get("tolerations") or []
    return all(
        any(
            t.get("key") == taint.get("key") and (t.get("operator") == "Exists" or t.get("value") == taint.get("value"))
            for t in tolerations
        )
        for taint in group.get("taints") or []
        if taint.get("effect") in ("NoSchedule", "NoExecute")
    )


def script_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    commands = doc.obj.get("commands") or []
    return [
        *device_plugin_findings(doc, docs, commands),
        *lustre_rule_findings(doc, commands),
        *prefect_api_findings(doc, commands),
    ]


def device_plugin_findings(doc: Doc, docs: list[Doc], commands: list[dict]) -> list[Finding]:
    """A Helm install of a device plugin that eksctl already installs on the cluster config's node groups."""
    groups = [g for d in docs if d.kind == "ClusterConfig" for g in node_groups(d)]
    installed = {
        "nvidia-device-plugin": any(
            (eks_instance_types().get(str(g.get("instanceType"))) or {}).get("gpus") for g in groups
        )
        and not any("--install-nvidia-plugin=false" in c["argv"] for c in commands),
        "efa-k8s-device-plugin": any(g.get("efaEnabled") for g in groups),
    }
    return [
        Finding(
            doc.subject,
            f"line {c['line']}",
            " ".join(c["argv"][:5]),
            f"no second install of {what}",
            "eksctl installs it with the node groups (GPU instance type, efaEnabled): two DaemonSets would "
            "advertise the same devices",
        )
        for c in commands
        if c["argv"][:1] == ["helm"] and ("install" in c["argv"] or "upgrade" in c["argv"])
        for chart, what in DEVICE_PLUGIN_CHARTS.items()
        if installed[chart] and any(chart in word for word in c["argv"])
    ]


def lustre_rule_findings(doc: Doc, commands: list[dict]) -> list[Finding]:
    """A group given any Lustre rule admits 988 and 1018-1023 from itself: FSx refuses it otherwise."""
    rules: dict[str, set[tuple[str, str]]] = {}
    for c in commands:
        argv = c["argv"]
        if "authorize-security-group-ingress" in argv and "--group-id" in argv:
            group = _option(argv, "--group-id")
            rules.setdefault(group, set()).add((_option(argv, "--port"), _option(argv, "--source-group")))
    return [
        Finding(
            doc.subject,
            f"authorize-security-group-ingress --group-id {group}",
            sorted(f"{port} from {source}" for port, source in granted),
            f"{port} from {group} (the group itself)",
            "FSx for Lustre refuses a security group that does not admit its own Lustre traffic (988 and 1018-1023 "
            "from itself): creating the file system fails and the claim stays Pending",
        )
        for group, granted in rules.items()
        if any(port in LUSTRE_PORTS for port, _ in granted)
        for port in LUSTRE_PORTS
        if (port, group) not in granted
    ]


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1] if name in argv[:-1] else ""


def prefect_api_findings(doc: Doc, commands: list[dict]) -> list[Finding]:
    """The script exports the API URL and a credential on a line above its first `prefect` command."""
    assigned = {w.split("=", 1)[0]: w.split("=", 1)[1] for c in commands for w in c["argv"][:1] if "=" in w}
    runs = [c for c in commands if _program(c["argv"][0], assigned) == "prefect"]
    if not runs:
        return []
    first = runs[0]["line"]
    exported = {
        w.split("=")[0] for c in commands if c["argv"][0] == "export" and c["line"] < first for w in c["argv"][1:]
    }
    missing = [n for n in ("PREFECT_API_URL",) if n not in exported]
    if not exported & set(PREFECT_CREDENTIAL_EXPORTS):
        missing.append(" or ".join(PREFECT_CREDENTIAL_EXPORTS))
    return [
        Finding(
            doc.subject,
            f"line {first}: {' '.join(runs[0]['argv'][:3])}",
            f"{name} not exported above it",
            f"export {name} before the first prefect command",
            "unset, prefect talks to prefect.toml's 127.0.0.1 (or without credentials): the work pools are made on "
            "another server, and the worker finds none",
        )
        for name in missing
    ]


def _program(word: str, assigned: dict[str, str]) -> str:
    value = assigned.get(word.lstrip("$").strip("{}"), word) if word.startswith("$") else word
    return value.rsplit("/", 1)[-1]


def iam_policy_findings(doc: Doc) -> list[Finding]:
    """The statement on the bucket's objects allows every action the pipeline's writers take."""
    statements = [s for s in doc.obj.get("Statement") or [] if isinstance(s, dict) and s.get("Effect") == "Allow"]
    on_objects = [s for s in statements if any(str(r).endswith("/*") for r in as_list(s.get("Resource")))]
    granted = {a for s in on_objects for a in as_list(s.get("Action"))}
    if not on_objects or "s3:*" in granted:
        return []
    return [
        Finding(
            doc.subject,
            "Statement[objects].Action",
            sorted(granted),
            f"includes {action}",
            "s3fs and boto3 write checkpoints and exports in parts: without AbortMultipartUpload a failed upload "
            "cannot be cleaned up (its parts stay, billed)"
            if action == "s3:AbortMultipartUpload"
            else "the pipeline's writers read, write and delete objects under the storage root",
        )
        for action in OBJECT_ACTIONS
        if action not in granted
    ]


def ray_skew_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """The flow-run image's Ray (the job client) is every RayCluster's rayVersion."""
    pinned = (doc.obj.get("pins") or {}).get("ray")
    return [
        Finding(
            doc.subject,
            "ray",
            pinned,
            rc.obj["spec"]["rayVersion"],
            f"{rc.subject}'s rayVersion: the flow runs submit and follow jobs with this Ray's client; pin the "
            "cluster's, so a change on either side is one visible edit",
        )
        for rc in docs
        if rc.kind == "RayCluster" and pinned and (rc.obj.get("spec") or {}).get("rayVersion") not in (None, pinned)
    ]


def canary_label_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """The canary's pods carry no labels a NetworkPolicy admits for the pipeline's own pods (flow runs)."""
    canary = canary_manifest(doc.obj, "candidate", canary_name("lint"), doc.namespace or "default")
    peers = [
        (policy, (peer.get("podSelector") or {}).get("matchLabels") or {})
        for policy in docs
        if policy.kind == "NetworkPolicy" and policy.namespace == doc.namespace and not _guards_canaries(policy)
        for rule in (policy.obj.get("spec") or {}).get("ingress") or []
        for peer in rule.get("from") or []
    ]
    findings = []
    for where, group in ray_groups(canary):
        labels = ((group.get("template") or {}).get("metadata") or {}).get("labels") or {}
        for policy, wanted in peers:
            if wanted and all(labels.get(k) == v for k, v in wanted.items()):
                findings.append(
                    Finding(
                        doc.subject,
                        f"{where}.template.metadata.labels",
                        labels,
                        f"labels {policy.subject} does not admit ({wanted})",
                        "the image canary copies these labels onto pods running a candidate image: they would reach "
                        "the standing cluster as if they were the pipeline's own pods",
                    )
                )
    return findings


def _guards_canaries(policy: Doc) -> bool:
    """The policy selects the canary's own pods (networkpolicy.yaml's tuneproof-canary-ray), not the standing cluster's."""
    return CANARY_LABEL in (((policy.obj.get("spec") or {}).get("podSelector") or {}).get("matchLabels") or {})


def placeholder_findings(doc: Doc) -> list[Finding]:
    """Role ARNs, subnets and security groups still holding deployments/' example values."""
    values = {
        **{f"metadata.annotations[{k}]": v for k, v in (doc.metadata.get("annotations") or {}).items()},
        **{f"parameters.{k}": v for k, v in (doc.obj.get("parameters") or {}).items()},
    }
    return [
        Finding(
            doc.subject,
            field,
            value,
            "your own value",
            f"{what}: deployments/eks-up.sh replaces it on the way to the cluster; applied by hand, it names "
            "nothing in your account",
            "warning",
        )
        for field, value in values.items()
        for placeholder, what in PLACEHOLDERS.items()
        if placeholder in str(value)
    ]
