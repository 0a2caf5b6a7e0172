"""Per-row Python work of a job spread over the CPUs the job may use: forked worker processes, results in order.

    for result in fork_map(work, tasks, shared, workers): ...   # work(shared, task) for each task, in task order

The data stage's rendering, label masking and tokenizing is plain Python per row and holds the GIL, so
threads do not help; processes do. Workers are forked, not spawned: they inherit `shared` (the
tokenizer, the config, the rows) instead of importing transformers and loading the tokenizer again,
and only the tasks (small descriptors) and the results cross a pipe. Linux only, which is where Ray
jobs run; where fork is unavailable, or one worker is all there is, the work runs in this process.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

_shared: Any = None
"""What a forked worker inherits: set for the pool's lifetime only."""
_work: Callable[[Any, Any], Any] | None = None
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container's or Ray's CPU pinning narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def fork_map(
    work: Callable[[Any, Any], Any], tasks: Iterable[Any], shared: Any, workers: int
) -> Generator[Any, None, None]:
    """work(shared, task) for each task, in task order, on `workers` forked processes when that is more than one.

    Results are yielded as they come in order, so the caller can turn each into its own form and let
    the worker's go; an exception a task raises is raised here, at that task's place, as Pool.imap does.
    """
    tasks = list(tasks)
    workers = min(workers, len(tasks))
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        yield from (work(shared, task) for task in tasks)
        return
    global _shared, _work
    _shared, _work = shared, work
    # Objects that exist at fork time are never collected by the workers: a collection would write to
    # every object's header and copy the whole parent heap into each worker, page by page.
    gc.freeze()
    # Each worker is one of the job's CPUs already: the tokenizer's own Rust threads would only contend
    # with the other workers for the same cores (set before the fork, the workers also skip the
    # tokenizers library's warning about a fork after its threads were used).
    parallelism = os.environ.get(TOKENIZERS_PARALLELISM)
    os.environ[TOKENIZERS_PARALLELISM] = "false"
    try:
        with _forked_with_default_sigterm():
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_default_sigterm)
        with pool:
            yield from pool.imap(_run, tasks)
    finally:
        _shared, _work = None, None
        gc.unfreeze()
        if parallelism is None:
            os.environ.pop(TOKENIZERS_PARALLELISM, None)
        else:
            os.environ[TOKENIZERS_PARALLELISM] = parallelism


# The pool ends its workers with SIGTERM (on leaving the `with`, after the last result or on an error).
# A worker that inherited a Python-level SIGTERM handler (the CLI's, which raises, or any that returns)
# does not die of it while it sleeps, waits on a lock or prints the handler's traceback past a lock a
# thread of the parent held at fork time: the pool's join then waits forever. The workers therefore
# take SIGTERM's default, fatal action: forked under it where this runs on the main thread (so even a
# worker wedged before it runs any Python dies), and set it again as each worker starts.


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block.

    Parsing, rendering and tokenizing a corpus allocate millions of small acyclic containers (rows,
    token lists) that reference counting frees; the collector finds nothing among them, yet each of its
    passes walks them all: a quarter of the data stage's CPU time on 100,000 rows. Forked workers
    inherit the setting. Whatever cycles the block does make (jinja's rendering) wait for the
    collector's next pass after it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def _forked_with_default_sigterm() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change a handler; the workers' initializer still applies
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler set outside Python, which cannot be put back from here
            signal.signal(signal.SIGTERM, previous)


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run(task: Any) -> Any:
    assert _work is not None, "fork_map's work is set before its pool forks"
    return _work(_shared, task)
