"""Makes this interpreter's imports fail as they would on the lent GPU machine (tests/test_gpu_check.py).

On PYTHONPATH, Python imports this file at start-up. Every top-level package named in TUNEPROOF_HIDE
(comma-separated) is then not found by any import finder, as a package that machine lacks is not, even
though this project's environment has it: `import ray` raises ModuleNotFoundError, and
importlib.util.find_spec("boto3") answers None (libraries probe optional packages that way).
"""

from __future__ import annotations

import os
import sys

HIDDEN = frozenset(name for name in os.environ.get("TUNEPROOF_HIDE", "").split(",") if name)


class Hiding:
    """One of the interpreter's finders, blind to the hidden packages."""

    def __init__(self, finder) -> None:
        self.finder = finder

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(fullname, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Hiding(finder) for finder in sys.meta_path]
