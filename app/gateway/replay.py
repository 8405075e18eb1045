"""Sending a stopped gateway's retained events to Kafka again, by hand (`rtrl spool replay`).

A running gateway does this itself when it sees that the broker lost a log (a topic id
changed); after other incidents (a broker that lost acknowledged messages without losing
the topic, a consumer that skipped some) an operator stops the gateway and replays.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from app.gateway.sink import EventSink
from app.gateway.spool import Retention
from app.gateway.spool_dirs import adopt_free_spools, spool_directories


@dataclass(frozen=True)
class ReplayReport:
    """What a replay sent, and what it could not touch."""

    spools: list[Path]
    held: list[Path]
    """Spools a running gateway holds: not replayed."""
    retained: int
    """Delivered events marked to be sent again."""
    pending: int
    """Events that had not been delivered yet, sent as well."""
    left: int
    """Events Kafka had not taken when the time ran out; they stay spooled."""
    seconds: float


def parse_since(text: str) -> datetime:
    """An ISO 8601 time (local when it names no zone), or a duration (e.g. PT2H) before now."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        try:
            ago = TypeAdapter(timedelta).validate_python(text)
        except PydanticValidationError:
            raise ValueError(f"{text!r} is neither an ISO 8601 time nor a duration") from None
        return datetime.now(UTC) - ago
    return moment if moment.tzinfo else moment.astimezone()


def replay_spools(
    bootstrap_servers: str,
    root: Path,
    retention: Retention,
    *,
    since: datetime | None = None,
    timeout_s: float = 300.0,
    security: Mapping[str, Any] | None = None,
) -> ReplayReport:
    """Send every free spool's retained events (those since `since`) and pending ones again."""
    started = time.monotonic()
    free = adopt_free_spools(root, retention, held=())
    held = [d for d in spool_directories(root) if d not in {s.directory for s in free}]
    if not free:
        return ReplayReport([], held, 0, 0, 0, time.monotonic() - started)
    sink = EventSink(bootstrap_servers, free[-1], adopted=free[:-1], security=security)
    pending = sink.depth["disk"]
    retained = sink.rewind(since)
    sink.start()
    try:
        sink.drain(timeout_s)
    finally:
        left = sink.depth["disk"]
        sink.close(drain_s=0.0)
    return ReplayReport(
        [spool.directory for spool in free],
        held,
        retained,
        pending,
        left,
        time.monotonic() - started,
    )
