"""The rollback flow as its Prefect form sends it: a cleared optional field arrives as "", not as nothing.

.venv/bin/python -m pytest -q tests/test_rollback_form.py
"""

from __future__ import annotations

import logging

import pytest

import flows.rollback as flow
from tasks import promote as promote_tasks
from tests.reading import production_pointer
from tests.test_history import config, promote_two


@pytest.mark.parametrize("cleared", ["", "   "])
def test_an_emptied_to_version_goes_back_to_the_version_production_replaced(tmp_path, monkeypatch, cleared):
    # The field says "empty: the version production replaced", and "" was refused as an empty version name.
    # The flow's body runs here without a Prefect server: the task's own function, no flow-run creator, a logger.
    monkeypatch.setattr(flow, "rollback_task", promote_tasks.rollback.fn)
    monkeypatch.setattr(flow, "flow_run_creator", lambda run_id: None)
    monkeypatch.setattr(flow, "get_run_logger", lambda: logging.getLogger("test"))
    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)
    state = flow.rollback.fn(
        model=cfg.model.name, reason="v2 regressed", by="oncall", to_version=cleared, storage=cfg.storage
    )
    assert state.is_completed() and state.message == f"{cfg.model.name} production is {v1}", state.message
    assert production_pointer(storage, cfg.model.name).version == v1
