"""FastAPI dependencies every router uses: the request's caller, within its rate limit."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from fastapi import Request
from redis.exceptions import RedisError

from app.auth.schemas import Principal
from app.auth.service import AuthError, AuthThrottled, AuthUnavailable, RateLimiter
from app.http.errors import ApiError
from app.http.state import app_state
from app.models import Role

log = logging.getLogger(__name__)


def bearer_secret(request: Request) -> str:
    """The API key from `Authorization: Bearer <key>`, or from `x-api-key: <key>` (how
    Anthropic's clients send it) when there is no Authorization header; 401 when absent or
    malformed."""
    header = request.headers.get("authorization")
    if header is None and request.headers.get("x-api-key", "").strip():
        return request.headers["x-api-key"].strip()
    scheme, _, secret = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(
            401,
            "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
            type="authentication_error",
            code="missing_api_key",
        )
    return secret.strip()


def require_role(
    *roles: Role, cookie: str | None = None
) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency admitting keys of the given roles, within their rate limit.

    With `cookie`, a browser may instead present a dashboard session (see
    `app.auth.sessions`) in that cookie. An authentication outage is a 503 with
    `Retry-After` on every route that uses it.
    """
    allowed = frozenset(roles)
    names = ", ".join(sorted(role.value for role in allowed))

    async def authorized_principal(request: Request) -> Principal:
        session_id = request.cookies.get(cookie, "") if cookie is not None else ""
        if session_id and not _presents_key(request):
            principal = await session_principal(request, session_id)
        else:
            principal = await principal_for(request, bearer_secret(request))
        if principal.role not in allowed:
            raise ApiError(
                403,
                f"This API key has role {principal.role.value}; this route needs {names}.",
                type="permission_error",
                code="insufficient_role",
            )
        await _within_rate_limit(app_state(request.app).rate_limiter, principal)
        request.state.principal = principal
        return principal

    return authorized_principal


def _presents_key(request: Request) -> bool:
    return bool(request.headers.get("authorization") or request.headers.get("x-api-key"))


async def principal_for(request: Request, secret: str) -> Principal:
    """The principal of a secret; 401 when unknown, revoked or expired, 503 in an outage.

    A client address that keeps presenting bad keys is answered 429 without a lookup.
    """
    client = request.client.host if request.client is not None else None
    with _authentication_errors():
        return await app_state(request.app).authenticator.authenticate(secret, client)


async def session_principal(request: Request, session_id: str) -> Principal:
    """The principal of a dashboard session; 401 once it expired, ended or its key was
    revoked."""
    state = app_state(request.app)
    with _authentication_errors():
        try:
            key_hash = await state.browser_sessions.key_hash(session_id)
        except RedisError as exc:
            raise AuthUnavailable(str(exc)) from exc
        if key_hash is None:
            raise AuthError("session expired or ended; sign in again")
        return await state.authenticator.authenticate_hash(key_hash)


@contextmanager
def _authentication_errors() -> Iterator[None]:
    """Authentication failures as the OpenAI error shape: 401, 429 or 503."""
    try:
        yield
    except AuthThrottled as exc:
        raise ApiError.too_many_requests(
            "Too many failed authentications from this address; retry later.",
            code="too_many_failed_authentications",
            retry_after_s=exc.retry_after_s,
        ) from None
    except AuthError as exc:
        raise ApiError(
            401, f"{exc}.", type="authentication_error", code="invalid_api_key"
        ) from None
    except AuthUnavailable:
        log.warning("API key not checked: Postgres or Redis unavailable", exc_info=True)
        raise ApiError.service_unavailable(
            "API keys cannot be checked right now; retry shortly.",
            type="api_error",
            code="auth_unavailable",
            retry_after_s=2,
        ) from None


async def _within_rate_limit(limiter: RateLimiter, principal: Principal) -> None:
    try:
        decision = await limiter.check(principal)
    except RedisError:
        # Metering is not worth an outage: without Redis, requests pass unmetered.
        log.warning("rate limit not checked: Redis unavailable", exc_info=True)
        return
    if not decision.allowed:
        raise ApiError.too_many_requests(
            f"Rate limit of {decision.limit} requests per minute reached for this API key.",
            code="rate_limit_exceeded",
            retry_after_s=decision.retry_after_s,
            headers={"X-RateLimit-Limit": str(decision.limit), "X-RateLimit-Remaining": "0"},
        )
