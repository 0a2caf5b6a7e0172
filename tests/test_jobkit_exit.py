"""A job process ends without Python's module teardown, but like any exit: running threads finish, exit
handlers run, buffered output reaches the log, and the exit code is the stage's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tuneproof.core.config import PROJECT_ROOT

JOB = """
import atexit, sys, threading, time
from pathlib import Path
from training.jobkit import exit_now

out = Path(sys.argv[1])
def late_writer():
    time.sleep(0.3)
    (out / "thread.txt").write_text("finished")
threading.Thread(target=late_writer).start()
atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
sys.stdout.write("last line without a newline")
exit_now(int(sys.argv[2]))
print("never reached")
"""


def run_job(tmp_path: Path, code: int) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(code)],
        cwd=PROJECT_ROOT,
        env={"PYTHONPATH": str(PROJECT_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_job_exit_waits_for_threads_runs_exit_handlers_and_keeps_its_output(tmp_path):
    done = run_job(tmp_path, 1)
    assert done.returncode == 1, done.stderr
    assert done.stdout == "last line without a newline"
    assert (tmp_path / "thread.txt").read_text() == "finished"
    assert (tmp_path / "atexit.txt").read_text() == "ran"


def test_a_succeeded_job_exits_zero(tmp_path):
    assert run_job(tmp_path, 0).returncode == 0
