"""training/parallel.py: Ray actors give what one process gives, in order, and leave no actor behind."""

from __future__ import annotations

import gc
import os

import pytest

from tests.conftest import all_cpus_free, ray_driver
from training import parallel


def square_plus(shared: dict[str, int], task: int) -> tuple[int, int]:
    if task == shared["fails_at"]:
        raise ValueError(f"task {task} refused")
    return task * task + shared["offset"], os.getpid()


def test_one_worker_runs_the_tasks_here():
    results = list(parallel.map_in_order(square_plus, [3, 4], {"offset": 0, "fails_at": -1}, workers=1))
    assert results == [(9, os.getpid()), (16, os.getpid())]


def test_outside_a_ray_job_there_is_one_worker(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert parallel.ray_workers(100) == 1  # and no Ray cluster was started to find that out
    assert parallel.ray_workers(1) == 1


@pytest.mark.integration
def test_results_come_back_in_task_order_from_ray_actors_and_a_failure_raises_at_its_place(ray_head):

    with ray_driver(ray_head):
        all_cpus_free()
        workers = parallel.ray_workers(40)
        # The head's 4 logical CPUs, as far as this machine has cores: past them actors only take turns.
        assert workers == min(4, parallel.usable_cores()) and workers >= 2
        results = list(parallel.map_in_order(square_plus, range(40), {"offset": 1, "fails_at": -1}, workers))
        assert [value for value, _ in results] == [t * t + 1 for t in range(40)]
        assert os.getpid() not in {pid for _, pid in results}  # the work ran in the actors

        seen = []
        with pytest.raises(ValueError, match="task 5 refused"):
            for value, _ in parallel.map_in_order(square_plus, range(10), {"offset": 0, "fails_at": 5}, workers):
                seen.append(value)
        assert seen == [0, 1, 4, 9, 16]
        # Every actor was killed: the cluster's CPUs come free again for the next stage (Ray frees them async).
        all_cpus_free()


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


def test_the_core_count_needs_no_linux_only_call(monkeypatch):
    """A laptop's head on macOS has no os.sched_getaffinity: the pool's cap falls back to os.cpu_count()."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert parallel.usable_cores() == 3
