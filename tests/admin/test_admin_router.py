"""`/admin/*`: who may change what serves, which changes are refused, and the audit trail."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from app.db import session_scope
from app.http.state import app_state
from app.models import (
    Alert,
    ApiKey,
    AuditEntry,
    Checkpoint,
    CheckpointStatus,
    ControlFlag,
    Experiment,
    ExperimentStatus,
    Role,
    TrainingRun,
    TrainingRunStatus,
)
from app.registry import flags
from app.registry.audit import Actor
from app.registry.experiments import start_canary
from app.registry.routing import ROUTING_CHANNEL
from tests.analytics.app_fixtures import bearer


def error_of(response: Any, status: int) -> dict[str, Any]:
    """The error body, in the gateway's shape, of a response with this status."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def statuses(engine: Engine) -> dict[str, str]:
    with session_scope(engine) as session:
        return {c.name: c.status.value for c in session.scalars(select(Checkpoint))}


def audit_log(engine: Engine) -> list[AuditEntry]:
    with session_scope(engine) as session:
        entries = list(session.scalars(select(AuditEntry).order_by(AuditEntry.id)))
        session.expunge_all()
    return entries


def canary_experiment(canary: str = "ckpt-1", **overrides: Any) -> dict[str, Any]:
    return {
        "name": f"{canary}-vs-base",
        "arms": [
            {"name": "control", "checkpoint": "base", "weight_bps": 9_000, "is_control": True},
            {"name": "treatment", "checkpoint": canary, "weight_bps": 1_000},
        ],
        **overrides,
    }


def test_roles_decide_who_reaches_admin_and_analytics(
    client: TestClient,
    make_key: Callable[..., str],
    add_checkpoint: Callable[..., None],
    registry: Engine,
) -> None:
    add_checkpoint("ckpt-1")
    ide, analyst, ops = make_key(Role.ide), make_key(Role.analyst), make_key(Role.ops)

    for path in ("/admin/checkpoints", "/analytics/experiments"):
        assert error_of(client.get(path, headers=bearer(ide)), 403)["code"] == "insufficient_role"
        assert error_of(client.get(path), 401)["type"] == "authentication_error"
        error_of(client.get(path, headers=bearer("rtrl_not-a-key")), 401)
    assert client.get("/analytics/experiments", headers=bearer(analyst)).status_code == 200
    error_of(client.get("/admin/checkpoints", headers=bearer(analyst)), 403)
    error_of(client.post("/admin/checkpoints/ckpt-1/promote", headers=bearer(analyst)), 403)
    assert statuses(registry)["ckpt-1"] == "candidate"

    promoted = client.post("/admin/checkpoints/ckpt-1/promote", headers=bearer(ops))
    assert promoted.status_code == 200, promoted.text
    assert client.get("/analytics/experiments", headers=bearer(ops)).status_code == 403


def test_a_revoked_key_gets_401(
    client: TestClient, make_key: Callable[..., str], ops_key: str
) -> None:
    analyst = make_key(Role.analyst)
    assert client.get("/analytics/experiments", headers=bearer(analyst)).status_code == 200
    key_id = next(
        key["id"]
        for key in client.get("/admin/api-keys", headers=bearer(ops_key)).json()
        if key["role"] == "analyst"
    )

    revoked = client.post(f"/admin/api-keys/{key_id}/revoke", headers=bearer(ops_key))

    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["after"]["revoked_at"] is not None
    error_of(client.get("/analytics/experiments", headers=bearer(analyst)), 401)
    assert (
        error_of(client.post(f"/admin/api-keys/{key_id}/revoke", headers=bearer(ops_key)), 409)[
            "code"
        ]
        == "api_key_revoked"
    )


def test_a_new_key_shows_its_secret_once_and_stores_only_its_hash(
    client: TestClient, ops_key: str, registry: Engine
) -> None:
    created = client.post(
        "/admin/api-keys",
        json={"name": "alice-laptop", "role": "ide", "rate_limit_per_minute": 120},
        headers=bearer(ops_key),
    )

    assert created.status_code == 201, created.text
    secret = created.json()["secret"]
    assert secret.startswith("rtrl_") and created.json()["role"] == "ide"
    with session_scope(registry) as session:
        row = session.scalar(select(ApiKey).where(ApiKey.name == "alice-laptop"))
        assert row is not None
        assert row.key_hash == hashlib.sha256(secret.encode()).hexdigest()
        assert secret not in (row.key_prefix, row.key_hash)
        assert row.created_by is not None and row.created_by.startswith("ops-")
    listed = client.get("/admin/api-keys", headers=bearer(ops_key)).json()
    assert all("secret" not in key for key in listed)
    assert client.get("/v1/models", headers=bearer(secret)).status_code == 200
    entry = audit_log(registry)[-1]
    assert entry.action == "api_key.create" and secret not in str(entry.after)
    error_of(
        client.post("/admin/api-keys", json={"name": "x", "role": "root"}, headers=bearer(ops_key)),
        400,
    )


def test_promote_then_roll_back_twice_walks_back_through_productions(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1")
    add_checkpoint("ckpt-2", parent="ckpt-1")
    headers = bearer(ops_key)

    assert client.post("/admin/checkpoints/ckpt-1/promote", headers=headers).status_code == 200
    assert statuses(registry) == {"base": "retired", "ckpt-1": "production", "ckpt-2": "candidate"}
    promoted = client.post(
        "/admin/checkpoints/ckpt-2/promote", json={"reason": "won the canary"}, headers=headers
    )
    assert promoted.status_code == 200, promoted.text
    assert statuses(registry) == {"base": "retired", "ckpt-1": "retired", "ckpt-2": "production"}

    back = client.post("/admin/rollback", json={"reason": "complaints"}, headers=headers)
    assert back.status_code == 200, back.text
    assert statuses(registry) == {
        "base": "retired",
        "ckpt-1": "production",
        "ckpt-2": "rolled_back",
    }
    back_again = client.post("/admin/checkpoints/ckpt-1/rollback", headers=headers)
    assert back_again.status_code == 200, back_again.text
    assert statuses(registry) == {
        "base": "production",
        "ckpt-1": "rolled_back",
        "ckpt-2": "rolled_back",
    }

    assert error_of(client.post("/admin/rollback", headers=headers), 409)["code"] == (
        "no_previous_production"
    )
    for name in ("ckpt-1", "ckpt-2"):
        refused = error_of(client.post(f"/admin/checkpoints/{name}/promote", headers=headers), 409)
        assert refused["code"] == "not_promotable" and "rolled_back" in refused["message"]
    assert error_of(client.post("/admin/checkpoints/base/promote", headers=headers), 409)[
        "code"
    ] == ("already_production")
    error_of(client.post("/admin/checkpoints/ckpt-9/promote", headers=headers), 404)

    entries = [e for e in audit_log(registry) if e.action.startswith("checkpoint.")]
    assert [(e.action, e.target) for e in entries] == [
        ("checkpoint.promote", "checkpoint:ckpt-1"),
        ("checkpoint.promote", "checkpoint:ckpt-2"),
        ("checkpoint.rollback", "checkpoint:ckpt-2"),
        ("checkpoint.rollback", "checkpoint:ckpt-1"),
    ]
    assert all(e.actor.startswith("ops-") and e.actor_key_id is not None for e in entries)
    assert entries[1].before == {
        "production": "ckpt-1",
        "checkpoint": {"name": "ckpt-2", "status": "candidate"},
    }
    assert entries[1].after == {
        "production": "ckpt-2",
        "retired": "ckpt-1",
        "stopped_experiments": [],
        "reason": "won the canary",
    }
    assert entries[2].before == {
        "production": "ckpt-2",
        "restores": {"name": "ckpt-1", "status": "retired"},
    }
    assert entries[2].after is not None and entries[2].after["production"] == "ckpt-1"
    assert (
        promoted.json()["id"] == entries[1].id and promoted.json()["action"] == "checkpoint.promote"
    )


def test_a_checkpoint_the_monitors_alerted_on_is_not_promoted_without_an_override(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1")
    now = datetime.now(UTC)
    with Session(registry) as session, session.begin():
        session.add(
            Alert(
                checkpoint="ckpt-1",
                control_checkpoint="base",
                metric="clarifying_question_rate",
                canary_value=0.31,
                control_value=0.12,
                threshold=0.05,
                window_start=now - timedelta(hours=1),
                window_end=now,
            )
        )

    refused = error_of(
        client.post("/admin/checkpoints/ckpt-1/promote", headers=bearer(ops_key)), 409
    )
    assert refused["code"] == "monitor_alerts"
    assert "clarifying_question_rate 0.31 vs base 0.12" in refused["message"]
    assert statuses(registry)["ckpt-1"] == "candidate"

    forced = client.post(
        "/admin/checkpoints/ckpt-1/promote",
        json={"reason": "questions were the right call here", "override_alerts": True},
        headers=bearer(ops_key),
    )
    assert forced.status_code == 200, forced.text
    assert forced.json()["after"]["overridden_alerts"]
    assert statuses(registry)["ckpt-1"] == "production"


def test_a_retired_checkpoint_cannot_be_promoted_or_served_by_a_new_experiment(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None]
) -> None:
    add_checkpoint("ckpt-1", status=CheckpointStatus.retired)

    error_of(client.post("/admin/checkpoints/ckpt-1/promote", headers=bearer(ops_key)), 409)
    refused = error_of(
        client.post("/admin/experiments", json=canary_experiment(), headers=bearer(ops_key)), 409
    )
    assert refused["code"] == "checkpoint_not_live" and "ckpt-1 is retired" in refused["message"]


@pytest.mark.parametrize(
    ("change", "code", "param"),
    [
        (
            {
                "arms": [
                    {
                        "name": "control",
                        "checkpoint": "base",
                        "weight_bps": 9_000,
                        "is_control": True,
                    },
                    {"name": "treatment", "checkpoint": "ckpt-1", "weight_bps": 500},
                ]
            },
            "weights_do_not_sum_to_10000",
            "weights",
        ),
        (
            {
                "arms": [
                    {"name": "a", "checkpoint": "base", "weight_bps": 5_000},
                    {"name": "b", "checkpoint": "ckpt-1", "weight_bps": 5_000},
                ]
            },
            "one_control_arm",
            "arms",
        ),
        (
            {
                "arms": [
                    {
                        "name": "control",
                        "checkpoint": "base",
                        "weight_bps": 5_000,
                        "is_control": True,
                    },
                    {"name": "treatment", "checkpoint": "ckpt-404", "weight_bps": 5_000},
                ]
            },
            "checkpoint_not_found",
            "arms.1.checkpoint",
        ),
    ],
)
def test_invalid_experiments_are_refused_with_422(
    client: TestClient,
    ops_key: str,
    add_checkpoint: Callable[..., None],
    change: dict[str, Any],
    code: str,
    param: str,
) -> None:
    add_checkpoint("ckpt-1")
    error = error_of(
        client.post(
            "/admin/experiments", json=canary_experiment(**change), headers=bearer(ops_key)
        ),
        422,
    )
    assert (error["code"], error["param"]) == (code, param)


def test_experiments_start_ramp_and_stop_one_running_per_route(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1")
    add_checkpoint("ckpt-2")
    headers = bearer(ops_key)
    first = client.post("/admin/experiments", json=canary_experiment(start=True), headers=headers)
    assert first.status_code == 201, first.text
    first_id = first.json()["id"]
    assert first.json()["status"] == "running"
    assert statuses(registry)["ckpt-1"] == "canary"
    second = client.post("/admin/experiments", json=canary_experiment("ckpt-2"), headers=headers)
    assert second.status_code == 201 and second.json()["status"] == "draft"
    second_id = second.json()["id"]

    busy = error_of(client.post(f"/admin/experiments/{second_id}/start", headers=headers), 409)
    assert busy["code"] == "route_has_running_experiment" and str(first_id) in busy["message"]
    error_of(
        client.post(
            f"/admin/experiments/{first_id}/ramp",
            json={"weights": {"control": 5_000, "treatment": 4_000}},
            headers=headers,
        ),
        422,
    )
    unknown = error_of(
        client.post(
            f"/admin/experiments/{first_id}/ramp",
            json={"weights": {"control": 5_000, "canary": 5_000}},
            headers=headers,
        ),
        422,
    )
    assert unknown["code"] == "arms_mismatch"
    ramped = client.post(
        f"/admin/experiments/{first_id}/ramp",
        json={"weights": {"control": 5_000, "treatment": 5_000}},
        headers=headers,
    )
    assert ramped.status_code == 200, ramped.text
    assert [arm["weight_bps"] for arm in ramped.json()["before"]["arms"]] == [9_000, 1_000]
    assert [arm["weight_bps"] for arm in ramped.json()["after"]["arms"]] == [5_000, 5_000]
    assert client.post(f"/admin/experiments/{first_id}/stop", headers=headers).status_code == 200
    error_of(client.post(f"/admin/experiments/{first_id}/stop", headers=headers), 409)
    started = client.post(f"/admin/experiments/{second_id}/start", headers=headers)
    assert started.status_code == 200, started.text
    error_of(client.post("/admin/experiments/999999/start", headers=headers), 404)
    error_of(
        client.post("/admin/experiments", json=canary_experiment("ckpt-2"), headers=headers), 409
    )

    actions = [e.action for e in audit_log(registry) if e.target.startswith("experiment:")]
    assert actions == [
        "experiment.create",
        "experiment.start",
        "experiment.create",
        "experiment.ramp",
        "experiment.stop",
        "experiment.start",
    ]


def test_rolling_back_a_canary_stops_its_experiment(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1")
    created = client.post(
        "/admin/experiments", json=canary_experiment(start=True), headers=bearer(ops_key)
    ).json()

    rolled = client.post(
        "/admin/checkpoints/ckpt-1/rollback", json={"reason": "bad"}, headers=bearer(ops_key)
    )

    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["after"]["stopped_experiments"] == [created["id"]]
    assert statuses(registry) == {"base": "production", "ckpt-1": "rolled_back"}
    with session_scope(registry) as session:
        experiment = session.get(Experiment, created["id"])
        assert experiment is not None and experiment.status == ExperimentStatus.stopped
    error_of(client.post("/admin/checkpoints/ckpt-1/rollback", headers=bearer(ops_key)), 409)


def test_promoting_the_canary_ends_its_experiment(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1")
    created = client.post(
        "/admin/experiments", json=canary_experiment(start=True), headers=bearer(ops_key)
    ).json()

    promoted = client.post("/admin/checkpoints/ckpt-1/promote", headers=bearer(ops_key))

    assert promoted.json()["after"]["stopped_experiments"] == [created["id"]]
    assert statuses(registry) == {"base": "retired", "ckpt-1": "production"}


def test_a_checkpoint_shows_its_lineage_runs_and_experiments(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1")
    add_checkpoint("ckpt-2", parent="ckpt-1")
    with session_scope(registry) as session:
        ids = {c.name: c.id for c in session.scalars(select(Checkpoint))}
        session.add(
            TrainingRun(
                status=TrainingRunStatus.published,
                config={"lr": 1e-5},
                stats={"loss": 0.5},
                base_checkpoint_id=ids["ckpt-1"],
                output_checkpoint_id=ids["ckpt-2"],
                sample_count=512,
                run_name="cycle-2",
            )
        )
    client.post("/admin/experiments", json=canary_experiment("ckpt-2"), headers=bearer(ops_key))

    detail = client.get("/admin/checkpoints/ckpt-2", headers=bearer(ops_key)).json()

    assert [c["name"] for c in detail["lineage"]] == ["ckpt-2", "ckpt-1", "base"]
    assert detail["parent"] == "ckpt-1"
    assert [run["run_name"] for run in detail["produced_by"]] == ["cycle-2"]
    assert detail["produced_by"][0]["sample_count"] == 512
    assert [e["name"] for e in detail["experiments"]] == ["ckpt-2-vs-base"]
    listed = client.get("/admin/checkpoints?status=candidate", headers=bearer(ops_key)).json()
    assert [c["name"] for c in listed] == ["ckpt-2", "ckpt-1"]
    error_of(client.get("/admin/checkpoints/ckpt-404", headers=bearer(ops_key)), 404)
    error_of(client.get("/admin/checkpoints?status=gone", headers=bearer(ops_key)), 400)


def start_trainer_canary(engine: Engine, name: str) -> None:
    """What a training cycle does once it has published `name`: a 10% canary vs production."""
    with session_scope(engine) as session:
        control = session.scalars(select(Checkpoint).where(Checkpoint.name == "base")).one()
        treatment = session.scalars(select(Checkpoint).where(Checkpoint.name == name)).one()
        start_canary(
            session,
            control=control,
            treatment=treatment,
            treatment_bps=1000,
            created_by="trainer run 1",
            actor=Actor("trainer"),
        )


def test_a_newer_candidate_of_the_same_parent_supersedes_the_running_canary(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1")
    add_checkpoint("ckpt-2")
    start_trainer_canary(registry, "ckpt-1")
    start_trainer_canary(registry, "ckpt-2")

    older = client.get("/admin/checkpoints/ckpt-1", headers=bearer(ops_key)).json()
    assert (older["status"], older["superseded_by"]) == ("retired", "ckpt-2")
    assert [e["status"] for e in older["experiments"]] == ["stopped"]
    trail = {e["action"]: e for e in older["audit"]}
    assert set(trail) == {"experiment.start", "experiment.stop", "checkpoint.retire"}
    assert {e["actor"] for e in older["audit"]} == {"trainer"}
    assert trail["experiment.stop"]["after"]["reason"] == "superseded by ckpt-2"
    assert trail["checkpoint.retire"]["after"] == {
        "name": "ckpt-1",
        "status": "retired",
        "superseded_by": "ckpt-2",
        "reason": "superseded by ckpt-2",
    }
    newer = client.get("/admin/checkpoints/ckpt-2", headers=bearer(ops_key)).json()
    assert (newer["status"], newer["superseded_by"]) == ("canary", None)
    assert [e["status"] for e in newer["experiments"]] == ["running"]


def test_a_canary_of_another_parent_is_stopped_but_not_retired(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1")
    add_checkpoint("ckpt-2", parent="ckpt-1")
    start_trainer_canary(registry, "ckpt-2")
    start_trainer_canary(registry, "ckpt-1")

    other = client.get("/admin/checkpoints/ckpt-2", headers=bearer(ops_key)).json()
    assert (other["status"], other["superseded_by"]) == ("canary", None)
    assert [e["status"] for e in other["experiments"]] == ["stopped"]
    stop = next(e for e in other["audit"] if e["action"] == "experiment.stop")
    assert stop["after"]["reason"] == "superseded by ckpt-1"


def test_training_pause_resume_and_cycle_requests_set_the_trainers_flags(
    client: TestClient, ops_key: str, registry: Engine
) -> None:
    headers = bearer(ops_key)

    assert (
        client.post(
            "/admin/training/pause", json={"reason": "incident"}, headers=headers
        ).status_code
        == 200
    )
    state = client.get("/admin/training", headers=headers).json()
    assert (state["paused"], state["next_cycle_at"]) == (True, None)
    assert error_of(client.post("/admin/training/cycle", headers=headers), 409)["code"] == (
        "training_paused"
    )
    assert client.post("/admin/training/resume", headers=headers).status_code == 200
    assert client.post("/admin/training/cycle", headers=headers).status_code == 200

    with session_scope(registry) as session:
        stored = {f.name: f.value for f in session.scalars(select(ControlFlag))}
    assert stored == {flags.TRAINING_PAUSED: False, flags.CYCLE_REQUESTED: True}
    entries = client.get("/admin/audit?limit=3", headers=headers).json()
    assert [e["action"] for e in entries] == ["training.cycle", "training.resume", "training.pause"]
    assert entries[2]["before"] == {"paused": False}
    assert entries[2]["after"] == {"paused": True, "reason": "incident"}


def test_a_routing_change_is_announced_to_the_gateways(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None]
) -> None:
    add_checkpoint("ckpt-1")
    listener = redis.Redis.from_url(app_state(client.app).settings.redis_url).pubsub()
    listener.subscribe(ROUTING_CHANNEL)
    try:
        assert listener.get_message(timeout=2)["type"] == "subscribe"
        client.post("/admin/checkpoints/ckpt-1/promote", headers=bearer(ops_key))
        message = listener.get_message(timeout=5)
        assert message is not None and message["channel"] == ROUTING_CHANNEL.encode()
    finally:
        listener.close()


def test_a_checkpoint_no_replica_can_load_is_not_promoted(
    client: TestClient, ops_key: str, add_checkpoint: Callable[..., None], registry: Engine
) -> None:
    add_checkpoint("ckpt-1", adapter_path="/nowhere/ckpt-1")

    error = error_of(client.post("/admin/checkpoints/ckpt-1/promote", headers=bearer(ops_key)), 503)

    assert error["code"] == "replica_unavailable" and "nothing changed" in error["message"]
    assert statuses(registry) == {"base": "production", "ckpt-1": "candidate"}
    assert [e.action for e in audit_log(registry)] == []
