"""Session-wide real services: the same launchers `rtrl services up` uses."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from app.config import get_settings
from app.db import make_engine
from app.embedded.process import free_port
from app.embedded.stack import EmbeddedStack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """Postgres, Kafka and Redis for this test session, migrated and with topics."""
    data_dir = tmp_path_factory.mktemp("rtrl")
    stack = EmbeddedStack.at(
        data_dir, postgres_port=free_port(), kafka_port=free_port(), redis_port=free_port()
    )
    stack.up()
    env = {
        "RTRL_DATA_DIR": str(data_dir),
        "RTRL_EMBEDDED_POSTGRES_PORT": str(stack.postgres.port),
        "RTRL_EMBEDDED_KAFKA_PORT": str(stack.kafka.port),
        "RTRL_EMBEDDED_REDIS_PORT": str(stack.redis.port),
        **stack.environment(),
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    get_settings.cache_clear()
    try:
        yield stack
    finally:
        stack.down()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        get_settings.cache_clear()


@pytest.fixture(scope="session")
def engine(stack: EmbeddedStack) -> Iterator[Engine]:
    engine = make_engine(stack.postgres.url)
    yield engine
    engine.dispose()


@pytest.fixture
def db_session(engine: Engine) -> Iterator[Session]:
    """A session inside a transaction that is rolled back after the test."""
    with engine.connect() as connection:
        transaction = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        try:
            yield session
        finally:
            session.close()
            transaction.rollback()
