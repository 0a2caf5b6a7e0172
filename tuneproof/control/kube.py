"""Read the RayCluster's objects from the Kubernetes API, or from saved `kubectl get -o json` files.

Live (the verify stage on eks, run in the flow-run pod as tuneproof-pipeline):

    objects = fetch_cluster_objects(cfg.cluster.kubernetes)
    findings = tuneproof.control.kube_checks.check_cluster(objects, cfg)

uses the official `kubernetes` client: in-cluster config when running in a pod and no kubeconfig is
configured, else the kubeconfig (cluster.kubernetes.kubeconfig, else ~/.kube/config). Every object is
kept as the API's own JSON (what `kubectl get -o json` prints), so live and saved inputs are the same.
ResourceSlices are optional (404 when the cluster serves no DRA API, 403 without the ClusterRole),
and so is the KubeRay operator Deployment (usually in another namespace the pipeline cannot read): either
is None when it cannot be read, the HTTP connection failing included, and the checks say what that leaves
unknown. An answer that is not a JSON object (a proxy's error page) is an infrastructure failure.

Offline (`tuneproof verify --from-files DIR`): load_objects_from_dir reads the files named in
SAVED_FILES (see deployments/README.md for the commands that write them).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from tuneproof.control.kube_checks import CLUSTER_LABEL
from tuneproof.core.config_cluster import KubernetesConfig
from tuneproof.core.files import decode_text, read_regular
from tuneproof.core.results import FailureClass, StageFailure

RESOURCE_API_VERSIONS = ("v1", "v1beta2", "v1beta1")
"""resource.k8s.io versions tried for ResourceSlices, newest first (v1 is GA in Kubernetes 1.34)."""
OPERATOR_SELECTOR = "app.kubernetes.io/name=kuberay-operator"
"""The label the KubeRay Helm chart puts on the operator Deployment."""
SAVED_FILES = {
    "raycluster": ("raycluster.json", True),
    "pods": ("pods.json", True),
    "nodes": ("nodes.json", True),
    "resourceslices": ("resourceslices.json", False),
    "ray_nodes": ("ray-nodes.json", False),
    "operator": ("operator.json", False),
}
"""Key -> (file name, required) for load_objects_from_dir."""
MAX_SAVED_BYTES = 256 << 20
"""A saved listing of a large cluster's pods is megabytes; a file past this (or a device) is not one."""
TIMEOUT_S = 30


def fetch_cluster_objects(kcfg: KubernetesConfig) -> dict[str, Any]:
    """The RayCluster, its pods, the nodes, ResourceSlices and the operator, as plain API JSON.

    Raises StageFailure(infrastructure) when the API server cannot be reached or refuses a
    required read; a missing RayCluster is returned as None for the checks to report.
    """
    api = api_client(kcfg)
    try:
        return {
            "raycluster": _raycluster(api, kcfg),
            "pods": _required(
                lambda: _items(
                    client.CoreV1Api(api).list_namespaced_pod(
                        kcfg.namespace,
                        label_selector=f"{CLUSTER_LABEL}={kcfg.raycluster}",
                        _preload_content=False,
                        _request_timeout=TIMEOUT_S,
                    ),
                    f"pods in namespace {kcfg.namespace}",
                ),
                f"pods in namespace {kcfg.namespace}",
            ),
            "nodes": _required(
                lambda: _items(
                    client.CoreV1Api(api).list_node(_preload_content=False, _request_timeout=TIMEOUT_S), "nodes"
                ),
                "nodes",
            ),
            "resourceslices": _resourceslices(api),
            "ray_nodes": None,
            "operator": _operator(api),
        }
    finally:
        api.close()


def api_client(kcfg: KubernetesConfig) -> client.ApiClient:
    """In-cluster credentials when in a pod and no kubeconfig is set, else the kubeconfig."""
    try:
        if kcfg.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        return config.new_client_from_config(config_file=kcfg.kubeconfig)
    except (ConfigException, OSError) as e:
        where = kcfg.kubeconfig or "in-cluster service account / ~/.kube/config"
        raise StageFailure(
            FailureClass.infrastructure,
            f"no Kubernetes credentials from {where}: {e} (set cluster.kubernetes.kubeconfig)",
        ) from e


def _raycluster(api: client.ApiClient, kcfg: KubernetesConfig) -> dict | None:
    what = f"RayCluster {kcfg.namespace}/{kcfg.raycluster}"
    try:
        return _json(
            client.CustomObjectsApi(api).get_namespaced_custom_object(
                "ray.io",
                "v1",
                kcfg.namespace,
                "rayclusters",
                kcfg.raycluster,
                _preload_content=False,
                _request_timeout=TIMEOUT_S,
            ),
            what,
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise _refused(what, e) from e
    except urllib3.exceptions.HTTPError as e:
        raise unreachable(api, e) from e


def _required(read: Callable[[], list[dict]], what: str) -> list[dict]:
    try:
        return read()
    except ApiException as e:
        raise _refused(what, e) from e
    except urllib3.exceptions.HTTPError as e:
        raise StageFailure(FailureClass.infrastructure, f"Kubernetes API unreachable reading {what}: {e}") from e


def _resourceslices(api: client.ApiClient) -> list[dict] | None:
    """DRA ResourceSlices from the newest served resource.k8s.io version; None when none is served or readable."""
    for version in RESOURCE_API_VERSIONS:
        try:
            return _items(
                client.CustomObjectsApi(api).list_cluster_custom_object(
                    "resource.k8s.io", version, "resourceslices", _preload_content=False, _request_timeout=TIMEOUT_S
                ),
                "resourceslices",
            )
        except ApiException as e:
            if e.status == 404:
                continue
            if e.status == 403:
                return None
            raise _refused("resourceslices", e) from e
        except urllib3.exceptions.HTTPError:
            return None  # a dropped connection or a timeout on an optional read: the checks name what is unknown
    return None


def _operator(api: client.ApiClient) -> dict | None:
    """The KubeRay operator Deployment when the pipeline may list Deployments cluster-wide; else None."""
    what = "the KubeRay operator Deployment"
    try:
        items = _items(
            client.AppsV1Api(api).list_deployment_for_all_namespaces(
                label_selector=OPERATOR_SELECTOR, _preload_content=False, _request_timeout=TIMEOUT_S
            ),
            what,
        )
    except ApiException as e:
        if e.status in (403, 404):
            return None
        raise _refused(what, e) from e
    except urllib3.exceptions.HTTPError:
        return None  # as a 403: the operator version is then "unknown", and a note says why
    return items[0] if items else None


# Any: with _preload_content=False the client returns the raw urllib3 response, though its annotations name the
# model it would have parsed (V1PodList, ...); .data is the body's bytes.
def _json(response: Any, what: str) -> dict:
    """The answer's JSON object; StageFailure(infrastructure) for anything else, so the checks only see objects."""
    try:
        body = json.loads(response.data)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise _malformed(what, f"not JSON ({e})") from None
    if not isinstance(body, dict):
        raise _malformed(what, f"a JSON {type(body).__name__}, not an object")
    return body


def _items(response: Any, what: str) -> list[dict]:
    items = _json(response, what).get("items") or []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise _malformed(what, "a List whose items are not all objects")
    return items


def _malformed(what: str, answer: str) -> StageFailure:
    return StageFailure(
        FailureClass.infrastructure,
        f"Kubernetes API answered reading {what} with {answer}: is a proxy or load balancer in the way?",
    )


def _refused(what: str, e: ApiException) -> StageFailure:
    hint = " (the service account needs deployments/rbac.yaml)" if e.status in (401, 403) else ""
    return StageFailure(
        FailureClass.infrastructure, f"Kubernetes API refused reading {what}: HTTP {e.status} {e.reason}{hint}"
    )


def unreachable(api: client.ApiClient, e: Exception) -> StageFailure:
    """An API server that did not answer (verify's reads, the canary's writes): infrastructure, naming its host."""
    return StageFailure(FailureClass.infrastructure, f"Kubernetes API at {api.configuration.host} unreachable: {e}")


# ---------------------------------------------------------------- saved files


def load_objects_from_dir(directory: str | Path) -> dict[str, Any]:
    """The same dict as fetch_cluster_objects, from files saved with kubectl / ray (see SAVED_FILES)."""
    directory = Path(directory)
    objects: dict[str, Any] = {}
    for key, (name, required) in SAVED_FILES.items():
        path = directory / name
        if not path.exists():
            if required:
                raise FileNotFoundError(
                    f'{path}: missing; save it with the command in deployments/README.md ("Verifying from saved files")'
                )
            objects[key] = None
            continue
        try:
            # decode_text: Windows PowerShell 5's `>` writes UTF-16, which read as "not UTF-8 text" though saved as told
            data = json.loads(decode_text(read_regular(path, MAX_SAVED_BYTES)))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 or UTF-16 text (byte {e.start}); save it with `-o json`") from None
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{path}: not JSON ({e}); save it with `-o json`") from None
        except ValueError:  # json's own for an integer past Python's limit for text, whose message named no file
            raise ValueError(
                f"{path}: holds an integer of over {sys.get_int_max_str_digits():,} digits, which kubectl never "
                "writes; save it again with `-o json`"
            ) from None
        except OSError as e:
            raise ValueError(f"{path}: cannot be read: {e.strerror or e}") from None
        objects[key] = _shape(path, key, data)
    clusters = objects["raycluster"]
    objects["rayclusters"], objects["raycluster"] = clusters, clusters[0] if clusters else None
    return objects


def _shape(path: Path, key: str, data: Any) -> Any:
    """kubectl writes a List for `get pods`, an object for `get raycluster NAME`; accept either where sensible,
    and refuse any other shape here, naming the file, so the checks only ever see objects."""
    if key == "ray_nodes" and isinstance(data, dict):
        return data  # the dashboard's /nodes?view=summary document, read by kube_checks.normalize_ray_nodes
    is_list = (
        isinstance(data, dict)
        and isinstance(data.get("items"), list)
        and str(data.get("kind", "List")).endswith("List")
    )
    items = data["items"] if is_list else data if isinstance(data, list) else [data]
    if not all(isinstance(item, dict) for item in items):
        raise ValueError(
            f"{path}: expected Kubernetes objects (JSON objects, or a List of them), got "
            f"{', '.join(sorted({type(i).__name__ for i in items if not isinstance(i, dict)}))}; save it with `-o json`"
        )
    if key == "operator":
        return items[0] if items else None
    if key == "raycluster":  # every cluster saved: verify judges the one the profile names (kube_checks)
        return items
    return items
