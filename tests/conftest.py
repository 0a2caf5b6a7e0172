"""Shared fixtures. Servers bind to 127.0.0.1 only, and every fixture stops what it starts.

- `ray_head`: a real local Ray head (dashboard + job API, token auth on) for the session.
- `s3_endpoint`: a real S3-compatible server (moto's server mode) on 127.0.0.1, with a bucket.
- `prefect_server`: `prefect server start` (API and UI) for the session; flows in this process report to it.
- `demo_env`: the embedded default's overrides (the session's Ray head, a tiny base model, a storage root),
  and a planted secret: a random TUNEPROOF_TEST_SECRET in this process's environment, forwarded to every
  job by name (runtime_env.forward_env), which tests/test_guard.py then looks for everywhere.
- `finished_run`: the whole pipeline run once as run id 'demo'; `clone_run`: a private copy of its storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tuneproof.app import servers
from tuneproof.app.local import RayHead, free_port, ray_env, start_ray_head
from tuneproof.app.servers import FAKE_AWS, environ, moto_server
from tuneproof.core.config import PROJECT_ROOT

# Never reach a hub from tests; fail loudly instead of hanging on a network call.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

T = TypeVar("T")
DATES = PROJECT_ROOT / "data" / "dates" / "dates.jsonl"
TEST_BUCKET = "tuneproof-test"
TEST_SERVER_WAIT_S = float(os.environ.get("TUNEPROOF_TEST_SERVER_WAIT_S", "600"))
"""How long the Prefect test server may take to answer (TUNEPROOF_TEST_SERVER_WAIT_S overrides)."""


@pytest.fixture(scope="session", autouse=True)
def no_fork_while_threads_run():
    """os.fork() of the test process while other threads run fails at once, naming them.

    Such a child copies every lock as it stood and can wait forever on one a thread held (the hang that
    stopped CI for 900 s). tests/test_layers.py finds forking calls in the source; this catches one a
    library makes on our behalf. subprocess and multiprocessing's spawn never call os.fork.
    """
    real_fork = os.fork

    def fork_alone() -> int:
        others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        if others:
            raise RuntimeError(f"os.fork() while threads run ({', '.join(others)}): spawn the process instead")
        return real_fork()

    os.fork = fork_alone
    try:
        yield
    finally:
        os.fork = real_fork


def in_thread(name: str, work: Callable[[], T]) -> Future[T]:
    """work() in a daemon thread of its own (ended with it, unlike a pool's), its result or error as a Future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class SessionStart:
    """The session's slow starts, each begun at most once (from the main thread), in a thread of its own, and
    waited for where a fixture needs it. The Ray head, the Prefect server and the tiny base model take about
    5, 12 and 42 s on 2 idle cores: one after the other, they held the session's first test back 58 s, while
    the unit tests need none of them. What was started is stopped at the session's end (`stack`)."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        tmp.getbasetemp()  # made here: the threads then each make a folder of their own prefix below it
        self.stack = contextlib.ExitStack()
        self.begun: dict[str, Future[Any]] = {}
        self.secret = os.environ.get(PLANTED_SECRET) or f"tp-planted-{secrets.token_hex(16)}"
        """The planted secret's value, in this process's environment only once the Ray head is up (demo_env)."""

    def once(self, name: str, work: Callable[[], Any]) -> Future[Any]:
        if name not in self.begun:
            self.begun[name] = in_thread(f"session-start-{name}", work)
        return self.begun[name]

    def ray_head(self) -> Future[RayHead]:
        def start() -> RayHead:
            head = start_ray_head(self.tmp.mktemp("ray-state"), num_cpus=4, dashboard_port=free_port())
            self.stack.callback(head.stop)
            return head

        return self.once("ray", start)

    def prefect_server(self) -> Future[str]:
        def start() -> str:
            # A fresh server migrates its database first: minutes on a loaded shared machine.
            # servers.prefect_server by its module: the fixture of the same name shadows a bare import.
            server = servers.prefect_server(self.tmp.mktemp("prefect-home"), wait_s=TEST_SERVER_WAIT_S)
            return self.stack.enter_context(server)

        return self.once("prefect", start)

    def base_model(self) -> Future[Path]:
        """The tiny base, built by `python -m tuneproof.app.tiny_model` in a process of its own: the build
        fixes torch's thread count, which in this process would hold for the tests running beside it."""

        def build() -> Path:
            model = self.tmp.mktemp("base-models") / "tiny-qwen2"
            command = [sys.executable, "-m", "tuneproof.app.tiny_model", str(model), "--data", str(DATES)]
            done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
            return model

        return self.once("model", build)

    def peft_env(self) -> Future[None]:
        """Ray's pip environment for a LoRA run's fine-tune jobs (runtime_env pip [peft]), built once and with its
        bytecode, beside the unit tests. Ray keys the environment by the pip list, so the LoRA pipeline's jobs
        find it. On a head that runs from a virtualenv Ray clones the whole venv, .pyc files left out, and this
        machine sets PYTHONDONTWRITEBYTECODE=1: every process of every job in it compiled torch, transformers
        and Ray Train from source again (a job importing them took 13 s there against 6 s outside), and the
        first job waited for the clone (18 s more). This job's imports write that bytecode once."""
        head = self.ray_head()

        def build() -> None:
            from ray.job_submission import JobStatus, JobSubmissionClient

            from tuneproof.core.config_train import PEFT_REQUIREMENT

            client = JobSubmissionClient(
                head.result().address, headers={"Authorization": f"Bearer {head.result().token()}"}
            )
            sid = client.submit_job(
                entrypoint=f"python -c {PEFT_IMPORTS!r}",
                runtime_env={"pip": [PEFT_REQUIREMENT], "env_vars": {"PYTHONDONTWRITEBYTECODE": ""}},
            )
            deadline = time.monotonic() + TEST_SERVER_WAIT_S
            while (status := client.get_job_status(sid)) not in (
                JobStatus.SUCCEEDED,
                JobStatus.FAILED,
                JobStatus.STOPPED,
            ):
                assert time.monotonic() < deadline, (
                    f"Ray's peft environment was not built in {TEST_SERVER_WAIT_S:.0f} s"
                )
                time.sleep(1)
            assert status == JobStatus.SUCCEEDED, client.get_job_logs(sid)[-4000:]

        return self.once("peft-env", build)

    def demo_env(self) -> Future[DemoEnv]:
        head, model = self.ray_head(), self.base_model()

        def settings() -> DemoEnv:
            root = self.tmp.mktemp("demo")
            address, token_file = head.result().address, head.result().token_file
            sets = (
                f"cluster.address={address}",
                f"cluster.auth_token_file={token_file}",
                f"storage.root={root / 'storage'}",
                f"model.source={model.result()}",
                f"runtime_env.forward_env=[{PLANTED_SECRET}]",
            )
            return DemoEnv(root, sets, self.secret)

        return self.once("demo-env", settings)

    def demo_run(self) -> Future[tuple[subprocess.Popen[bytes], Path]]:
        """The whole pipeline as run id 'demo' (about two minutes on 2 cores), started as `tuneproof run` in a
        subprocess, as a user starts it, once its servers and base model are there."""
        prefect, demo = self.prefect_server(), self.demo_env()

        def launch() -> tuple[subprocess.Popen[bytes], Path]:
            log = self.tmp.mktemp("demo-log") / "tuneproof-run.log"
            url, args = prefect.result(), demo.result().args
            env = {**os.environ, PLANTED_SECRET: self.secret, "PREFECT_API_URL": f"{url}/api"}
            env["PREFECT_UI_API_URL"] = env["PREFECT_API_URL"]
            command = [sys.executable, "-m", "tuneproof.app.cli", "run", "--run-id", "demo", *args]
            with log.open("w") as out:
                proc = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            self.stack.callback(stop_if_running, proc)  # the session ended before any test waited for it
            return proc, log

        return self.once("demo-run", launch)

    def flow_run_env(self) -> Future[tuple[str, Path, dict]]:
        """The flow-run pod's environment built and its pull steps run (tests/test_flow_run_env.py, pod_report)."""
        from tests.test_flow_run_env import pod_report

        return self.once("flow-run-env", lambda: pod_report(self.tmp.mktemp("flow-run-env")))


PEFT_IMPORTS = (
    "import ray.train.torch, torch.distributed.checkpoint, torch.distributed.fsdp, pyarrow.parquet, safetensors.torch, "
    "transformers, peft; from transformers import Qwen2ForCausalLM, AutoTokenizer; from peft import LoraConfig, get_peft_model"
)
"""What a LoRA fine-tune job's driver, Train controller and workers import: compiled once into Ray's peft environment."""


def stop_if_running(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def session_start(tmp_path_factory):
    start = SessionStart(tmp_path_factory)
    with start.stack:
        yield start
        for future in start.begun.values():  # a start still under way is stopped once it is there
            with contextlib.suppress(BaseException):
                future.result(timeout=TEST_SERVER_WAIT_S)


@pytest.fixture(scope="session")
def base_model(session_start) -> Path:
    """The tiny base `tuneproof local up` builds, built once a session in the background. A test that asks
    ensure_tiny_model for it then copies it from the cache rather than building it again beside that build
    (in CI the two ran at once: 46 s for one unit test)."""
    return session_start.base_model().result()


@pytest.fixture(scope="session")
def ray_head(session_start):
    """A Ray head on 127.0.0.1 with free ports; its token is in head.token_file."""
    return session_start.ray_head().result()


@contextlib.contextmanager
def ray_driver(head, **init_kwargs):
    """This process as a Ray driver of `head` (stage bodies then call ray.init() as a no-op)."""
    import ray
    from ray._private import ray_constants
    from ray._raylet import Config  # type: ignore[attr-defined]  # compiled; _raylet.pyi leaves it out

    with pytest.MonkeyPatch.context() as mp:
        for key, value in ray_env(head.token_file).items():
            mp.setenv(key, value)
        # Both settings are read when ray is first imported, possibly before they were in the environment.
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        Config.initialize("")
        ray.init(address=head.gcs_address, **init_kwargs)
        try:
            yield head
        finally:
            ray.shutdown()


def all_cpus_free(cpus: int = 4, timeout: float = 60.0) -> None:
    """Wait (as a driver of the head) until its `cpus` CPUs are all free: an earlier test's killed actors release
    theirs asynchronously, and a test that counts actors by the free CPUs would otherwise see fewer."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU") != cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    free = ray.available_resources().get("CPU")
    assert free == cpus, f"the head's CPUs were not all free after {timeout:.0f} s: {free} of {cpus}"


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto in server mode on 127.0.0.1; yields the endpoint URL. Credentials are fakes in env."""
    with environ(FAKE_AWS), moto_server() as url:
        import boto3

        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=TEST_BUCKET)
        yield url


def tuneproof(*args: str):
    """The command line in this process, as a user would type it (output and exit code captured)."""
    from typer.testing import CliRunner

    from tuneproof.app.cli import app

    return CliRunner().invoke(app, list(args))


def run_job_module(module: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m <module>` from the project root, as a Ray job's entrypoint runs, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="session")
def prefect_server(session_start):
    """`prefect server start` (API + UI) on 127.0.0.1 with its own home; this process's flows report to it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_API_URL, temporary_settings

    url = session_start.prefect_server().result()
    with temporary_settings({PREFECT_API_URL: f"{url}/api", PREFECT_UI_API_URL: f"{url}/api"}):
        yield url
        # Ship the last logs and events while the server is still there; a worker left holding
        # items for a stopped server makes every later drain (e.g. a test harness's) wait on it.
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all()
        EventsWorker.drain_all()


@pytest.fixture
def prefect_harness(prefect_server):
    """What a test whose flows need a Prefect API asks for: the session's server. A module's own
    `prefect_test_harness` cost a server start per module (tens of seconds on 2 cores), and while it was the
    innermost Prefect setting, a session fixture first made then (the demo run, the session server) reported
    to it and outlived it."""
    return prefect_server


@dataclass(frozen=True)
class DemoEnv:
    """The embedded default pointed at the session's Ray head, a tiny base model and a storage root."""

    root: Path
    sets: tuple[str, ...]
    """`dotted.key=value` overrides every run of the session's demo passes."""
    secret: str = ""
    """The planted secret's value: in the environment of every run, and in nothing a run publishes."""

    @property
    def storage(self):
        from tuneproof.core.storage import Storage

        return Storage(str(self.root / "storage"))

    @property
    def args(self) -> list[str]:
        return sum((["--set", s] for s in self.sets), [])

    def at(self, root: Path) -> DemoEnv:
        """The same settings over another storage root (a clone's)."""
        sets = tuple(f"storage.root={root / 'storage'}" if s.startswith("storage.root=") else s for s in self.sets)
        return DemoEnv(root, sets, self.secret)


PLANTED_SECRET = "TUNEPROOF_TEST_SECRET"


@pytest.fixture(scope="session")
def demo_env(session_start) -> DemoEnv:
    env = session_start.demo_env().result()
    # Set once the Ray head started, so a job can only have it by forwarding, not from the raylet's env.
    os.environ.setdefault(PLANTED_SECRET, env.secret)
    return env


@pytest.fixture(scope="session")
def demo_run_started(session_start, prefect_server):
    """The demo run's process and log, left to train while other tests run (`start_shared_run`)."""
    return session_start.demo_run().result()


@pytest.fixture(scope="session", autouse=True)
def start_shared_run(request, session_start):
    """Begin the shared demo run at the session's start when a collected test needs it, without waiting: in a
    plain `pytest` the unit tests run first (pytest_collection_modifyitems) and leave a core idle (under `make
    test` they run in a process of their own beside this one, tests/run_tiers.sh), which the base model's build,
    the servers' starts and then the run's stages fill (a second shared run beside it, the LoRA pipeline's,
    gained nothing: 1191 s of `make test` against 1185 s).

    The run holds at most 2 of the session head's 4 CPUs; in file order its first readers (test_continue,
    test_copy_check) wait for it to end before any test that wants all 4 (test_sharding) starts."""
    if any("lora_demo" in item.fixturenames for item in request.session.items):
        session_start.peft_env()
    if any("finished_run" in item.fixturenames for item in request.session.items):
        session_start.demo_run()
        # Its readers run the CLI in this process against the session's server, as they did when the run
        # started here: so this process's Prefect settings name it from the first test on (about 12 s).
        request.getfixturevalue("prefect_server")


FLOW_RUN_ENV_TEST = "test_the_pull_step_builds_a_flow_run_environment_that_imports_the_flow"
"""The test whose venv build `start_background_builds` begins early (renamed, the build runs in its own turn)."""


@pytest.fixture(autouse=True)
def start_background_builds(request, session_start):
    """At the first integration test, begin the flow-run environment's build (when its test was collected):
    the integration tests leave about a quarter of the 2 cores idle, the unit tests before them none."""
    if request.node.get_closest_marker("integration") and any(
        item.name == FLOW_RUN_ENV_TEST for item in request.session.items
    ):
        session_start.flow_run_env()


@pytest.fixture(scope="session")
def finished_run(demo_run_started, demo_env, tmp_path_factory):
    """The whole demo run, finished (it exited 0), shared by the session.

    Its storage root is copied as it stood when the run finished; tests that change a run take a
    copy of that (`clone_run`) so that no test sees another's changes.
    """
    from tuneproof.control import record as records

    proc, log = demo_run_started
    assert proc.wait(timeout=1800) == 0, log.read_text()[-8000:]
    pristine = tmp_path_factory.mktemp("demo-pristine")
    shutil.copytree(demo_env.root / "storage", pristine / "storage", symlinks=True)
    return FinishedRun(records.load(demo_env.storage, "demo"), pristine)


@dataclass(frozen=True)
class FinishedRun:
    record: Any
    """The run record as the run left it (a RunRecord)."""
    pristine: Path
    """A copy of the storage root taken when the run finished."""


@pytest.fixture
def clone_run(finished_run, demo_env, tmp_path) -> DemoEnv:
    """A private copy of the finished demo run's storage root, as it stood when the run finished.

    Records name checkpoints and exports by absolute URI; in the copy they name the copy's files, so a
    test that reruns a stage on its clone never reads (or depends on) the shared run's files."""
    clone = tmp_path / "storage"
    shutil.copytree(finished_run.pristine / "storage", clone, symlinks=True)
    original = str(demo_env.storage.root)
    for path in clone.rglob("*.json"):
        text = path.read_text()
        if original in text:
            path.write_text(text.replace(original, str(clone)))
    return demo_env.at(tmp_path)


SERVER_FIXTURES = frozenset({"ray_head", "s3_endpoint", "prefect_server"})
"""The session's servers. A test that needs one (directly or through another fixture) is an integration test: in
the unit tier's process it would start a Ray head, moto or a Prefect server of its own beside the integration run's."""


def unmarked_server_tests(items) -> list[str]:
    """The tests that ask for a session server without the integration (or browser) marker, each with what it
    asks for. item.fixturenames is the whole closure, so a server reached through another fixture counts."""
    return [
        f"{item.nodeid} (needs {', '.join(sorted(SERVER_FIXTURES & set(item.fixturenames)))})"
        for item in items
        if SERVER_FIXTURES & set(item.fixturenames)
        and not any(item.get_closest_marker(m) for m in ("integration", "browser"))
    ]


def pytest_collection_modifyitems(config, items):
    """Fault-injection tests (marker `faults`, about ten minutes) run only when `-m` names them
    (`make faults`, `pytest -m faults`): the default run deselects them, it does not skip them.

    A test that needs a session server but is not marked integration is refused before anything runs: a marker
    lost in an edit once put two Ray Train fine-tunes (80 s) into the unit tier, with a Ray head and moto of its own."""
    if misfiled := unmarked_server_tests(items):
        raise pytest.UsageError(
            "mark these tests integration (they need a session server):\n  " + "\n  ".join(misfiled)
        )
    # Unit tests first (a stable sort keeps each group's order): the shared demo run trains beside them.
    items.sort(key=lambda item: any(item.get_closest_marker(m) for m in ("integration", "browser")))
    if "faults" in (config.getoption("markexpr") or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("faults") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker("faults") is None]


def machine_yardstick() -> str:
    """This machine's speed now, in one line: a run's minutes mean little without it. The same code took 1,156 s
    of pytest on one day's 2 cores and 1,789 s on another's (b3901b1, whose every test file was 1.2 to 1.6 times
    slower, gpu_check's dry run as much as the Ray tests), when sha256 ran at 1.5 and then 0.7 GB/s."""
    data = bytes(128 << 20)

    def hash_data() -> None:
        hashlib.sha256(data).digest()

    began = time.perf_counter()
    hash_data()
    one = 128 / 1024 / (time.perf_counter() - began)
    # Two at once (hashlib lets go of the GIL): what the suite uses, which a host's neighbours can take away.
    pair = [threading.Thread(target=hash_data) for _ in range(2)]
    began = time.perf_counter()
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join()
    two = 256 / 1024 / (time.perf_counter() - began)
    began = time.perf_counter()
    total = 0
    for i in range(5_000_000):
        total += i
    loop = time.perf_counter() - began
    return f"sha256 {one:.2f} GB/s on one core, {two:.2f} on two; a Python loop of 5M adds {loop:.2f} s"


def pytest_sessionstart(session):
    session.config.stash[YARDSTICK] = machine_yardstick()


YARDSTICK = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The yardstick at the session's start and end, beside the durations (README: test time)."""
    start = config.stash.get(YARDSTICK, None)
    if start is not None:
        terminalreporter.write_line(f"machine yardstick: at the start {start}; at the end {machine_yardstick()}")
