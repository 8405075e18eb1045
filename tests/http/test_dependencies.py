"""`require_role` on real routes: who gets in, who is told why, who must slow down."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi import Depends
from fastapi.testclient import TestClient
from sqlalchemy import Engine, update

from app.auth.service import AUTH_CACHE_TTL_S
from app.db import session_scope
from app.http.dependencies import require_role
from app.models import ApiKey, Role


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def assert_openai_error(response: Any, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    return error


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Bearer rtrl_unknown", "Bearer sk-x"],
)
def test_missing_or_unknown_keys_get_401(client: TestClient, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    assert_openai_error(client.get("/v1/models", headers=headers), 401, "authentication_error")


def test_an_ide_key_gets_in(client: TestClient, make_key: Callable[..., Any]) -> None:
    _, secret = make_key()
    response = client.get("/v1/models", headers=bearer(secret))
    assert response.status_code == 200
    assert response.headers["x-request-id"].startswith("req_")


def test_the_wrong_role_gets_403_and_the_dependency_serves_other_roles(
    client: TestClient, make_key: Callable[..., Any]
) -> None:
    _, ops = make_key(Role.ops)
    _, ide = make_key(Role.ide)
    client.app.add_api_route(  # type: ignore[attr-defined]
        "/ops-only",
        lambda: {"ok": True},
        dependencies=[Depends(require_role(Role.ops, Role.analyst))],
    )

    error = assert_openai_error(
        client.get("/v1/models", headers=bearer(ops)), 403, "permission_error"
    )
    assert "ide" in error["message"]
    assert client.get("/ops-only", headers=bearer(ops)).json() == {"ok": True}
    assert_openai_error(client.get("/ops-only", headers=bearer(ide)), 403, "permission_error")


def test_revoking_a_key_takes_effect_within_seconds(
    client: TestClient, make_key: Callable[..., Any], engine: Engine
) -> None:
    row, secret = make_key()
    assert client.get("/v1/models", headers=bearer(secret)).status_code == 200

    with session_scope(engine) as session:
        session.execute(
            update(ApiKey).where(ApiKey.id == row.id).values(revoked_at=datetime.now(UTC))
        )
    revoked_at = time.monotonic()
    while client.get("/v1/models", headers=bearer(secret)).status_code == 200:
        assert time.monotonic() - revoked_at < AUTH_CACHE_TTL_S + 2, "revocation ignored"
        time.sleep(0.2)
    assert_openai_error(
        client.get("/v1/models", headers=bearer(secret)), 401, "authentication_error"
    )


def test_a_key_over_its_rate_limit_gets_429_with_retry_after(
    client: TestClient, make_key: Callable[..., Any]
) -> None:
    if 60 - time.time() % 60 < 3:
        time.sleep(60 - time.time() % 60 + 0.1)  # stay inside one counting minute
    _, secret = make_key(rate_limit_per_minute=3)
    _, other = make_key(rate_limit_per_minute=3)

    statuses = [client.get("/v1/models", headers=bearer(secret)).status_code for _ in range(3)]
    limited = client.get("/v1/models", headers=bearer(secret))

    assert statuses == [200, 200, 200]
    assert_openai_error(limited, 429, "rate_limit_error")
    assert 1 <= int(limited.headers["retry-after"]) <= 60
    assert limited.headers["x-ratelimit-limit"] == "3"
    assert client.get("/v1/models", headers=bearer(other)).status_code == 200
