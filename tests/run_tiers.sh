#!/usr/bin/env bash
# `make test`: the unit tests in a pytest process of their own, beside the integration tests; then both reports.
#
#   tests/run_tiers.sh PYTHON [PYTEST OPTIONS...]
#
# Why two processes: the integration tests wait on Ray jobs (process starts, status polls, Ray Train's worker
# polls) and leave about a quarter of 2 cores idle (README: "Where the test time goes"), while the unit tests, run first in the
# same process, kept both cores busy for their few minutes. Beside each other, the unit tests fill that idle time.
# The integration run prints its progress as it goes; the unit run's report follows it. The exit status is 0 only
# when both runs passed.
set -uo pipefail

python=${1:?usage: tests/run_tiers.sh PYTHON [PYTEST OPTIONS...]}
shift
unit_log=$(mktemp -t tuneproof-unit-tests.XXXXXX)
# At a lower priority: the integration run is the longer one, so its processes (pytest, Ray's jobs and workers)
# keep the cores when both want them, and the unit tests take what the integration tests leave idle.
# Its own cache folder: two runs writing one .pytest_cache would each overwrite the other's record of what failed
# (`pytest --lf -o cache_dir=.pytest_cache/unit` reruns the unit tests that failed).
# One torch thread: at nice 10 on busy cores, a second OpenMP thread spins waiting for the first while it is
# descheduled. tests/test_evaluate_job.py beside two busy cores took 410 s and 58.8 CPU-s with torch's default two
# threads, 248 s and 23.1 CPU-s with one: the spinning was CPU the integration run could have used.
OMP_NUM_THREADS=1 nice -n 10 "$python" -m pytest -q "$@" -m "not integration and not browser" -o cache_dir=.pytest_cache/unit \
    >"$unit_log" 2>&1 &
unit=$!
echo "the unit tests run beside the integration tests; their report follows this run's (as it goes: tail -f $unit_log)"
# A background job of a script ignores Ctrl-C: stop it with the script, however the script ends.
trap 'kill "$unit" 2>/dev/null; rm -f "$unit_log"' EXIT
trap 'exit 130' INT TERM

"$python" -m pytest -q "$@" -m "integration or browser"
integration=$?
wait "$unit"
units=$?
echo
echo "---- the unit tests, run beside the integration tests (pytest exit status $units) ----"
cat "$unit_log"
echo "make test: integration tests exit status $integration, unit tests $units"
[ "$integration" -eq 0 ] && [ "$units" -eq 0 ]
