"""`/analytics/*` results: differences, intervals and p-values checked against scipy/numpy
computed here from the raw seeded rows, the sample-ratio check, trends, exports, filters."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient
from scipy import stats
from sqlalchemy import Engine

from app.abtest.rollups import refresh_rollups
from tests.analytics.conftest import DAYS, Behaviour, SeededArm, day_zero

Seeder = Callable[..., tuple[int, pd.DataFrame]]


@pytest.fixture(scope="module")
def known_effect(seeder: Seeder, app_engine: Engine) -> tuple[int, pd.DataFrame]:
    """50/50: the treatment is accepted more (0.46 vs 0.40) and is 20% slower."""
    seeded = seeder(
        [
            SeededArm("control", "base-ke", 5_000, Behaviour(users=400), is_control=True),
            SeededArm(
                "treatment",
                "ckpt-ke",
                5_000,
                Behaviour(users=400, accept=0.46, latency_median_ms=720.0),
            ),
        ],
        seed=11,
    )
    refresh_rollups(app_engine)
    return seeded


def agresti_caffo(x1: int, n1: int, x2: int, n2: int) -> tuple[float, float, float]:
    """Interval and two-sided p-value of p1 - p2, by the textbook formula."""
    p1, p2 = (x1 + 1) / (n1 + 2), (x2 + 1) / (n2 + 2)
    se = np.sqrt(p1 * (1 - p1) / (n1 + 2) + p2 * (1 - p2) / (n2 + 2))
    z = stats.norm.ppf(0.975)
    return p1 - p2 - z * se, p1 - p2 + z * se, 2 * stats.norm.sf(abs(p1 - p2) / se)


def results(client: TestClient, experiment_id: int, headers: dict[str, Any], **params: str) -> Any:
    response = client.get(
        f"/analytics/experiments/{experiment_id}/results", params=params, headers=headers
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_differences_intervals_and_p_values_match_an_independent_computation(
    client: TestClient, known_effect: tuple[int, pd.DataFrame], analyst_headers: dict[str, Any]
) -> None:
    experiment_id, rows = known_effect
    body = results(client, experiment_id, analyst_headers)
    arms = {arm["arm"]: arm for arm in body["arms"]}
    control, treatment = rows[rows.arm == "control"], rows[rows.arm == "treatment"]
    assert body["control_arm"] == "control"
    assert arms["treatment"]["requests"] == len(treatment)
    assert arms["treatment"]["users"] == treatment.user_hash.nunique() == 400

    # Proportions: the acceptance effect is there, the dissatisfied rate does not differ.
    for metric, treated, baseline in [
        ("acceptance_rate", treatment.accepted, control.accepted),
        ("dissatisfied_rate", treatment.dissatisfied.dropna(), control.dissatisfied.dropna()),
        ("error_rate", treatment.status == "error", control.status == "error"),
    ]:
        x1, n1, x2, n2 = int(treated.sum()), len(treated), int(baseline.sum()), len(baseline)
        low, high, p = agresti_caffo(x1, n1, x2, n2)
        got = arms["treatment"]["metrics"][metric]
        assert got["value"] == pytest.approx(x1 / n1)
        assert got["observations"] == n1
        vs = got["vs_control"]
        assert vs["difference"] == pytest.approx(x1 / n1 - x2 / n2)
        assert vs["relative_difference"] == pytest.approx((x1 / n1 - x2 / n2) / (x2 / n2))
        assert (vs["ci_low"], vs["ci_high"]) == (pytest.approx(low), pytest.approx(high))
        assert vs["p_value"] == pytest.approx(p, rel=1e-6)
        assert arms["control"]["metrics"][metric]["vs_control"] is None
    acceptance = arms["treatment"]["metrics"]["acceptance_rate"]["vs_control"]
    assert acceptance["significant"] and acceptance["p_value"] < 0.01
    assert not arms["treatment"]["metrics"]["dissatisfied_rate"]["vs_control"]["significant"]

    # Means: Welch's t-test on the raw rows.
    for metric, column in [
        ("kept", "kept"),
        ("mean_reward", "reward"),
        ("latency_mean_ms", "latency_ms"),
    ]:
        welch = stats.ttest_ind(treatment[column], control[column], equal_var=False)
        interval = welch.confidence_interval(0.95)
        vs = arms["treatment"]["metrics"][metric]["vs_control"]
        assert arms["treatment"]["metrics"][metric]["value"] == pytest.approx(
            treatment[column].mean()
        )
        assert vs["difference"] == pytest.approx(treatment[column].mean() - control[column].mean())
        assert vs["p_value"] == pytest.approx(welch.pvalue, rel=1e-6, abs=1e-12)
        assert vs["ci_low"] == pytest.approx(interval.low, rel=1e-6)
        assert vs["ci_high"] == pytest.approx(interval.high, rel=1e-6)

    # Percentiles come from 2%-wide histogram buckets: within 1% of numpy's.
    for metric, q in [("latency_p50_ms", 50), ("latency_p95_ms", 95), ("latency_p99_ms", 99)]:
        for arm, frame in [("control", control), ("treatment", treatment)]:
            exact = np.percentile(frame.latency_ms, q)
            assert arms[arm]["metrics"][metric]["value"] == pytest.approx(exact, rel=0.01)
    p50 = arms["treatment"]["metrics"]["latency_p50_ms"]["vs_control"]
    true_shift = np.percentile(treatment.latency_ms, 50) - np.percentile(control.latency_ms, 50)
    assert p50["significant"] and p50["ci_low"] < true_shift < p50["ci_high"]

    users = [control.user_hash.nunique(), treatment.user_hash.nunique()]
    expected = stats.chisquare(users, [sum(users) / 2] * 2)
    assert body["sample_ratio"]["p_value"] == pytest.approx(expected.pvalue)
    assert body["sample_ratio"]["mismatch"] is False


def test_a_sample_ratio_mismatch_is_flagged(
    client: TestClient, seeder: Seeder, app_engine: Engine, analyst_headers: dict[str, Any]
) -> None:
    # Configured 50/50, but the treatment lost a quarter of its users (e.g. a crash on first use).
    experiment_id, _ = seeder(
        [
            SeededArm(
                "control",
                "base-srm",
                5_000,
                Behaviour(users=400, requests_per_user=2),
                is_control=True,
            ),
            SeededArm("treatment", "ckpt-srm", 5_000, Behaviour(users=300, requests_per_user=2)),
        ],
        seed=12,
    )
    refresh_rollups(app_engine)

    check = results(client, experiment_id, analyst_headers)["sample_ratio"]

    expected = stats.chisquare([400, 300], [350, 350])
    assert check["mismatch"] is True and check["threshold"] == 0.001
    assert check["p_value"] == pytest.approx(expected.pvalue)
    assert check["chi_square"] == pytest.approx(expected.statistic)
    assert check["observed_users"] == {"control": 400, "treatment": 300}


def test_a_window_counts_only_its_days(
    client: TestClient, known_effect: tuple[int, pd.DataFrame], analyst_headers: dict[str, Any]
) -> None:
    experiment_id, rows = known_effect
    since, until = day_zero() + timedelta(days=1), day_zero() + timedelta(days=2)

    body = results(
        client, experiment_id, analyst_headers, since=since.isoformat(), until=until.isoformat()
    )

    in_window = rows[(rows.served_at >= since) & (rows.served_at < until)]
    arms = {arm["arm"]: arm for arm in body["arms"]}
    for arm in ("control", "treatment"):
        frame = in_window[in_window.arm == arm]
        assert arms[arm]["requests"] == len(frame)
        assert arms[arm]["users"] == frame.user_hash.nunique()
        assert arms[arm]["metrics"]["kept"]["value"] == pytest.approx(frame.kept.mean())


def test_the_timeseries_has_daily_buckets_per_checkpoint(
    client: TestClient, known_effect: tuple[int, pd.DataFrame], analyst_headers: dict[str, Any]
) -> None:
    _, rows = known_effect
    response = client.get(
        "/analytics/timeseries",
        params={"bucket": "day", "checkpoint": ["ckpt-ke", "base-ke"]},
        headers=analyst_headers,
    )
    assert response.status_code == 200, response.text
    series = {s["checkpoint"]: s["buckets"] for s in response.json()["series"]}
    assert set(series) == {"ckpt-ke", "base-ke"}
    treatment = rows[rows.checkpoint == "ckpt-ke"]
    assert len(series["ckpt-ke"]) == DAYS
    for day, bucket in enumerate(series["ckpt-ke"]):
        start = day_zero() + timedelta(days=day)
        frame = treatment[
            (treatment.served_at >= start) & (treatment.served_at < start + timedelta(days=1))
        ]
        assert bucket["requests"] == len(frame)
        assert bucket["kept"] == pytest.approx(frame.kept.mean())
        assert bucket["mean_reward"] == pytest.approx(frame.reward.mean())
        assert bucket["dissatisfied_rate"] == pytest.approx(frame.dissatisfied.dropna().mean())
    hourly = client.get(
        "/analytics/timeseries",
        params={"bucket": "hour", "checkpoint": "ckpt-ke"},
        headers=analyst_headers,
    ).json()
    assert sum(b["requests"] for b in hourly["series"][0]["buckets"]) == len(treatment)


def test_csv_exports_hold_the_arm_table_and_every_sample(
    client: TestClient, known_effect: tuple[int, pd.DataFrame], analyst_headers: dict[str, Any]
) -> None:
    experiment_id, rows = known_effect
    table = client.get(
        f"/analytics/experiments/{experiment_id}/results.csv", headers=analyst_headers
    )
    assert table.status_code == 200 and table.headers["content-type"].startswith("text/csv")
    arms = list(csv.DictReader(io.StringIO(table.text)))
    assert [arm["arm"] for arm in arms] == ["control", "treatment"]
    assert float(arms[1]["acceptance_rate_p_value"]) < 0.01
    assert arms[0]["acceptance_rate_p_value"] == ""

    with client.stream(
        "GET",
        f"/analytics/experiments/{experiment_id}/samples.csv",
        params={"arm": "treatment"},
        headers=analyst_headers,
    ) as response:
        assert response.status_code == 200
        exported = list(csv.DictReader(io.StringIO("".join(response.iter_text()))))
    assert len(exported) == (rows.arm == "treatment").sum()
    assert {"request_id", "latency_ms", "kept", "reward"} <= set(exported[0])
    assert not {"prompt_messages", "completion_text"} & set(exported[0])


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/analytics/experiments/{id}/results", {"since": "yesterday"}, 400),
        ("/analytics/experiments/{id}/results", {"since": "2026-01-01T00:00:00"}, 400),
        (
            "/analytics/experiments/{id}/results",
            {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
            400,
        ),
        ("/analytics/experiments/0/results", {}, 400),
        ("/analytics/experiments/999999/results", {}, 404),
        ("/analytics/experiments/{id}/samples.csv", {"arm": "x' OR '1'='1"}, 400),
        ("/analytics/timeseries", {"bucket": "week"}, 400),
        ("/analytics/timeseries", {"checkpoint": "ckpt;drop"}, 400),
        ("/analytics/alerts", {"limit": "100000"}, 400),
    ],
)
def test_invalid_filters_are_refused(
    client: TestClient,
    known_effect: tuple[int, pd.DataFrame],
    analyst_headers: dict[str, Any],
    path: str,
    params: dict[str, str],
    status: int,
) -> None:
    response = client.get(path.format(id=known_effect[0]), params=params, headers=analyst_headers)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]
