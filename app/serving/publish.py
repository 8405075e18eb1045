"""The checkpoint registry: publish adapters under immutable names, retire, reconcile."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from app.db import session_scope
from app.models import LIVE_STATUSES, Checkpoint, CheckpointStatus
from app.models.checkpoint import CHECKPOINT_NUMBER_SEQ
from app.serving.replicas import ReplicaError, load_adapter, served_adapters, unload_adapter

BASE_CHECKPOINT = "base"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MANIFEST = "manifest.json"


class PublishError(RuntimeError):
    """Publishing failed; nothing was registered and no replica keeps serving it."""


def ensure_base_checkpoint(session: Session, base_model: str) -> Checkpoint:
    """Register the base model as checkpoint `base`; production if nothing else is."""
    existing = session.scalar(select(Checkpoint).where(Checkpoint.name == BASE_CHECKPOINT))
    if existing is not None:
        return existing
    has_production = session.scalar(
        select(Checkpoint.id).where(Checkpoint.status == CheckpointStatus.production)
    )
    now = datetime.now(UTC)
    base = Checkpoint(
        name=BASE_CHECKPOINT,
        status=CheckpointStatus.retired if has_production else CheckpointStatus.production,
        base_model=base_model,
        adapter_path=None,
        published_at=now,
        promoted_at=None if has_production else now,
    )
    session.add(base)
    session.flush()
    return base


def publish_checkpoint(
    engine: Engine,
    adapter_dir: Path,
    *,
    parent: str,
    replicas: list[str],
    checkpoints_dir: Path,
    base_model: str,
    manifest: dict[str, Any] | None = None,
    reward_version: int | None = None,
    api_key: str = "",
) -> Checkpoint:
    """Store the adapter as `ckpt-<n>`, load it into every replica, then register it.

    The registry row is written last, so a checkpoint is never marked live unless every
    replica serves it; on any failure the replicas that loaded it unload it again.
    """
    missing = [name for name in ADAPTER_FILES if not (adapter_dir / name).is_file()]
    if missing:
        raise PublishError(f"{adapter_dir} is not a PEFT adapter: missing {', '.join(missing)}")

    with session_scope(engine) as session:
        parent_row = session.scalar(select(Checkpoint).where(Checkpoint.name == parent))
        if parent_row is None:
            raise PublishError(f"parent checkpoint {parent!r} does not exist")
        parent_id = parent_row.id
        number = session.execute(CHECKPOINT_NUMBER_SEQ.next_value()).scalar_one()
    name = f"ckpt-{number}"

    destination = store_adapter(adapter_dir, checkpoints_dir / name)
    published_at = datetime.now(UTC)
    (destination / MANIFEST).write_text(
        json.dumps(
            {
                "name": name,
                "parent": parent,
                "base_model": base_model,
                "reward_version": reward_version,
                "published_at": published_at.isoformat(),
                **(manifest or {}),
            },
            indent=2,
            default=str,
        )
    )

    loaded: list[str] = []
    try:
        for replica in replicas:
            load_adapter(replica, name, destination, api_key=api_key)
            loaded.append(replica)
        with session_scope(engine) as session:
            row = Checkpoint(
                name=name,
                parent_id=parent_id,
                status=CheckpointStatus.candidate,
                base_model=base_model,
                adapter_path=str(destination),
                reward_version=reward_version,
                published_at=published_at,
            )
            session.add(row)
            session.flush()
            session.expunge(row)
            return row
    except Exception as exc:
        for replica in loaded:
            # If this fails too, reconcile unloads it later: it is not in the registry.
            with contextlib.suppress(ReplicaError):
                unload_adapter(replica, name, api_key=api_key)
        shutil.rmtree(destination, ignore_errors=True)
        raise PublishError(f"publishing {name} failed: {exc}") from exc


def store_adapter(adapter_dir: Path, destination: Path) -> Path:
    """Copy an adapter to its immutable home, atomically; never overwrite one."""
    if destination.exists():
        raise PublishError(f"{destination} already exists; checkpoint names are never reused")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(adapter_dir, staging)
    os.rename(staging, destination)
    return destination.resolve()


def retire_checkpoint(
    engine: Engine, name: str, replicas: list[str], *, api_key: str = ""
) -> list[str]:
    """Mark a checkpoint retired and unload it; returns the replicas that failed to unload."""
    with session_scope(engine) as session:
        row = session.scalar(select(Checkpoint).where(Checkpoint.name == name))
        if row is None:
            raise PublishError(f"checkpoint {name!r} does not exist")
        if row.status == CheckpointStatus.production:
            raise PublishError(f"{name} is production; promote another checkpoint first")
        row.status = CheckpointStatus.retired
        row.retired_at = datetime.now(UTC)
    failed = []
    for replica in replicas:
        try:
            unload_adapter(replica, name, api_key=api_key)
        except ReplicaError:
            failed.append(replica)
    return failed


@dataclass
class ReconcileReport:
    loaded: dict[str, list[str]] = field(default_factory=dict)
    unloaded: dict[str, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def live_adapters(engine: Engine) -> dict[str, Path]:
    """Adapters that should be served: candidate, canary and production checkpoints."""
    with session_scope(engine) as session:
        rows = session.execute(
            select(Checkpoint.name, Checkpoint.adapter_path).where(
                Checkpoint.status.in_(LIVE_STATUSES), Checkpoint.adapter_path.is_not(None)
            )
        ).all()
    return {name: Path(path) for name, path in rows if path is not None}


def reconcile(engine: Engine, replicas: list[str], *, api_key: str = "") -> ReconcileReport:
    """Make every replica serve exactly the live checkpoints, e.g. after a restart."""
    wanted = live_adapters(engine)
    report = ReconcileReport()
    for replica in replicas:
        try:
            served = served_adapters(replica, api_key=api_key)
            for name in sorted(wanted.keys() - served.keys()):
                load_adapter(replica, name, wanted[name], api_key=api_key)
                report.loaded.setdefault(replica, []).append(name)
            for name in sorted(served.keys() - wanted.keys()):
                unload_adapter(replica, name, api_key=api_key)
                report.unloaded.setdefault(replica, []).append(name)
        except ReplicaError as exc:
            report.errors.append(str(exc))
    return report
