"""Who may read analytics: `analyst` keys, by `Authorization` header or dashboard cookie."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Query, Request
from pydantic import AwareDatetime
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession

from app.analytics.schemas import Window
from app.analytics.service import read_only
from app.auth.dependencies import bearer_secret
from app.auth.schemas import Principal
from app.auth.service import Authenticator, AuthError, RateLimiter
from app.gateway.schemas import ApiError
from app.models import Role

SESSION_COOKIE = "rtrl_dashboard_key"
ANALYTICS_ROLES = frozenset({Role.analyst})


def presented_secret(request: Request) -> str:
    """The key from the Authorization header, else from the dashboard's cookie."""
    if request.headers.get("authorization"):
        return bearer_secret(request)
    cookie = request.cookies.get(SESSION_COOKIE, "")
    if cookie:
        return cookie
    return bearer_secret(request)  # raises the usual 401


async def analyst(request: Request) -> Principal:
    """The caller, when it holds an analyst key within its rate limit."""
    principal = await principal_for(request, presented_secret(request))
    if principal.role not in ANALYTICS_ROLES:
        raise ApiError(
            403,
            f"This API key has role {principal.role.value}; analytics needs analyst.",
            type="permission_error",
            code="insufficient_role",
        )
    limiter: RateLimiter = request.app.state.rate_limiter
    try:
        decision = await limiter.check(principal)
    except RedisError:
        decision = None  # as the gateway does: without Redis, requests pass unmetered
    if decision is not None and not decision.allowed:
        raise ApiError(
            429,
            f"Rate limit of {decision.limit} requests per minute reached for this API key.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(decision.retry_after_s)},
        )
    request.state.principal = principal
    return principal


async def principal_for(request: Request, secret: str) -> Principal:
    """The principal of a secret; 401 when unknown, revoked or expired."""
    authenticator: Authenticator = request.app.state.authenticator
    try:
        return await authenticator.authenticate(secret)
    except AuthError as exc:
        raise ApiError(
            401, f"{exc}.", type="authentication_error", code="invalid_api_key"
        ) from None


async def read_only_session(request: Request) -> AsyncIterator[AsyncSession]:
    """A session whose transaction cannot write."""
    async with request.app.state.session_maker() as session:
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
