"""An in-process gateway app (no vLLM needed), to exercise what every router shares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from app.main import create_app
from app.processes import free_port
from rtrl.embedded.stack import EmbeddedStack


@pytest.fixture
def app_settings(stack: EmbeddedStack, tmp_path: Path) -> Settings:
    # Nothing listens on this vLLM URL: these tests never reach the model.
    return Settings(data_dir=tmp_path / "gateway", vllm_urls=[f"http://127.0.0.1:{free_port()}"])


@pytest.fixture
def client(app_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(app_settings)) as client:
        yield client
