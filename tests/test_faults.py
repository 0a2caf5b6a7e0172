"""Issue 11's fault rows as tests: each scenario of faults/f_*.py injects its fault into a real run.

    pytest -m faults tests/test_faults.py        (or `make faults` for the table; about ten minutes)

Deselected from the default run (tests/conftest.py). One lab (Ray head, Prefect server, tiny model) and
one reference run serve every row of the module.
"""

from __future__ import annotations

import pytest

from faults.__main__ import discover
from faults.harness import SCENARIOS, lab, ordered

pytestmark = [pytest.mark.faults, pytest.mark.integration]
discover()


@pytest.fixture(scope="module")
def the_lab(tmp_path_factory):
    with lab(tmp_path_factory.mktemp("faults")) as started:
        yield started


@pytest.mark.parametrize("name", [sc.name for sc in ordered()])
def test_fault(name, the_lab):
    row = SCENARIOS[name].run(the_lab)
    print(row.model_dump_json(indent=1))
    assert row.outcome in ("survived", "failed-as-expected"), row.model_dump_json(indent=1)
