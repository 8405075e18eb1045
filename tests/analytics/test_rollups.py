"""The rollups follow the raw data: late samples and rewards finalized later are counted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, Engine, text

from app.abtest.rollups import REFRESH_LOCK, bucket_of, latency_quantile, refresh_rollups
from rtrl.embedded.stack import EmbeddedStack
from tests.analytics.conftest import Behaviour, SeededArm

Seeder = Callable[..., tuple[int, pd.DataFrame]]


def arm_metrics(client: TestClient, experiment_id: int, headers: dict[str, Any]) -> dict[str, Any]:
    body = client.get(f"/analytics/experiments/{experiment_id}/results", headers=headers).json()
    return {arm["arm"]: arm for arm in body["arms"]}


def add_late_sample(conn: Connection, experiment_id: int) -> None:
    """A copy of the experiment's first treatment sample, by a user new to it."""
    conn.execute(
        text(
            "INSERT INTO samples (event_id, request_id, session_id, user_hash, checkpoint, "
            "experiment_id, arm, privacy, trainable, edit_requested, proposed_edit, status, "
            "ttft_ms, latency_ms, served_at) SELECT gen_random_uuid(), 'late-' || id, "
            "session_id, 'a-new-user', checkpoint, experiment_id, arm, privacy, trainable, "
            "edit_requested, proposed_edit, status, ttft_ms, latency_ms, served_at "
            "FROM samples WHERE experiment_id = :e AND arm = 'treatment' ORDER BY id LIMIT 1"
        ),
        {"e": experiment_id},
    )


def test_late_samples_and_late_final_rewards_reach_the_results(
    client: TestClient, seeder: Seeder, app_engine: Engine, analyst_headers: dict[str, Any]
) -> None:
    experiment_id, rows = seeder(
        [
            SeededArm(
                "control",
                "late-a",
                5_000,
                Behaviour(users=20, requests_per_user=2),
                is_control=True,
            ),
            SeededArm("treatment", "late-b", 5_000, Behaviour(users=20, requests_per_user=2)),
        ],
        seed=41,
    )
    assert refresh_rollups(app_engine)
    before = arm_metrics(client, experiment_id, analyst_headers)["treatment"]
    assert before["requests"] == 40

    with app_engine.begin() as conn:
        # A sample replayed from a gateway's spool into an hour already rolled up ...
        add_late_sample(conn, experiment_id)
        # ... and one whose reward was open becomes final later, with everything kept.
        conn.execute(
            text(
                "UPDATE rewards SET components = jsonb_set(components, '{kept}', '1.0'), "
                "updated_at = now() WHERE sample_id = (SELECT min(id) FROM samples "
                "WHERE experiment_id = :e AND arm = 'treatment')"
            ),
            {"e": experiment_id},
        )
    rebuilt = refresh_rollups(app_engine)

    after = arm_metrics(client, experiment_id, analyst_headers)["treatment"]
    assert rebuilt is not None and rebuilt >= 1
    assert after["requests"] == 41 and after["users"] == 21
    kept = rows[rows.arm == "treatment"].kept.tolist()
    kept[0] = 1.0
    # The late sample has no reward: kept is still over the 40 final rewards.
    assert after["metrics"]["kept"]["observations"] == 40
    assert after["metrics"]["kept"]["value"] == pytest.approx(sum(kept) / 40)


def test_edits_whose_fate_was_never_seen_are_counted_censored_per_arm_and_checkpoint(
    client: TestClient, seeder: Seeder, app_engine: Engine, analyst_headers: dict[str, Any]
) -> None:
    experiment_id, _ = seeder(
        [
            SeededArm("control", "cens-a", 5_000, Behaviour(users=10, requests_per_user=2), True),
            SeededArm("treatment", "cens-b", 5_000, Behaviour(users=10, requests_per_user=2)),
        ],
        seed=43,
    )
    assert refresh_rollups(app_engine)
    rate = arm_metrics(client, experiment_id, analyst_headers)["treatment"]["metrics"][
        "censored_edit_rate"
    ]
    assert (rate["value"], rate["observations"]) == (0.0, 20)  # every seeded edit has a verdict

    with app_engine.begin() as conn:
        # Three of the treatment's edits were never shown their verdict: censored.
        conn.execute(
            text(
                "UPDATE rewards SET components = jsonb_set(components, '{kept}', 'null'), "
                "updated_at = now() WHERE sample_id IN (SELECT id FROM samples "
                "WHERE experiment_id = :e AND arm = 'treatment' ORDER BY id LIMIT 3)"
            ),
            {"e": experiment_id},
        )
    assert refresh_rollups(app_engine)

    arms = arm_metrics(client, experiment_id, analyst_headers)
    treated, control = arms["treatment"]["metrics"], arms["control"]["metrics"]
    assert treated["censored_edit_rate"]["value"] == pytest.approx(3 / 20)
    assert treated["kept"]["observations"] == 17  # a censored edit is not a kept share
    assert control["censored_edit_rate"]["value"] == 0.0
    assert treated["censored_edit_rate"]["vs_control"]["difference"] == pytest.approx(3 / 20)
    series = client.get(
        "/analytics/timeseries?bucket=day&checkpoint=cens-b", headers=analyst_headers
    ).json()["series"]
    (buckets,) = [s["buckets"] for s in series if s["checkpoint"] == "cens-b"]
    assert sum(b["edit_observations"] for b in buckets) == 20
    censored = sum(b["censored_edit_rate"] * b["edit_observations"] for b in buckets)
    assert censored == pytest.approx(3)


def test_a_transaction_open_in_another_database_does_not_hold_the_results_back(
    client: TestClient,
    seeder: Seeder,
    app_engine: Engine,
    stack: EmbeddedStack,
    analyst_headers: dict[str, Any],
) -> None:
    experiment_id, _ = seeder(
        [
            SeededArm("control", "other-a", 5_000, Behaviour(users=5), is_control=True),
            SeededArm("treatment", "other-b", 5_000, Behaviour(users=5)),
        ],
        seed=43,
    )
    refresh_rollups(app_engine)
    other_database = f"postgresql://postgres@127.0.0.1:{stack.postgres.port}/postgres"
    with psycopg.connect(other_database) as other:
        other.execute("SELECT pg_current_xact_id()")  # a writing transaction, left open
        with app_engine.begin() as conn:
            add_late_sample(conn, experiment_id)
        refresh_rollups(app_engine)

        after = arm_metrics(client, experiment_id, analyst_headers)["treatment"]
        assert after["users"] == 6


def test_a_refresh_already_running_elsewhere_is_not_repeated(app_engine: Engine) -> None:
    with app_engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), REFRESH_LOCK)
        assert refresh_rollups(app_engine) is None


def test_histogram_quantiles_interpolate_within_a_bucket() -> None:
    histogram = [(bucket_of(100.0), 50), (bucket_of(200.0), 50)]
    assert latency_quantile(histogram, 0.25) == pytest.approx(100.0, rel=0.02)
    assert latency_quantile(histogram, 0.75) == pytest.approx(200.0, rel=0.02)
    assert latency_quantile([], 0.5) is None
    assert bucket_of(0.2) == 0 and latency_quantile([(0, 10)], 0.5) == pytest.approx(1.01, rel=0.01)
