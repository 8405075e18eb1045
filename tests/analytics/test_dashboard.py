"""`/dashboard` in headless Chromium: sign-in by key, then charts drawn from real data.

Chromium is Debian's `chromium` package; without it the browser test is skipped and the
sign-in and asset tests still run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from sqlalchemy import Engine, select

from app.abtest.rollups import refresh_rollups
from app.analytics.dependencies import SESSION_COOKIE
from app.auth.service import hash_secret
from app.auth.sessions import SESSIONS_PER_KEY
from app.config import Settings
from app.db import session_scope
from app.main import create_app
from app.models import Alert, ApiKey, Checkpoint, Role
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


@contextmanager
def sign_in_page(dashboard: str, key: str) -> Iterator[str]:
    """A page that posts the login form on load, as an analyst signing in would: served
    from another port of the same host (same site, so the Strict cookie follows)."""
    page = (
        f'<form method="post" action="{dashboard}/dashboard/login">'
        f'<input name="key" value="{key}"></form><script>document.forms[0].submit()</script>'
    ).encode()

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


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
    with sign_in_page(dashboard_server.url, make_key(Role.analyst)) as url:
        dom = chromium(url, tmp_path / "dom-profile", "--dump-dom")

    assert 'data-ready="true"' in dom, dom[-3000:]
    assert len(re.findall(r"<svg[^>]*data-metric=", dom)) >= 8
    assert len(re.findall(r"<svg[^>]*data-trend=", dom)) == 3
    assert "data-lineage" in dom and "dash-2 · canary" in dom
    assert len(re.findall(r"<circle", dom)) > 20
    assert len(re.findall(r"<path", dom)) >= 6
    assert "clarifying_question_rate" in dom
    assert "Sample ratio of users at first exposure OK" in dom
    assert "switched users (left out)" in dom and "unit of randomization" in dom
    assert "Predicted vs realized" in dom and "No predictions yet." in dom

    screenshot = tmp_path / "dashboard.png"
    with sign_in_page(dashboard_server.url, make_key(Role.analyst)) as url:
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

    key = make_key(Role.analyst)
    signed_in = client.post(
        "/dashboard/login",
        content=f"key={key}",
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
    assert key not in cookie  # a random session id, never the key
    assert "Secure" not in cookie  # plain HTTP on loopback, where a browser would drop it
    page = client.get("/dashboard")
    assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/analytics/experiments").status_code == 200
    assert client.get("/dashboard/static/dashboard.js").status_code == 200
    assert client.get("/dashboard/static/..%2Fdashboard.py").status_code == 404
    client.cookies.clear()

    refused = client.post(
        "/dashboard/login",
        content=f"key={make_key(Role.ops)}",
        follow_redirects=False,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert refused.status_code == 403 and "needs analyst" in refused.text
    # A key in a URL would end up in history and logs: refused, whatever the key.
    in_url = client.get(f"/dashboard?key={make_key(Role.analyst)}", follow_redirects=False)
    assert in_url.status_code == 400 and "set-cookie" not in in_url.headers


def sign_in(client: TestClient, key: str, **headers: str) -> Any:
    return client.post(
        "/dashboard/login",
        content=f"key={key}",
        follow_redirects=False,
        headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
    )


def test_revoking_the_key_ends_its_dashboard_sessions(
    client: TestClient, make_key: Callable[..., str], app_engine: Engine
) -> None:
    client.cookies.clear()
    key = make_key(Role.analyst)
    assert sign_in(client, key).status_code == 303
    assert client.get("/analytics/experiments").status_code == 200
    with session_scope(app_engine) as session:
        key_id = session.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_secret(key)))
    ops = {"Authorization": f"Bearer {make_key(Role.ops)}"}

    assert client.post(f"/admin/api-keys/{key_id}/revoke", headers=ops).status_code == 200

    assert client.get("/analytics/experiments").status_code == 401
    assert client.get("/dashboard").status_code == 401
    client.cookies.clear()


def test_a_key_keeps_only_its_newest_dashboard_sessions(
    client: TestClient, make_key: Callable[..., str]
) -> None:
    # A script that signs in over and over does not grow Redis: past the cap, the oldest ends.
    key = make_key(Role.analyst)
    cookies = []
    for _ in range(SESSIONS_PER_KEY + 1):
        client.cookies.clear()
        assert sign_in(client, key).status_code == 303
        cookies.append(client.cookies[SESSION_COOKIE])

    def works(cookie: str) -> bool:
        client.cookies.clear()
        client.cookies.set(SESSION_COOKIE, cookie)
        return client.get("/analytics/experiments").status_code == 200

    assert not works(cookies[0])
    assert all(works(cookie) for cookie in cookies[1:])
    client.cookies.clear()


def test_the_session_cookie_is_secure_behind_a_trusted_tls_proxy(
    app_settings: Settings, make_key: Callable[..., str]
) -> None:
    proxied = app_settings.model_copy(update={"trust_proxy_headers": True})
    with TestClient(include_routers(create_app(proxied)), base_url="http://127.0.0.1") as client:
        behind_tls = sign_in(client, make_key(Role.analyst), **{"X-Forwarded-Proto": "https"})
        assert "Secure" in behind_tls.headers["set-cookie"]
    with TestClient(
        include_routers(create_app(app_settings)), base_url="http://127.0.0.1"
    ) as client:
        untrusted = sign_in(client, make_key(Role.analyst), **{"X-Forwarded-Proto": "https"})
        assert "Secure" not in untrusted.headers["set-cookie"]
    with TestClient(
        include_routers(create_app(app_settings)), base_url="http://rtrl.example"
    ) as client:
        remote = sign_in(client, make_key(Role.analyst))
        assert "Secure" in remote.headers["set-cookie"]


def test_a_sign_in_form_with_more_fields_than_it_has_is_a_clear_400(
    client: TestClient, make_key: Callable[..., str]
) -> None:
    client.cookies.clear()
    stuffed = "&".join([f"key={make_key(Role.analyst)}", *(f"f{i}=x" for i in range(5))])
    refused = client.post(
        "/dashboard/login",
        content=stuffed,
        follow_redirects=False,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert refused.status_code == 400 and "takes one field, key" in refused.text
    assert "set-cookie" not in refused.headers
