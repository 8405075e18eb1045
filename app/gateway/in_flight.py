"""Completions in flight per API key, in this gateway process: one key cannot hold every vLLM
slot while the others wait. Past its limit a key's next request is a 429 at once."""

from __future__ import annotations

import itertools
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

from app.http.errors import ApiError

Release = Callable[[], None]


class InFlight:
    """Admits a key's request while fewer than `limit` of its requests are in flight here.

    An admitted request releases its place when its answer (or its stream) ends. A place its
    request never released (a stream dropped before its first chunk) is taken back after
    `expire_s`, so a lost release costs a key one place for a while, never for good."""

    def __init__(self, limit: int, expire_s: float) -> None:
        self.limit = limit
        self.expire_s = expire_s
        self._places: defaultdict[uuid.UUID, dict[int, float]] = defaultdict(dict)
        self._tickets = itertools.count()

    def admit(self, key_id: uuid.UUID) -> Release:
        now = time.monotonic()
        places = self._places[key_id]
        for ticket in [t for t, deadline in places.items() if deadline <= now]:
            del places[ticket]
        if len(places) >= self.limit:
            raise ApiError.too_many_requests(
                f"This API key already has {self.limit} requests in flight on this gateway;"
                " wait for one to finish.",
                code="too_many_requests_in_flight",
                retry_after_s=1,
            )
        ticket = next(self._tickets)
        places[ticket] = now + self.expire_s

        def release() -> None:
            places.pop(ticket, None)
            if not places and self._places.get(key_id) is places:
                del self._places[key_id]

        return release

    def in_flight(self, key_id: uuid.UUID | None = None) -> int:
        """Requests in flight here: one key's, or every key's."""
        if key_id is not None:
            return len(self._places.get(key_id, {}))
        return sum(len(places) for places in self._places.values())


async def released_after(chunks: AsyncIterator[bytes], release: Release) -> AsyncIterator[bytes]:
    """The stream's chunks; its place is released when it ends, fails or is cancelled."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        release()
