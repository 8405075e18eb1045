"""Who may read analytics (analyst keys, by header or dashboard cookie); query shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Query, Request
from pydantic import AwareDatetime
from sqlalchemy.ext.asyncio import AsyncSession

from app.analytics.schemas import Window
from app.analytics.service import read_only
from app.http.dependencies import require_role
from app.http.errors import ApiError
from app.http.state import app_state
from app.models import Role

SESSION_COOKIE = "rtrl_dashboard_session"
ANALYTICS_ROLES = frozenset({Role.analyst})

analyst = require_role(*ANALYTICS_ROLES, cookie=SESSION_COOKIE)
"""The caller, when it holds an analyst key (header or dashboard cookie) within its rate limit."""


async def read_only_session(request: Request) -> AsyncIterator[AsyncSession]:
    """A session whose transaction cannot write."""
    async with app_state(request.app).session_maker() as session:
        await read_only(session)
        yield session


def window(
    since: AwareDatetime | None = Query(None, description="ISO 8601 with an offset; inclusive"),
    until: AwareDatetime | None = Query(None, description="ISO 8601 with an offset; exclusive"),
) -> Window:
    """The `since`/`until` query parameters as a Window; 400 unless since < until."""
    if since is not None and until is not None and since >= until:
        raise ApiError(400, "since must be before until.", code="invalid_window", param="since")
    return Window(since=since, until=until)
