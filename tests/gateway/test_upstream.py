"""Several vLLM replicas: failover past dead ones, a clear 503 when none answers, and a
bounded wait for a connection when every one is taken."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from pydantic import SecretStr

from app.config import Settings
from app.events import COMPLETIONS_TOPIC
from app.gateway.service import CHAT_PATH, request_key
from app.gateway.upstream import Upstream, UpstreamBusy
from app.http.state import app_state
from app.main import create_app
from app.processes import free_port
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from tests.gateway.conftest import KafkaTopics


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


def long_answer() -> dict[str, Any]:
    # Generated to the length cap past the end of sentence: the stream stays open a while.
    return {
        "messages": [{"role": "user", "content": "Write f(x) that returns x plus 3."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }


def counted(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_a_request_finding_every_vllm_connection_taken_is_a_503_after_the_pool_wait(
    gateway_settings: Settings,
    registry: Any,
    vllm_server: VllmServer,
    ide_key: str,
    stack: EmbeddedStack,
    kafka: KafkaTopics,
) -> None:
    settings = gateway_settings.model_copy(
        update={"upstream_max_connections": 1, "upstream_pool_wait_s": 0.25}
    )
    session = f"s-{uuid.uuid4().hex[:8]}"

    def headers(request_id: str) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {ide_key}",
            "X-Session-Id": session,
            "X-Request-Id": request_id,
        }

    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    connect_errors = (
        "rtrl_upstream_errors_total",
        {"replica": vllm_server.url, "error": "connect"},
    )
    connect_errors_before = counted(*connect_errors)
    busy_before = counted("rtrl_upstream_busy_total")
    holding, done_holding = threading.Event(), threading.Event()

    with TestClient(create_app(settings)) as client:
        upstream = app_state(client.app).gateway.upstream

        async def hold() -> bytes:
            """A long generation, streamed and left unread: it keeps the one connection
            for as long as the test says, however fast vLLM generates."""
            async with upstream.stream(CHAT_PATH, long_answer() | {"model": "base"}) as held:
                assert held.status == 200
                first = await held.response.content.readline()
                holding.set()
                # Let go after a while regardless: a request that waited for it is then
                # served, and the test fails instead of hanging.
                deadline = time.monotonic() + 30
                while not done_holding.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                return first + await held.read()

        held = client.portal.start_task_soon(hold)  # type: ignore[union-attr]
        assert holding.wait(60)
        refused = {}
        try:
            for stream in (False, True):
                request_id = f"r-{uuid.uuid4().hex}"
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                refused[request_id] = client.post(
                    "/v1/chat/completions",
                    json=body | {"stream": stream},
                    headers=headers(request_id),
                )
        finally:
            done_holding.set()
        # Answered while the generation held the connection, not once it let go.
        assert b"data: [DONE]" in held.result(60)
        for answer in refused.values():
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "1"
            error = answer.json()["error"]
            assert error["type"] == "service_unavailable" and error["code"] == "upstream_busy"
            assert "RTRL_UPSTREAM_POOL_WAIT_S" in error["message"]
        assert counted("rtrl_upstream_busy_total") == busy_before + 2
        # The pool is every replica's: a full one is no replica's failure.
        assert counted(*connect_errors) == connect_errors_before

        # Nothing was served for the refused requests: their ids are free, and no event (so
        # no reward record) exists for them.
        cache = redis.Redis.from_url(stack.redis.url)
        assert all(cache.get(request_key(request_id)) is None for request_id in refused)
        # The connection is free again: the same ids are served now, and logged once each.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for request_id in refused:
            served = client.post("/v1/chat/completions", json=body, headers=headers(request_id))
            assert served.status_code == 200, served.text
    events = kafka.read(COMPLETIONS_TOPIC, since, until=KafkaTopics.for_requests(set(refused)))
    logged = [event["request_id"] for event in events if event["_key"] == session]
    assert sorted(logged) == sorted(refused)


def test_a_full_pool_raises_upstream_busy_after_the_wait_and_tries_no_replica(
    vllm_server: VllmServer,
) -> None:
    short = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    connect_errors = (
        "rtrl_upstream_errors_total",
        {"replica": vllm_server.url, "error": "connect"},
    )
    before = counted(*connect_errors)

    async def scenario() -> float:
        upstream = Upstream([vllm_server.url], timeout_s=60, max_connections=1, pool_wait_s=0.3)
        try:
            body = long_answer() | {"model": "base"}
            async with upstream.stream(CHAT_PATH, body) as held:
                assert held.status == 200
                started = time.perf_counter()
                # Bounded here so that a wait for the held stream (which never ends while
                # held) fails the test instead of hanging it.
                with pytest.raises(UpstreamBusy, match="all 1 connections"):
                    await asyncio.wait_for(upstream.post(CHAT_PATH, short), 30)
                with pytest.raises(UpstreamBusy):
                    async with upstream.stream(CHAT_PATH, short | {"stream": True}):
                        pass
                waited = time.perf_counter() - started
            # Released: the pool serves again.
            assert (await upstream.post(CHAT_PATH, short)).status == 200
            return waited
        finally:
            await upstream.aclose()

    waited = asyncio.run(scenario())
    assert waited >= 0.5  # each refusal waited (0.3 s) before it gave up
    assert counted(*connect_errors) == before


def test_an_answer_larger_than_the_gateway_reads_is_a_clear_502_logged_as_failed(
    gateway_settings: Settings,
    registry: Any,
    vllm_server: VllmServer,
    ide_key: str,
    kafka: KafkaTopics,
) -> None:
    # 4 KiB: a 64-token answer with its logprobs and token ids is larger.
    settings = gateway_settings.model_copy(
        update={"vllm_urls": [vllm_server.url], "upstream_max_body_bytes": 4096}
    )
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    request_id = f"r-{uuid.uuid4().hex}"
    with TestClient(create_app(settings)) as client:
        small = ask(client, ide_key)
        large = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Write a long story."}],
                "max_tokens": 64,
                "min_tokens": 64,
            },
            headers={"Authorization": f"Bearer {ide_key}", "X-Request-Id": request_id},
        )
        alive = client.get("/healthz")

    assert small.status_code == 200, small.text
    assert large.status_code == 502, large.text
    error = large.json()["error"]
    assert error["code"] == "upstream_answer_too_large"
    assert "RTRL_UPSTREAM_MAX_BODY_BYTES" in error["message"]
    assert alive.status_code == 200
    # Served and lost on the way: one failed completion, which gets its reward record.
    events = kafka.read(COMPLETIONS_TOPIC, since, until=KafkaTopics.for_requests({request_id}))
    failed = [event for event in events if event["request_id"] == request_id]
    assert [event["status"] for event in failed] == ["error"]


@pytest.mark.parametrize("field", [{"prompt_logprobs": 5}, {"prompt_logprobs": 0}, {"echo": True}])
def test_asking_for_the_prompt_in_the_answer_is_a_400_naming_the_field(
    gateway_for: Any, vllm_server: VllmServer, ide_key: str, field: dict[str, Any]
) -> None:
    client = gateway_for([vllm_server.url])
    answer = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **field},
        headers={"Authorization": f"Bearer {ide_key}"},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == next(iter(field))
    assert "as large as the prompt" in error["message"]
