"""`/analytics/*` results: differences, intervals and p-values over users checked against
statsmodels' user-clustered estimates and a user bootstrap computed here from the raw seeded
rows, switched users, CUPED, the sample-ratio check over ramps, trends, exports, filters."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import pandas as pd
import pytest
import statsmodels.api as sm
from fastapi.testclient import TestClient
from scipy import stats
from sqlalchemy import Engine, update

from app.abtest.rollups import refresh_rollups
from app.db import session_scope
from app.models import Arm, AuditEntry
from tests.analytics import conftest
from tests.analytics.conftest import DAYS, Behaviour, SeededArm, day_zero

Seeder = Callable[..., tuple[int, pd.DataFrame]]


@pytest.fixture(scope="module")
def known_effect(seeder: Seeder, app_engine: Engine) -> tuple[int, pd.DataFrame]:
    """50/50: the treatment is accepted more (0.52 vs 0.40) and is 20% slower; users differ
    (each accepts at their own rate) and make 4 to 16 requests."""
    users = {"requests_per_user": 4, "most_requests_per_user": 16, "accept_concentration": 4.0}
    seeded = seeder(
        [
            SeededArm("control", "base-ke", 5_000, Behaviour(400, **users), is_control=True),
            SeededArm(
                "treatment",
                "ckpt-ke",
                5_000,
                Behaviour(400, **users, accept=0.52, latency_median_ms=720.0),
            ),
        ],
        seed=11,
    )
    refresh_rollups(app_engine)
    return seeded


def clustered_mean(values: pd.Series, users: pd.Series) -> tuple[float, float]:
    """Mean over requests and its variance clustered by user: an intercept-only OLS with
    statsmodels' cluster-robust covariance (its small-sample factor is K / (K - 1))."""
    codes = pd.factorize(users)[0]
    fit = sm.OLS(values.astype(float).to_numpy(), np.ones(len(values))).fit(
        cov_type="cluster", cov_kwds={"groups": codes}
    )
    return float(fit.params[0]), float(fit.cov_params()[0, 0])


def welch_interval(
    treated: tuple[float, float, int], baseline: tuple[float, float, int]
) -> tuple[float, float, float]:
    """Interval and p-value of a difference of two independent estimates (value, variance,
    users) with Welch–Satterthwaite degrees of freedom."""
    (m1, v1, k1), (m2, v2, k2) = treated, baseline
    dof = (v1 + v2) ** 2 / (v1**2 / (k1 - 1) + v2**2 / (k2 - 1))
    se = np.sqrt(v1 + v2)
    margin = stats.t.ppf(0.975, dof) * se
    return m1 - m2 - margin, m1 - m2 + margin, 2 * stats.t.sf(abs(m1 - m2) / se, dof)


def results(client: TestClient, experiment_id: int, headers: dict[str, Any], **params: str) -> Any:
    response = client.get(
        f"/analytics/experiments/{experiment_id}/results", params=params, headers=headers
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_differences_intervals_and_p_values_are_over_users_as_statsmodels_clusters_them(
    client: TestClient, known_effect: tuple[int, pd.DataFrame], analyst_headers: dict[str, Any]
) -> None:
    experiment_id, rows = known_effect
    body = results(client, experiment_id, analyst_headers)
    arms = {arm["arm"]: arm for arm in body["arms"]}
    control, treatment = rows[rows.arm == "control"], rows[rows.arm == "treatment"]
    assert body["control_arm"] == "control" and body["unit"] == "user"
    assert arms["treatment"]["requests"] == len(treatment)
    assert arms["treatment"]["users"] == treatment.user_hash.nunique() == 400
    assert arms["treatment"]["switched_users"] == 0

    for metric, observed, column in [
        ("acceptance_rate", None, "accepted"),
        ("dissatisfied_rate", "dissatisfied", "dissatisfied"),
        ("error_rate", None, "is_error"),
        ("kept", None, "kept"),
        ("mean_reward", None, "reward"),
        ("latency_mean_ms", None, "latency_ms"),
    ]:
        estimates = []
        for frame in (treatment, control):
            frame = frame.assign(is_error=frame.status == "error")
            if observed:
                frame = frame[frame[observed].notna()]
            mean, variance = clustered_mean(frame[column], frame.user_hash)
            estimates.append((mean, variance, 400))
        low, high, p = welch_interval(estimates[0], estimates[1])
        got = arms["treatment"]["metrics"][metric]
        assert got["value"] == pytest.approx(estimates[0][0])
        vs = got["vs_control"]
        assert vs["difference"] == pytest.approx(estimates[0][0] - estimates[1][0])
        # Users without an observation count in the delta method's K, not in the OLS.
        assert (vs["ci_low"], vs["ci_high"]) == (
            pytest.approx(low, rel=2e-3),
            pytest.approx(high, rel=2e-3),
        ), metric
        assert vs["p_value"] == pytest.approx(p, rel=2e-2, abs=1e-6), metric
        assert arms["control"]["metrics"][metric]["vs_control"] is None
    acceptance = arms["treatment"]["metrics"]["acceptance_rate"]["vs_control"]
    assert acceptance["significant"] and acceptance["p_value"] < 0.05

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


def bootstrap_over_users(
    treatment: pd.DataFrame,
    control: pd.DataFrame,
    column: str,
    statistic: Any,
    replicates: int = 400,
) -> float:
    """Standard error of statistic(treatment) - statistic(control) of a column, users
    resampled with replacement."""
    rng = np.random.default_rng(5)
    arms = [
        [values.to_numpy() for _, values in frame.groupby("user_hash")[column]]
        for frame in (treatment, control)
    ]
    draws = []
    for _ in range(replicates):
        picked = [
            np.concatenate([users[i] for i in rng.integers(0, len(users), len(users))])
            for users in arms
        ]
        draws.append(statistic(picked[0]) - statistic(picked[1]))
    return float(np.std(draws, ddof=1))


def test_the_relative_lift_and_percentile_intervals_agree_with_a_user_bootstrap(
    client: TestClient, known_effect: tuple[int, pd.DataFrame], analyst_headers: dict[str, Any]
) -> None:
    experiment_id, rows = known_effect
    arms = {arm["arm"]: arm for arm in results(client, experiment_id, analyst_headers)["arms"]}
    control, treatment = rows[rows.arm == "control"], rows[rows.arm == "treatment"]
    base = control.kept.mean()

    kept = arms["treatment"]["metrics"]["kept"]["vs_control"]
    lift_se = bootstrap_over_users(treatment, control, "kept", lambda kept: kept.mean() / base)
    assert kept["relative_difference"] == pytest.approx(treatment.kept.mean() / base - 1)
    width = (kept["relative_ci_high"] - kept["relative_ci_low"]) / (2 * 1.96)
    assert width == pytest.approx(lift_se, rel=0.2)

    p95 = arms["treatment"]["metrics"]["latency_p95_ms"]["vs_control"]
    p95_se = bootstrap_over_users(
        treatment, control, "latency_ms", lambda latency: np.percentile(latency, 95)
    )
    assert (p95["ci_high"] - p95["ci_low"]) / (2 * 1.96) == pytest.approx(p95_se, rel=0.3)


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


def add_users(
    engine: Engine,
    experiment_id: int,
    arm: str,
    checkpoint: str,
    users: list[str],
    first: datetime,
    span: timedelta,
) -> pd.DataFrame:
    """One request for each of `users` in `arm`, served within `span` from `first`."""
    rng = np.random.default_rng(len(users))
    rows = conftest._rows(
        rng, np.array(users), np.full(len(users), 0.4), Behaviour(users=len(users)), 1.0
    )
    rows["arm"], rows["checkpoint"], rows["experiment_id"] = arm, checkpoint, experiment_id
    rows["served_at"] = [first + span * float(f) for f in rng.random(len(users))]
    conftest._insert(engine, rows)
    return rows


def test_users_seen_in_two_arms_are_reported_and_left_out(
    client: TestClient, seeder: Seeder, app_engine: Engine, analyst_headers: dict[str, Any]
) -> None:
    experiment_id, rows = seeder(
        [
            SeededArm("control", "sw-a", 5_000, Behaviour(users=100), is_control=True),
            SeededArm("treatment", "sw-b", 5_000, Behaviour(users=100)),
        ],
        seed=14,
    )
    # Ten control users are later served by the treatment (e.g. an arm was stopped and ramped).
    moved = sorted(rows[rows.arm == "control"].user_hash.unique())[:10]
    later = day_zero() + timedelta(days=DAYS)
    add_users(app_engine, experiment_id, "treatment", "sw-b", moved, later, timedelta(hours=1))
    refresh_rollups(app_engine)

    arms = {arm["arm"]: arm for arm in results(client, experiment_id, analyst_headers)["arms"]}

    stayed = rows[(rows.arm == "control") & ~rows.user_hash.isin(moved)]
    assert (arms["control"]["users"], arms["control"]["switched_users"]) == (90, 10)
    assert (arms["treatment"]["users"], arms["treatment"]["switched_users"]) == (100, 0)
    assert arms["control"]["requests"] == len(stayed)
    assert arms["treatment"]["requests"] == (rows.arm == "treatment").sum()
    assert arms["control"]["metrics"]["kept"]["value"] == pytest.approx(stayed.kept.mean())


def test_the_sample_ratio_is_checked_against_the_weights_at_each_users_first_exposure(
    client: TestClient, seeder: Seeder, app_engine: Engine, analyst_headers: dict[str, Any]
) -> None:
    experiment_id, _ = seeder(
        [
            SeededArm("control", "ramp-a", 9_000, Behaviour(450, 1), is_control=True),
            SeededArm("treatment", "ramp-b", 1_000, Behaviour(50, 1)),
        ],
        seed=15,
    )
    ramped_at = day_zero() + timedelta(days=DAYS)
    with session_scope(app_engine) as session:
        state = [
            {"name": "control", "weight_bps": 9_000, "is_control": True},
            {"name": "treatment", "weight_bps": 1_000, "is_control": False},
        ]
        after = [{**state[0], "weight_bps": 5_000}, {**state[1], "weight_bps": 5_000}]
        session.add(
            AuditEntry(
                actor="ops",
                action="experiment.ramp",
                target=f"experiment:{experiment_id}",
                before={"arms": state},
                after={"arms": after},
                at=ramped_at,
            )
        )
        session.execute(
            update(Arm).where(Arm.experiment_id == experiment_id).values(weight_bps=5_000)
        )
    for arm, checkpoint in (("control", "ramp-a"), ("treatment", "ramp-b")):
        users = [f"{experiment_id}-after-{arm}-{n}" for n in range(250)]
        add_users(app_engine, experiment_id, arm, checkpoint, users, ramped_at, timedelta(hours=6))
    refresh_rollups(app_engine)

    check = results(client, experiment_id, analyst_headers)["sample_ratio"]

    assert check["observed_users"] == {"control": 700, "treatment": 300}
    assert check["ramp_periods"] == 2 and check["mismatch"] is False
    assert check["p_value"] == pytest.approx(1.0)
    # Against today's weights alone, the ramp itself would look like a mismatch.
    assert stats.chisquare([700, 300], [500, 500]).pvalue < 1e-30


@pytest.fixture(scope="module")
def with_history(seeder: Seeder, app_engine: Engine) -> tuple[int, pd.DataFrame]:
    """Users who accept at very different rates, seen for a week before the experiment."""
    users = {
        "requests_per_user": 4,
        "most_requests_per_user": 12,
        "accept_concentration": 2.0,
        "pre_requests_per_user": 12,
    }
    seeded = seeder(
        [
            SeededArm("control", "cuped-a", 5_000, Behaviour(500, **users), is_control=True),
            SeededArm("treatment", "cuped-b", 5_000, Behaviour(500, **users, accept=0.45)),
        ],
        seed=16,
    )
    refresh_rollups(app_engine)
    return seeded


def cuped_bootstrap(rows: pd.DataFrame, replicates: int = 400) -> float:
    """SE of the CUPED kept difference, users resampled and theta re-estimated each time
    (per-user influence values of the post and pre ratios, theta their pooled slope)."""
    during, before = rows[rows.arm.notna()], rows[rows.arm.isna()]
    per_user = during.groupby("user_hash").agg(arm=("arm", "first"), y=("kept", "sum"))
    per_user["n"] = during.groupby("user_hash").size()
    per_user["x"] = before.groupby("user_hash").kept.sum()
    per_user["m"] = before.groupby("user_hash").size()
    arms = [
        per_user[per_user.arm == arm].to_numpy()[:, 1:].astype(float)
        for arm in ("treatment", "control")
    ]
    rng = np.random.default_rng(3)
    draws = []
    for _ in range(replicates):
        pieces = []
        for values in arms:
            y, n, x, m = values[rng.integers(0, len(values), len(values))].T
            r, p = y.sum() / n.sum(), x.sum() / m.sum()
            u, v = (y - r * n) / n.mean(), (x - p * m) / m.mean()
            pieces.append((r, p, np.cov(u, v)[0, 1] / len(u), v.var(ddof=1) / len(v)))
        theta = (pieces[0][2] + pieces[1][2]) / (pieces[0][3] + pieces[1][3])
        draws.append(pieces[0][0] - pieces[1][0] - theta * (pieces[0][1] - pieces[1][1]))
    return float(np.std(draws, ddof=1))


def test_cuped_narrows_the_interval_beside_the_unadjusted_one(
    client: TestClient, with_history: tuple[int, pd.DataFrame], analyst_headers: dict[str, Any]
) -> None:
    experiment_id, rows = with_history
    plain = results(client, experiment_id, analyst_headers)
    body = results(client, experiment_id, analyst_headers, cuped="true")

    assert body["cuped"] is True and plain["cuped"] is False
    kept = {arm["arm"]: arm for arm in body["arms"]}["treatment"]["metrics"]["kept"]
    unadjusted, adjusted = kept["vs_control"], kept["cuped"]
    assert (
        unadjusted
        == {a["arm"]: a for a in plain["arms"]}["treatment"]["metrics"]["kept"]["vs_control"]
    )
    assert adjusted["variance_reduction"] > 0.2
    assert adjusted["ci_high"] - adjusted["ci_low"] < unadjusted["ci_high"] - unadjusted["ci_low"]
    # The true lift: 5 pp more accepted edits, two thirds of each kept on average.
    assert adjusted["ci_low"] < 0.05 * 4 / 6 < adjusted["ci_high"]
    se = (adjusted["ci_high"] - adjusted["ci_low"]) / (2 * stats.t.ppf(0.975, 900))
    assert se == pytest.approx(cuped_bootstrap(rows), rel=0.2)
    assert {a["arm"]: a for a in plain["arms"]}["treatment"]["metrics"]["kept"]["cuped"] is None


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
