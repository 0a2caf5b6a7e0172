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
