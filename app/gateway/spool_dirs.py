"""The spool root: one spool directory per gateway, beside those of the other gateways that
share the volume.

A directory is free when no process holds its lock: its gateway stopped or died. A starting
gateway claims a free directory as its own and carries on with its events, or creates one;
it also adopts every other free directory it finds, at start and while it runs, sends what
they hold, and removes them once nothing in them is retained. A legacy spool written
straight into the root (one gateway per data directory) is adopted the same way.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from pathlib import Path

from app.gateway.spool import DiskSpool, Retention, SpoolLocked

PREFIX = "gateway-"


def claim_spool(root: Path, retention: Retention) -> DiskSpool:
    """A free spool directory under `root`, or a new one; locked by this process."""
    for directory in spool_directories(root):
        try:
            return DiskSpool(directory, retention)
        except SpoolLocked:
            continue
    name = f"{PREFIX}{uuid.uuid4().hex[:12]}"
    # Born under a hidden name and renamed once locked, so that no other gateway adopts it
    # (and removes it as empty) before this one holds it.
    staging = root / f".{name}"
    spool = DiskSpool(staging, retention)
    staging.rename(root / name)
    spool.directory = root / name
    return spool


def adopt_free_spools(root: Path, retention: Retention, held: Collection[Path]) -> list[DiskSpool]:
    """Lock every free spool directory under `root` besides `held`, oldest name first."""
    adopted = []
    candidates = [root] if _holds_segments(root) else []
    for directory in [*candidates, *spool_directories(root)]:
        if directory in held:
            continue
        try:
            adopted.append(DiskSpool(directory, retention))
        except (SpoolLocked, FileNotFoundError):
            continue  # its gateway runs, or another one just removed it
    return adopted


def spool_directories(root: Path) -> list[Path]:
    """Every gateway's spool directory under `root`, by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _holds_segments(directory: Path) -> bool:
    return directory.is_dir() and any(directory.glob("segment-*.jsonl"))
