"""`/dashboard` in headless Chromium: sign-in by key, then charts drawn from real data.

Chromium is Debian's `chromium` package; without it the browser test is skipped and the
sign-in and asset tests still run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from sqlalchemy import Engine, select

from app.abtest.rollups import refresh_rollups
from app.analytics.dependencies import SESSION_COOKIE
from app.config import Settings
from app.db import session_scope
from app.models import Alert, Checkpoint, Role
from tests.analytics.app_fixtures import include_routers
from tests.analytics.conftest import Behaviour, SeededArm
from tests.gateway.conftest import GatewayServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
Seeder = Callable[..., tuple[int, pd.DataFrame]]


@pytest.fixture(scope="module")
def dashboard_data(seeder: Seeder, app_engine: Engine) -> int:
    """An experiment, a lineage (base -> dash-1 -> dash-2) and a monitor's alert."""
    experiment_id, _ = seeder(
        [
            SeededArm("control", "dash-1", 5_000, Behaviour(users=60), is_control=True),
            SeededArm("treatment", "dash-2", 5_000, Behaviour(users=60, accept=0.5)),
        ],
        seed=21,
    )
    with session_scope(app_engine) as session:
        first = session.scalar(select(Checkpoint).where(Checkpoint.name == "dash-1"))
        second = session.scalar(select(Checkpoint).where(Checkpoint.name == "dash-2"))
        assert first is not None and second is not None
        second.parent_id = first.id
        now = datetime.now(UTC)
        session.add(
            Alert(
                checkpoint="dash-2",
                control_checkpoint="dash-1",
                metric="clarifying_question_rate",
                canary_value=0.2,
                control_value=0.05,
                threshold=0.05,
                window_start=now - timedelta(hours=1),
                window_end=now,
            )
        )
    refresh_rollups(app_engine)
    return experiment_id


@pytest.fixture
def dashboard_server(app_settings: Settings, tmp_path: Path) -> Iterator[GatewayServer]:
    server = GatewayServer(app_settings.model_copy(update={"data_dir": tmp_path / "app"})).start()
    include_routers(server.app)
    yield server
    server.stop()


def chromium(url: str, profile: Path, *flags: str) -> str:
    result = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=20000",
            "--window-size=1280,2200",
            *flags,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_the_dashboard_draws_its_charts_in_a_real_browser(
    dashboard_data: int,
    dashboard_server: GatewayServer,
    make_key: Callable[..., str],
    tmp_path: Path,
) -> None:
    url = f"{dashboard_server.url}/dashboard?key={make_key(Role.analyst)}"

    dom = chromium(url, tmp_path / "dom-profile", "--dump-dom")

    assert 'data-ready="true"' in dom, dom[-3000:]
    assert len(re.findall(r"<svg[^>]*data-metric=", dom)) >= 8
    assert len(re.findall(r"<svg[^>]*data-trend=", dom)) == 3
    assert "data-lineage" in dom and "dash-2 · canary" in dom
    assert len(re.findall(r"<circle", dom)) > 20
    assert len(re.findall(r"<path", dom)) >= 6
    assert "clarifying_question_rate" in dom
    assert "Sample ratio OK" in dom

    screenshot = tmp_path / "dashboard.png"
    chromium(url, tmp_path / "png-profile", f"--screenshot={screenshot}")
    rgb = np.asarray(Image.open(screenshot).convert("RGB"), dtype=np.int64).reshape(-1, 3)
    packed = rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2]
    background = np.bincount(packed).argmax()
    assert (packed != background).mean() > 0.03
    # The first arm's and line's colour (#2f6fde) is on the page.
    assert (np.abs(rgb - [0x2F, 0x6F, 0xDE]).sum(axis=1) < 30).any()


def test_signing_in_sets_an_http_only_cookie_and_refuses_other_roles(
    client: TestClient, make_key: Callable[..., str]
) -> None:
    client.cookies.clear()
    assert client.get("/dashboard").status_code == 401
    assert client.get("/analytics/experiments").status_code == 401

    signed_in = client.post(
        "/dashboard/login",
        content=f"key={make_key(Role.analyst)}",
        follow_redirects=False,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )

    assert signed_in.status_code == 303
    cookie = signed_in.headers["set-cookie"]
    assert (
        cookie.startswith(f"{SESSION_COOKIE}=")
        and "HttpOnly" in cookie
        and "SameSite=strict" in cookie
    )
    page = client.get("/dashboard")
    assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/analytics/experiments").status_code == 200
    assert client.get("/dashboard/static/dashboard.js").status_code == 200
    assert client.get("/dashboard/static/..%2Fdashboard.py").status_code == 404
    client.cookies.clear()

    refused = client.get(f"/dashboard?key={make_key(Role.ops)}", follow_redirects=False)
    assert refused.status_code == 403 and "needs analyst" in refused.text
    assert client.get("/dashboard?key=rtrl_nope", follow_redirects=False).status_code == 401
