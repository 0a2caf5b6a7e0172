"""Per-row Python work of a job spread over the cluster's CPUs with Ray: results in task order.

    workers = ray_workers(len(tasks))                      # the cluster's free CPUs inside a Ray job, else 1
    for result in map_in_order(work, tasks, shared, workers): ...   # work(shared, task), in task order

The data stage's rendering, label masking and tokenizing is plain Python per row and holds the GIL, so
threads do not help; processes do. Inside a Ray job those processes are Ray actors, the tool a reader
expects there: one per CPU the cluster has free, each given `shared` (the tokenizer, the config) once
through the object store, then fed tasks that carry their own rows: a row sent to every actor costs
rows x actors (8 actors on 400,000 rows: 45 s against 32 s). Nothing is forked: a fork of a process
that holds threads (a Ray driver, a tokenizer's Rust pool, an S3 client) can copy a lock that some
thread held and leave the child waiting on it forever. Outside a Ray job (a unit test, a laptop
script), or with one task, the work runs in this process.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

MAX_ACTORS = 64
"""An upper bound on the pool: past it the per-actor copy of `shared` costs more than another CPU gives."""


def map_in_order(
    work: Callable[[Any, Any], Any], tasks: Iterable[Any], shared: Any, workers: int
) -> Generator[Any, None, None]:
    """work(shared, task) for each task, in task order: on `workers` Ray actors when that is more than one.

    Results are yielded in order as they come, so the caller can turn each into its own form and let
    the worker's go; an exception a task raises is raised here, at that task's place.
    """
    tasks = list(tasks)
    actors = min(workers, len(tasks))
    if actors < 2:
        yield from (work(shared, task) for task in tasks)
        return
    import ray
    from ray.util import ActorPool

    handle = ray.remote(num_cpus=1)(_Worker)
    shared_ref = ray.put(shared)
    pool: list[Any] = [handle.remote(work, shared_ref) for _ in range(actors)]
    try:
        yield from ActorPool(pool).map(lambda actor, task: actor.run.remote(task), tasks)
    finally:
        for actor in pool:  # a consumer that stops early must not leave actors holding the cluster's CPUs
            ray.kill(actor)


def ray_workers(tasks: int) -> int:
    """How many actors `tasks` tasks should get: the cluster's free CPUs inside a Ray job (on a one-node cluster
    no more than the cores this process may use); 1 outside one."""
    if tasks < 2:
        return 1
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return 1
    import ray

    if not ray.is_initialized():
        if "RAY_ADDRESS" not in os.environ:  # set by Ray for a job's entrypoint: not a Ray job
            return 1
        ray.init(log_to_driver=False)
    free = int(ray.available_resources().get("CPU", 0))
    if len([node for node in ray.nodes() if node.get("Alive")]) == 1:
        # One machine (a laptop's head, which `tuneproof local up` gives 4 logical CPUs on 2 cores so that a
        # Train run's controller and driver fit): past its cores, actors only take turns on them. 8 actors
        # on 2 cores encoded 400,000 rows in 32 s, 2 in 25 s.
        free = min(free, usable_cores())
    return max(1, min(tasks, MAX_ACTORS, free))


def usable_cores() -> int:
    """The cores this process may run on (its affinity on Linux; os.cpu_count() where there is none, as on macOS)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


class _Worker:
    """One Ray actor: `shared` arrives once (Ray resolves the object reference), each task is one call."""

    def __init__(self, work: Callable[[Any, Any], Any], shared: Any) -> None:
        self.work, self.shared = work, shared
        # Each actor is one of the job's CPUs already: the tokenizer's own Rust threads would only
        # contend with the other actors for the same cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        gc.disable()  # as in the driver (collector_paused): the rows are acyclic, reference counting frees them

    def run(self, task: Any) -> Any:
        return self.work(self.shared, task)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block.

    Parsing, rendering and tokenizing a corpus allocate millions of small acyclic containers (rows,
    token lists) that reference counting frees; the collector finds nothing among them, yet each of its
    passes walks them all: a quarter of the data stage's CPU time on 100,000 rows. Whatever cycles the
    block does make (jinja's rendering) wait for the collector's next pass after it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
