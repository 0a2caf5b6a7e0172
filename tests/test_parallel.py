"""training/parallel.py: forked workers give what one process gives, in order, and leave nothing changed."""

from __future__ import annotations

import gc
import os

import pytest

from training import parallel


def square_plus(shared: dict[str, int], task: int) -> tuple[int, int]:
    if task == shared["fails_at"]:
        raise ValueError(f"task {task} refused")
    return task * task + shared["offset"], os.getpid()


def test_results_come_back_in_task_order_from_more_than_one_process():
    shared = {"offset": 1, "fails_at": -1}
    results = list(parallel.fork_map(square_plus, range(40), shared, workers=2))
    assert [value for value, _ in results] == [t * t + 1 for t in range(40)]
    assert os.getpid() not in {pid for _, pid in results}  # the work ran in the workers, on what they inherited


def test_one_worker_runs_the_tasks_here():
    results = list(parallel.fork_map(square_plus, [3, 4], {"offset": 0, "fails_at": -1}, workers=1))
    assert results == [(9, os.getpid()), (16, os.getpid())]


def test_a_failing_task_raises_at_its_place_and_the_parent_is_left_as_it_was(monkeypatch):
    monkeypatch.setenv(parallel.TOKENIZERS_PARALLELISM, "true")
    seen = []
    with pytest.raises(ValueError, match="task 5 refused"):
        for value, _ in parallel.fork_map(square_plus, range(10), {"offset": 0, "fails_at": 5}, workers=2):
            seen.append(value)
    assert seen == [0, 1, 4, 9, 16]
    assert os.environ[parallel.TOKENIZERS_PARALLELISM] == "true" and gc.get_freeze_count() == 0
    assert parallel._shared is None and parallel._work is None


def test_usable_cpus_is_at_least_one():
    assert parallel.usable_cpus() >= 1


# Run in a child interpreter: a regression hangs forever on the pool's join, which only SIGKILL (the
# timeout's) can end, and the no-op SIGTERM handler must not stay installed in the test process.
WEDGED_WORKER = """
import signal, sys, threading, time
from training import parallel

def slow(shared, task):
    if task == 1:
        time.sleep(600)  # one worker busy with a long task when the consumer stops
    return task

def consume():
    for value in parallel.fork_map(slow, range(4), None, workers=2):
        break  # the generator closes here: the pool must end its workers, the sleeping one too

handler = lambda signum, frame: None  # a handler that returns: SIGTERM alone would not end a worker
signal.signal(signal.SIGTERM, handler)
start = time.monotonic()
if sys.argv[1] == "main":
    consume()
else:
    thread = threading.Thread(target=consume)
    thread.start()
    thread.join()
print(round(time.monotonic() - start, 2), signal.getsignal(signal.SIGTERM) is handler)
"""


@pytest.mark.parametrize("where", ["main", "thread"])
def test_the_workers_end_when_the_consumer_stops_even_under_a_sigterm_handler_that_returns(where):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", WEDGED_WORKER, where], capture_output=True, text=True, timeout=60, check=True
    )
    seconds, restored = done.stdout.split()
    assert float(seconds) < 30 and restored == "True"  # ended (not after the 600 s task), handler put back


def test_the_collector_is_off_inside_and_as_it_was_after_even_on_an_error():
    assert gc.isenabled()
    with pytest.raises(ValueError), parallel.collector_paused():
        assert not gc.isenabled()
        raise ValueError("the block failed")
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with parallel.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_forked_workers_inherit_the_paused_collector():
    with parallel.collector_paused():
        assert list(parallel.fork_map(collector_state, range(4), None, workers=2)) == [False] * 4


def collector_state(shared, task) -> bool:
    return gc.isenabled()
