"""Promotions and rollbacks change what every running gateway serves, within seconds.

Two gateway replicas (`GatewayServer` from the gateway tests) on the admin tests' database, the
session's real vLLM, Redis and Kafka; the change is made through one replica's admin API
and observed as the `model` that answers chat completions on both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import Engine

from app.config import Settings
from app.models import Role
from app.serving.publish import publish_checkpoint
from app.serving.replicas import served_adapters, unload_adapter
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from tests.analytics.app_fixtures import bearer, include_routers
from tests.gateway.conftest import GatewayServer

CHANGE_DEADLINE_S = 5.0


@pytest.fixture
def canary_name(
    registry: Engine, vllm_server: VllmServer, lora_dir: Path, tmp_path: Path
) -> Iterator[str]:
    """A LoRA checkpoint published (a candidate) and loaded into the session's vLLM."""
    checkpoint = publish_checkpoint(
        registry,
        lora_dir,
        parent="base",
        replicas=[vllm_server.url],
        checkpoints_dir=tmp_path / "checkpoints",
        base_model="tiny-base",
    )
    yield checkpoint.name
    unload_adapter(vllm_server.url, checkpoint.name)


@pytest.fixture
def gateways(
    stack: EmbeddedStack, app_database: str, vllm_server: VllmServer, tmp_path: Path
) -> Iterator[list[GatewayServer]]:
    replicas = []
    for index in range(2):
        settings = Settings(
            data_dir=tmp_path / f"gateway-{index}",
            database_url=app_database,
            vllm_urls=[vllm_server.url],
        )
        replicas.append(GatewayServer(settings).start())
        include_routers(replicas[-1].app)
    yield replicas
    for replica in replicas:
        replica.stop()


def served_model(gateway: GatewayServer, key: str) -> str:
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={**bearer(key), "X-Session-Id": "s-admin", "X-Request-Id": uuid.uuid4().hex},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    model: str = response.json()["model"]
    return model


def wait_until_served(gateways: list[GatewayServer], key: str, model: str) -> float:
    """Seconds until every replica answers with `model`; fails past the deadline."""
    started = time.monotonic()
    pending = list(gateways)
    while pending:
        pending = [g for g in pending if served_model(g, key) != model]
        elapsed = time.monotonic() - started
        assert elapsed < CHANGE_DEADLINE_S, f"{len(pending)} gateway(s) still not serving {model}"
        if pending:
            time.sleep(0.1)
    return time.monotonic() - started


def test_promote_and_rollback_reach_every_gateway_within_seconds(
    gateways: list[GatewayServer],
    canary_name: str,
    make_key: Callable[..., str],
) -> None:
    ide, ops = make_key(Role.ide), make_key(Role.ops)
    first, second = gateways
    assert {served_model(g, ide) for g in gateways} == {"base"}

    promoted = httpx.post(
        f"{first.url}/admin/checkpoints/{canary_name}/promote", headers=bearer(ops), timeout=30
    )
    assert promoted.status_code == 200, promoted.text
    wait_until_served(gateways, ide, canary_name)

    rolled_back = httpx.post(f"{second.url}/admin/rollback", headers=bearer(ops), timeout=30)
    assert rolled_back.status_code == 200, rolled_back.text
    assert rolled_back.json()["after"]["production"] == "base"
    wait_until_served(gateways, ide, "base")


def test_a_promotion_loads_the_checkpoint_into_a_vllm_that_wants_a_key(
    registry: Engine,
    app_database: str,
    keyed_vllm_server: VllmServer,
    lora_dir: Path,
    make_key: Callable[..., str],
    tmp_path: Path,
) -> None:
    vllm, key = keyed_vllm_server, keyed_vllm_server.api_key
    checkpoint = publish_checkpoint(
        registry,
        lora_dir,
        parent="base",
        replicas=[vllm.url],
        checkpoints_dir=tmp_path / "checkpoints",
        base_model="tiny-base",
        api_key=key,
    )
    unload_adapter(vllm.url, checkpoint.name, api_key=key)  # as a replica that restarted
    settings = Settings(
        data_dir=tmp_path / "gateway",
        database_url=app_database,
        vllm_urls=[vllm.url],
        vllm_api_key=SecretStr(key),
    )
    gateway = GatewayServer(settings).start()
    try:
        ide, ops = make_key(Role.ide), make_key(Role.ops)
        promoted = httpx.post(
            f"{gateway.url}/admin/checkpoints/{checkpoint.name}/promote",
            headers=bearer(ops),
            timeout=60,
        )
        assert promoted.status_code == 200, promoted.text
        assert checkpoint.name in served_adapters(vllm.url, api_key=key)
        wait_until_served([gateway], ide, checkpoint.name)
    finally:
        gateway.stop()
        unload_adapter(vllm.url, checkpoint.name, api_key=key)
