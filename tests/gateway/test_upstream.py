"""Several vLLM replicas: failover past dead ones, a clear 503 when none answers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import SecretStr

from app.config import Settings
from app.embedded.process import free_port
from app.embedded.stack import EmbeddedStack
from app.gateway.service import request_key
from app.main import create_app
from app.serving.vllm import VllmServer


def dead_replica() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def gateway_for(gateway_settings: Settings, registry: Any) -> Iterator[Any]:
    clients: list[TestClient] = []

    def start(replicas: list[str]) -> TestClient:
        settings = gateway_settings.model_copy(update={"vllm_urls": replicas})
        clients.append(TestClient(create_app(settings)).__enter__())
        return clients[-1]

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def ask(
    client: TestClient, key: str, *, stream: bool = False, request_id: str | None = None
) -> Any:
    return client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream},
        headers={
            "Authorization": f"Bearer {key}",
            "X-Session-Id": "s-upstream",
            "X-Request-Id": request_id or f"r-{uuid.uuid4().hex}",
        },
    )


def test_requests_fail_over_past_a_dead_replica(
    gateway_for: Any, vllm_server: VllmServer, ide_key: str
) -> None:
    client = gateway_for([dead_replica(), vllm_server.url, dead_replica()])

    answers = [ask(client, ide_key, stream=n % 2 == 1) for n in range(6)]

    assert [answer.status_code for answer in answers] == [200] * 6
    metrics = client.get("/metrics").text
    assert 'rtrl_upstream_errors_total{error="connect"' in metrics
    assert client.get("/readyz").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_no_replica_answering_is_a_503_and_frees_the_request_id(
    gateway_for: Any, ide_key: str, stack: EmbeddedStack, stream: bool
) -> None:
    client = gateway_for([dead_replica(), dead_replica()])
    request_id = f"r-{uuid.uuid4().hex}"

    answer = ask(client, ide_key, stream=stream, request_id=request_id)

    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    error = answer.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "upstream_unavailable"
    assert redis.Redis.from_url(stack.redis.url).get(request_key(request_id)) is None
    # Every gateway shares the replicas: this one stays in the load balancer, and says why
    # its requests fail.
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["failing"] == [] and ready.json()["degraded"] == ["vllm"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_sends_the_vllm_api_key_and_never_blames_the_client_for_a_wrong_one(
    gateway_settings: Settings,
    registry: Any,
    keyed_vllm_server: VllmServer,
    ide_key: str,
    stack: EmbeddedStack,
    stream: bool,
) -> None:
    keyed = gateway_settings.model_copy(
        update={
            "vllm_urls": [keyed_vllm_server.url],
            "vllm_api_key": SecretStr(keyed_vllm_server.api_key),
        }
    )
    with TestClient(create_app(keyed)) as client:
        answer = ask(client, ide_key, stream=stream)
        assert answer.status_code == 200, answer.text
        assert client.get("/readyz").json()["degraded"] == []

    keyless = keyed.model_copy(update={"vllm_api_key": SecretStr("")})
    request_id = f"r-{uuid.uuid4().hex}"
    with TestClient(create_app(keyless)) as client:
        refused = ask(client, ide_key, stream=stream, request_id=request_id)
    # The client's own key was good: a 502 of the gateway's, not vLLM's 401.
    assert refused.status_code == 502, refused.text
    assert refused.json()["error"]["message"] == "The model server refused the gateway."
    assert redis.Redis.from_url(stack.redis.url).get(request_key(request_id)) is None
