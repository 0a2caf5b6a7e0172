"""fetch_cluster_objects with the real `kubernetes` client over real HTTP.

A small API server on 127.0.0.1 (a thread, stopped after each test) serves the saved objects in
tests/fixtures/k8s/cluster/ (built from deployments/raycluster.yaml) at the Kubernetes API's own
paths; a kubeconfig written to tmp_path points the client at it with a bearer token.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from tests.test_kube_checks import efa_slice
from tuneproof.control.kube import fetch_cluster_objects, load_objects_from_dir
from tuneproof.control.kube_checks import check_cluster
from tuneproof.core.config import PROJECT_ROOT, load_config
from tuneproof.core.config_cluster import KubernetesConfig
from tuneproof.core.findings import errors
from tuneproof.core.results import FailureClass, StageFailure

FIXTURE = Path(__file__).parent / "fixtures" / "k8s" / "cluster"
TOKEN = "test-token-not-a-secret"
EFA_SLICE_NODES = ("ip-10-0-2-20.us-west-2.compute.internal", "ip-10-0-2-21.us-west-2.compute.internal")


class FakeApi:
    """What the server answers: objects by API path, plus per-path status overrides."""

    def __init__(self):
        saved = load_objects_from_dir(FIXTURE)
        self.raycluster = saved["raycluster"]
        self.pods = saved["pods"]
        self.nodes = saved["nodes"]
        self.slices: list[dict] | None = []  # None: the resource.k8s.io API is not served (404)
        self.operator = saved["operator"]
        self.status: dict[str, int] = {}  # path -> forced HTTP status
        self.body: dict[str, object] = {}  # path -> a 200 answer served as it is (a proxy's page)
        self.dropped: set[str] = set()  # paths whose connection closes without an answer
        self.requests: list[tuple[str, dict, str | None]] = []

    def answer(self, path: str, query: dict) -> tuple[int, dict]:
        if path in self.status:
            return self.status[path], _status(self.status[path], path)
        if path in self.body:
            return 200, self.body[path]  # type: ignore[return-value]
        routes = {
            "/apis/ray.io/v1/namespaces/tuneproof/rayclusters/tuneproof": lambda: self.raycluster,
            "/api/v1/namespaces/tuneproof/pods": lambda: _list("PodList", _select(self.pods, query)),
            "/api/v1/nodes": lambda: _list("NodeList", self.nodes),
            "/apis/resource.k8s.io/v1/resourceslices": lambda: (
                None if self.slices is None else _list("ResourceSliceList", self.slices)
            ),
            "/apis/apps/v1/deployments": lambda: _list("DeploymentList", _select([self.operator], query)),
        }
        body = routes[path]() if path in routes else None
        return (200, body) if body is not None else (404, _status(404, path))

    def write(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        """The read-only API of the verify stage: no writes."""
        return 405, _status(405, path)


def _list(kind: str, items: list[dict]) -> dict:
    return {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}


def _select(objects: list[dict], query: dict) -> list[dict]:
    """Equality label selectors, as the API server applies them."""
    wanted = dict(term.split("=", 1) for term in query.get("labelSelector", [""])[0].split(",") if term)
    return [o for o in objects if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]


def _status(code: int, path: str) -> dict:
    reason = {403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed", 409: "AlreadyExists"}.get(
        code, "InternalError"
    )
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": reason,
        "code": code,
        "message": f"{reason}: {path}",
    }


@pytest.fixture
def api(tmp_path):
    """(FakeApi, kubeconfig path); the server listens on a free 127.0.0.1 port until the test ends."""
    with serve(FakeApi(), tmp_path) as served:
        yield served


@contextmanager
def serve(fake: FakeApi, tmp_path: Path):
    """Serve `fake` (GET through fake.answer; POST and DELETE through fake.write) on a free 127.0.0.1 port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.reply("GET")

        def do_POST(self):
            self.reply("POST")

        def do_DELETE(self):
            self.reply("DELETE")

        def reply(self, method: str):
            url = urlparse(self.path)
            query = parse_qs(url.query)
            length = int(self.headers.get("Content-Length") or 0)
            sent = json.loads(self.rfile.read(length) or b"null") if length else None
            fake.requests.append((url.path, query, self.headers.get("Authorization")))
            if url.path in fake.dropped:
                self.close_connection = True
                return
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                code, body = 401, _status(401, url.path)
            elif method == "GET":
                code, body = fake.answer(url.path, query)
            else:
                code, body = fake.write(method, url.path, sent)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(kubeconfig_for(f"http://127.0.0.1:{server.server_address[1]}")))
    try:
        yield fake, kubeconfig
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def kubeconfig_for(server: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {"token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "tuneproof"}}],
    }


def kcfg(kubeconfig: Path) -> KubernetesConfig:
    return KubernetesConfig(namespace="tuneproof", raycluster="tuneproof", kubeconfig=str(kubeconfig))


def eks():
    return load_config(PROJECT_ROOT / "configs" / "eks.yaml")


def test_fetch_and_check_a_healthy_cluster(api):
    fake, kubeconfig = api
    objects = fetch_cluster_objects(kcfg(kubeconfig))
    assert objects["raycluster"]["metadata"]["name"] == "tuneproof"
    assert [p["metadata"]["name"] for p in objects["pods"]] == [p["metadata"]["name"] for p in fake.pods]
    assert len(objects["nodes"]) == 3 and objects["resourceslices"] == [] and objects["ray_nodes"] is None
    assert objects["operator"]["metadata"]["name"] == "kuberay-operator"
    # The client sent the kubeconfig's token and the RayCluster's label selector.
    assert {auth for _, _, auth in fake.requests} == {f"Bearer {TOKEN}"}
    pods_query = next(q for path, q, _ in fake.requests if path.endswith("/pods"))
    assert pods_query["labelSelector"] == ["ray.io/cluster=tuneproof"]
    findings = check_cluster(objects, eks())
    assert errors(findings) == []
    assert [f.seen for f in findings if f.severity == "info"] == ["v1.6.0"]


def test_different_digest_served_live_is_named(api):
    fake, kubeconfig = api
    fake.pods[1]["status"]["containerStatuses"][0]["imageID"] = "ray-train@sha256:" + "c" * 64
    finding = errors(check_cluster(fetch_cluster_objects(kcfg(kubeconfig)), eks()))
    assert [(f.subject, f.seen) for f in finding] == [
        ("pod tuneproof-gpu-worker-4qj8n", "ray-train@sha256:" + "c" * 64)
    ]


def test_resourceslice_api_not_served(api):
    fake, kubeconfig = api
    fake.slices = None
    objects = fetch_cluster_objects(kcfg(kubeconfig))
    assert objects["resourceslices"] is None
    tried = [path for path, _, _ in fake.requests if "resource.k8s.io" in path]
    assert tried == [f"/apis/resource.k8s.io/{v}/resourceslices" for v in ("v1", "v1beta2", "v1beta1")]
    assert errors(check_cluster(objects, eks())) == []  # the device plugin still shows EFA


def test_efa_published_only_by_the_dra_driver(api):
    fake, kubeconfig = api
    for node in fake.nodes:
        node["status"]["allocatable"].pop("vpc.amazonaws.com/efa", None)
    fake.slices = [efa_slice(n) for n in EFA_SLICE_NODES]
    assert errors(check_cluster(fetch_cluster_objects(kcfg(kubeconfig)), eks())) == []
    fake.slices = None
    findings = errors(check_cluster(fetch_cluster_objects(kcfg(kubeconfig)), eks()))
    assert {f.subject for f in findings} == {f"node {n}" for n in EFA_SLICE_NODES}


def test_missing_raycluster_and_unreadable_operator(api):
    fake, kubeconfig = api
    fake.raycluster = None
    fake.status["/apis/apps/v1/deployments"] = 403
    objects = fetch_cluster_objects(kcfg(kubeconfig))
    assert objects["raycluster"] is None and objects["operator"] is None
    finding = errors(check_cluster(objects, eks()))[0]
    assert (finding.subject, finding.field) == ("RayCluster tuneproof/tuneproof", "metadata.name")


def test_forbidden_pods_is_an_infrastructure_failure(api):
    fake, kubeconfig = api
    fake.status["/api/v1/namespaces/tuneproof/pods"] = 403
    with pytest.raises(StageFailure) as caught:
        fetch_cluster_objects(kcfg(kubeconfig))
    assert caught.value.failure_class is FailureClass.infrastructure
    assert "HTTP 403" in caught.value.cause and "rbac.yaml" in caught.value.cause


def test_unreachable_api_server_is_an_infrastructure_failure(tmp_path):
    # Bind a port, then close it: nothing listens there while the client tries.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(kubeconfig_for(f"http://127.0.0.1:{port}")))
    with pytest.raises(StageFailure, match="unreachable") as caught:
        fetch_cluster_objects(kcfg(kubeconfig))
    assert f"127.0.0.1:{port}" in caught.value.cause


def test_missing_kubeconfig_names_the_path(tmp_path):
    with pytest.raises(StageFailure, match="no Kubernetes credentials") as caught:
        fetch_cluster_objects(kcfg(tmp_path / "absent-kubeconfig"))
    assert "absent-kubeconfig" in caught.value.cause


def test_a_dropped_connection_on_an_optional_read_leaves_it_unknown(api):
    # It raised urllib3's MaxRetryError out of the stage: only refusals (403/404) were expected there.
    fake, kubeconfig = api
    fake.dropped = {"/apis/resource.k8s.io/v1/resourceslices", "/apis/apps/v1/deployments"}
    objects = fetch_cluster_objects(kcfg(kubeconfig))
    assert objects["resourceslices"] is None and objects["operator"] is None
    assert len(objects["nodes"]) == 3
    note = next(f for f in check_cluster(objects, eks()) if f.severity == "info")
    assert (note.seen, note.message) == ("unknown", "from no annotation and no readable operator Deployment")


@pytest.mark.parametrize("body", ["<html>502 Bad Gateway</html>", ["a", "list"], {"items": "none"}])
def test_an_answer_that_is_not_an_object_is_an_infrastructure_failure(api, body):
    # It raised AttributeError ('str' object has no attribute 'get') from a required read.
    fake, kubeconfig = api
    fake.body["/api/v1/nodes"] = body
    with pytest.raises(StageFailure, match=r"Kubernetes API answered reading nodes with") as caught:
        fetch_cluster_objects(kcfg(kubeconfig))
    assert caught.value.failure_class is FailureClass.infrastructure
