"""An in-process gateway app (no vLLM needed) and API keys in the session's Postgres."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from app.auth.service import new_api_key
from app.config import Settings
from app.db import session_scope
from app.embedded.process import free_port
from app.embedded.stack import EmbeddedStack
from app.main import create_app
from app.models import ApiKey, Role


@pytest.fixture
def app_settings(stack: EmbeddedStack, tmp_path: Path) -> Settings:
    # Nothing listens on this vLLM URL: these tests never reach the model.
    return Settings(data_dir=tmp_path / "gateway", vllm_urls=[f"http://127.0.0.1:{free_port()}"])


@pytest.fixture
def client(app_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(app_settings)) as client:
        yield client


@pytest.fixture
def make_key(engine: Engine) -> Callable[..., tuple[ApiKey, str]]:
    """Creates an API key in Postgres: its row (detached) and its secret."""

    def make(role: Role = Role.ide, **fields: Any) -> tuple[ApiKey, str]:
        with session_scope(engine) as session:
            row, secret = new_api_key(name=f"test-{uuid.uuid4().hex[:8]}", role=role, **fields)
            session.add(row)
            session.flush()
            session.expunge(row)
        return row, secret

    return make
