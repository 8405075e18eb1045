"""The application's state: the long-lived parts its lifespan opens, read by every router."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.applications import Starlette

from app.auth.service import Authenticator, RateLimiter
from app.auth.sessions import BrowserSessions
from app.config import Settings

if TYPE_CHECKING:
    # Named for the type checker only: these packages' routers read the state through here.
    from app.analytics.exports import ExportStreams
    from app.gateway.in_flight import InFlight
    from app.gateway.service import Gateway
    from app.gateway.sink import EventSink


@dataclass(frozen=True, slots=True)
class AppState:
    """What the lifespan opened, for as long as the app runs."""

    settings: Settings
    session_maker: async_sessionmaker[AsyncSession]
    redis: Redis
    sink: EventSink
    """Where completion and feedback events go: Kafka, or the spool until Kafka takes them."""
    exports: ExportStreams
    authenticator: Authenticator
    browser_sessions: BrowserSessions
    rate_limiter: RateLimiter
    in_flight: InFlight
    gateway: Gateway


def install_app_state(app: Starlette, state: AppState) -> None:
    """Make `state` the app's, for `app_state` to return."""
    app.state.parts = state


def app_state(app: Starlette) -> AppState:
    """The app's state; LookupError before its lifespan has started."""
    state: AppState | None = getattr(app.state, "parts", None)
    if state is None:
        raise LookupError("the app's lifespan has not started")
    return state
