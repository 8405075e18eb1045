"""Liveness for processes with no HTTP port (workers, trainer): a file they touch as they work.

The process's main loop beats (sets the file's modification time to now); a healthcheck
(`rtrl healthcheck --heartbeat PATH --max-age S`, run by compose or a Kubernetes exec probe)
passes while the last beat is younger than `max-age`. A loop that hangs or dies stops beating.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class Heartbeat:
    """Touches `path` at most every `every_s` seconds; a `None` path does nothing."""

    def __init__(self, path: Path | None, every_s: float = 1.0) -> None:
        self.path = path
        self.every_s = every_s
        self._last = float("-inf")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def beat(self) -> None:
        """Record that the loop is alive."""
        if self.path is None:
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.path.touch()
        os.utime(self.path)


def heartbeat_age(path: Path) -> float | None:
    """Seconds since the last beat, or None when there was none."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except FileNotFoundError:
        return None
