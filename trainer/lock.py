"""One training cycle at a time across every trainer process: a Postgres advisory lock."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import Engine, text

TRAINER_LOCK_KEY = 0x72_74_72_6C  # "rtrl"


class CycleBusy(RuntimeError):
    """Another process is running a training cycle."""


@contextlib.contextmanager
def trainer_lock(engine: Engine) -> Iterator[None]:
    """Hold the cluster-wide trainer lock for the duration, or raise CycleBusy."""
    with engine.connect() as connection:
        locked = connection.scalar(
            text("SELECT pg_try_advisory_lock(:key)"), {"key": TRAINER_LOCK_KEY}
        )
        connection.commit()
        if not locked:
            raise CycleBusy("another training cycle is running")
        try:
            yield
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": TRAINER_LOCK_KEY})
            connection.commit()
