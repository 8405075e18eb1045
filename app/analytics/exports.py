"""Streamed exports on a database pool of their own, so that no download starves serving.

A streamed CSV holds its database connection (a server-side cursor) for as long as the
client takes to read it. On the gateway's pool, a few slow downloads would hold the
connections that chat requests need to look up a key or an assignment, and those would time
out. Here every gateway process runs at most `RTRL_EXPORT_STREAMS` exports at once, each on
its own connection of a pool of that size; one more is a 429 at once, before any work.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from sqlalchemy.ext.asyncio import async_sessionmaker
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.db import make_async_engine
from app.http.errors import ApiError


class ExportStreams:
    """At most `limit` streamed exports at once, each with a connection of their own pool."""

    def __init__(self, database_url: str, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self.engine = make_async_engine(database_url, pool_size=limit, max_overflow=0)
        self.session_maker = async_sessionmaker(self.engine, expire_on_commit=False)

    def take(self) -> Callable[[], None]:
        """A place for one export, and its release (idempotent); 429 when all are taken."""
        if self.running >= self.limit:
            raise ApiError.too_many_requests(
                f"This gateway already streams {self.limit} exports (RTRL_EXPORT_STREAMS);"
                " retry when one has finished.",
                code="too_many_exports",
                retry_after_s=5,
            )
        self.running += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.running -= 1

        return release

    async def aclose(self) -> None:
        await self.engine.dispose()


class ExportResponse(StreamingResponse):
    """A streamed export that gives its place back however the response ends: finished,
    the client gone, or never started."""

    def __init__(
        self,
        content: AsyncIterator[str],
        release: Callable[[], None],
        *,
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, media_type="text/csv", headers=headers)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
