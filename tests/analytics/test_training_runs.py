"""`/analytics/training-runs`: each run's outcome and serving/training drift, for the dashboard."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fastapi.testclient import TestClient
from sqlalchemy import Engine

from app.db import session_scope
from app.models import (
    Checkpoint,
    CheckpointStatus,
    CycleTrigger,
    Role,
    TrainingRun,
    TrainingRunStatus,
)
from tests.analytics.app_fixtures import bearer


def test_training_runs_show_their_drift_newest_first(
    client: TestClient, app_engine: Engine, make_key: Callable[..., str]
) -> None:
    parent = f"runs-{uuid.uuid4().hex[:8]}"
    with session_scope(app_engine) as session:
        base = Checkpoint(name=parent, status=CheckpointStatus.retired, base_model="tiny")
        session.add(base)
        session.flush()
        common = {"config": {}, "base_checkpoint_id": base.id, "trigger": CycleTrigger.schedule}
        published = TrainingRun(
            status=TrainingRunStatus.published,
            sample_count=256,
            stats={
                "dtype": "bf16",
                "ranks": 2,
                "drift_tokens": 4316,
                "drift_mean_abs": 0.012,
                "drift_max_abs": 1.9,
                "drift_kl": 0.0021,
                "drift_capped_share": 0.004,
            },
            **common,
        )
        refused = TrainingRun(
            status=TrainingRunStatus.refused,
            reason="serving/training drift over 900 tokens: KL(vLLM || trainer) per token 4.8",
            sample_count=64,
            stats={"dtype": "bf16", "ranks": 1, "drift_kl": 4.8},
            **common,
        )
        session.add_all([published, refused])
        session.flush()
        ids = (published.id, refused.id)

    response = client.get("/analytics/training-runs", headers=bearer(make_key(Role.analyst)))

    assert response.status_code == 200
    runs = {run["id"]: run for run in response.json()}
    assert list(runs)[:2] == [ids[1], ids[0]]
    assert runs[ids[0]]["drift_kl"] == 0.0021 and runs[ids[0]]["ranks"] == 2
    assert runs[ids[0]]["base_checkpoint"] == parent and runs[ids[0]]["trigger"] == "schedule"
    assert runs[ids[1]]["status"] == "refused" and runs[ids[1]]["drift_mean_abs"] is None
    assert (
        client.get("/analytics/training-runs", headers=bearer(make_key(Role.ide))).status_code
        == 403
    )
