"""What every benchmark that starts its own stack repeats: scratch settings on free ports, an
embedded stack on free ports, and a registry that knows the base model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from app.config import Settings
from app.db import make_engine, session_scope, upgrade_schema
from app.processes import free_port
from app.serving.publish import ensure_base_checkpoint
from rtrl.embedded.stack import EmbeddedStack


def scratch_settings(data_dir: Path, **overrides: Any) -> Settings:
    """Settings for a stack of its own under `data_dir`, every service on a free port."""
    return Settings(
        data_dir=data_dir,
        embedded_postgres_port=free_port(),
        embedded_kafka_port=free_port(),
        embedded_redis_port=free_port(),
        embedded_vllm_port=free_port(),
        gateway_port=free_port(),
        **overrides,
    )


def scratch_stack(root: Path) -> EmbeddedStack:
    """Embedded Postgres, Kafka and Redis under `root` on free ports (not started)."""
    return EmbeddedStack.at(
        root, postgres_port=free_port(), kafka_port=free_port(), redis_port=free_port()
    )


def registry_with_base(stack: EmbeddedStack, model_dir: Path) -> Engine:
    """Start the stack's Postgres, build the schema and register `model_dir` as the base."""
    stack.postgres.start()
    upgrade_schema(stack.postgres.url)
    engine = make_engine(stack.postgres.url)
    with session_scope(engine) as session:
        ensure_base_checkpoint(session, str(model_dir))
    return engine
