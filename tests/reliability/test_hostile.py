"""Hostile input against a running gateway: every route, fuzzed from its own OpenAPI
document, answers without a 5xx and in its documented shape; bad bodies, headers, filters
and keys get clear refusals; privacy-mode content is found nowhere afterwards."""

from __future__ import annotations

import re
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from kafka import KafkaConsumer, TopicPartition
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)
from sqlalchemy import Engine, func, select, text

from app.auth.service import new_api_key
from app.db import session_scope
from app.kafka.admin import DEFAULT_TOPICS
from app.models import ApiKey, Role, Sample
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from tests.reliability.conftest import Loop, make_key, open_loop

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hostile(
    engine: Engine,
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Loop]:
    """One gateway and worker for the whole module: fuzzing is many short requests."""
    # Every route is tried with bad keys from this one address: lift the failed-login limit
    # (tested in tests/auth) so each answer shows the route's own check. The fuzzer's bodies
    # of the model routes are served: each answer is held to 32 tokens (the cap's clamping is
    # tested with the surfaces), so many of them take seconds, not minutes.
    loop = open_loop(
        engine,
        stack,
        vllm_server,
        tiny_model_dir,
        tmp_path_factory.mktemp("hostile"),
        auth_failures_per_minute=100_000,
        max_completion_tokens=32,
    )
    try:
        yield loop
    finally:
        loop.stop()
        # Fuzzed admin calls may have paused training or asked for a cycle.
        with engine.begin() as connection:
            connection.execute(text("TRUNCATE control_flags"))


@pytest.fixture(scope="module")
def keys(hostile: Loop) -> dict[str, str]:
    return {
        "ide": hostile.ide_key,
        "ops": make_key(hostile.engine, Role.ops),
        "analyst": make_key(hostile.engine, Role.analyst),
    }


def role_for(path: str) -> str:
    if path.startswith("/admin"):
        return "ops"
    if path.startswith("/analytics") or path.startswith("/dashboard"):
        return "analyst"
    return "ide"


FUZZ_CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


def fuzz(operation: Any, headers: dict[str, str]) -> None:
    """Hypothesis-generated calls of one operation; raises on the first failing check."""

    @given(case=operation.as_strategy())
    @settings(
        max_examples=15,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def call(case: Any) -> None:
        session = {"X-Session-Id": f"fuzz-{uuid.uuid4().hex[:12]}"}
        case.call_and_validate(headers=headers | session, timeout=60, checks=FUZZ_CHECKS)

    call()


def test_every_route_survives_fuzzing_without_a_5xx_or_a_schema_violation(
    hostile: Loop, keys: dict[str, str]
) -> None:
    schema = schemathesis.openapi.from_url(f"{hostile.url}/openapi.json")
    failures: dict[str, str] = {}
    fuzzed = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        try:
            fuzz(operation, {"Authorization": f"Bearer {keys[role_for(operation.path)]}"})
        except Exception as exc:  # every route is fuzzed; the failures are listed together
            failures[f"{operation.method.upper()} {operation.path}"] = str(exc)[:1500]
        fuzzed += 1
    assert fuzzed >= 30
    assert not failures, "\n\n".join(f"{route}: {error}" for route, error in failures.items())


def raw_request(url: str, request: bytes) -> tuple[int, bytes]:
    """Bytes on the wire, for what an HTTP client library refuses to send."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(request)
        response = b""
        while chunk := connection.recv(65536):
            response += chunk
            if b"\r\n\r\n" in response:
                head, _, body = response.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                if length and len(body) >= int(length.group(1)):
                    break
    status = int(response.split(b" ", 2)[1])
    return status, response


def chat_request(key: str, body: bytes, session_id: bytes = b"s-1") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\n"
        b"X-Session-Id: " + session_id + b"\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
    )


def samples_count(engine: Engine) -> int:
    with session_scope(engine) as session:
        return session.scalar(select(func.count()).select_from(Sample)) or 0


def settled_samples_count(engine: Engine, quiet_s: float = 3.0, timeout_s: float = 60.0) -> int:
    """The samples count once it has not moved for `quiet_s`: what earlier tests served (the
    fuzzer's model calls among them) is stored, so a test that asserts it stores nothing
    starts from a count that is not still rising."""
    deadline = time.monotonic() + timeout_s
    count, since = samples_count(engine), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.5)
        now = samples_count(engine)
        if now != count:
            count, since = now, time.monotonic()
    return count


def test_invalid_utf8_and_oversized_bodies_are_refused_and_log_nothing(
    hostile: Loop, keys: dict[str, str]
) -> None:
    before = settled_samples_count(hostile.engine)
    bad_utf8 = b'{"model": "rtrl", "messages": [{"role": "user", "content": "\xff\xfe\xc3("}]}'
    status, response = raw_request(hostile.url, chat_request(keys["ide"], bad_utf8))
    assert status == 400 and b'"error"' in response, response[:500]

    huge = orjson.dumps(
        {"model": "rtrl", "messages": [{"role": "user", "content": "x" * 2_000_000}]}
    )
    response = httpx.post(
        f"{hostile.url}/v1/chat/completions",
        content=huge,
        headers={"Authorization": f"Bearer {keys['ide']}", "X-Session-Id": "s-big"},
        timeout=30,
    )
    assert response.status_code == 413 and "error" in response.json()

    event = {"kind": "session_end", "session_id": "s", "request_id": "r"}
    too_many = {"events": [event] * (hostile.settings.max_feedback_batch + 1)}
    response = httpx.post(
        f"{hostile.url}/v1/feedback",
        json=too_many,
        headers={"Authorization": f"Bearer {keys['ide']}"},
        timeout=30,
    )
    assert response.status_code in (413, 422), response.text
    assert "error" in response.json() or "detail" in response.json()
    time.sleep(2)
    assert samples_count(hostile.engine) == before


@pytest.mark.parametrize(
    "session_id",
    [
        b"s-1\rX-Injected: yes",  # a bare CR: header splitting
        b"s-1\x00",  # NUL
        b"s-1\x7f\x1b[31m",  # terminal escapes for whoever tails the log
        "s-1-\u00e9\u4e2d".encode(),  # non-ASCII bytes
        b"' OR '1'='1",
        b"x" * 4096,
    ],
)
def test_injected_session_ids_are_refused_and_never_echoed(
    hostile: Loop, keys: dict[str, str], session_id: bytes
) -> None:
    body = orjson.dumps({"model": "rtrl", "messages": [{"role": "user", "content": "hi"}]})
    status, response = raw_request(hostile.url, chat_request(keys["ide"], body, session_id))
    assert 400 <= status < 500, response[:300]
    head = response.partition(b"\r\n\r\n")[0]
    assert b"X-Injected" not in head and session_id not in head


SQL_PAYLOADS = [
    "' OR '1'='1",
    "1; DROP TABLE samples; --",
    "ckpt-1' UNION SELECT key_hash FROM api_keys --",
    "%' AND pg_sleep(5) IS NULL --",
    "\\x00\\",
    "$$; SELECT 1; $$",
]


def test_sql_metacharacters_in_every_analytics_filter_change_nothing(
    hostile: Loop, keys: dict[str, str]
) -> None:
    document = httpx.get(f"{hostile.url}/openapi.json", timeout=10).json()
    with session_scope(hostile.engine) as session:
        key_count = session.scalar(select(func.count()).select_from(ApiKey))
    before = settled_samples_count(hostile.engine)
    tried = 0
    for path, operations in document["paths"].items():
        if not path.startswith("/analytics"):
            continue
        for method, operation in operations.items():
            parameters = operation.get("parameters", [])
            for parameter in parameters:
                for payload in SQL_PAYLOADS:
                    filled = {
                        p["name"]: (payload if p is parameter else "1")
                        for p in parameters
                        if p["in"] == "path"
                    }
                    query = {parameter["name"]: payload} if parameter["in"] == "query" else {}
                    started = time.monotonic()
                    response = httpx.request(
                        method,
                        f"{hostile.url}{path.format(**filled)}",
                        params=query,
                        headers={"Authorization": f"Bearer {keys['analyst']}"},
                        timeout=30,
                    )
                    tried += 1
                    assert response.status_code < 500, (path, parameter["name"], payload)
                    assert response.status_code in (200, 400, 404, 422), response.text
                    # No key hash (64 hex digits) came back from a UNION or anything else.
                    assert not re.search(r"\b[0-9a-f]{64}\b", response.text), response.text
                    assert time.monotonic() - started < 5, "pg_sleep ran"
    assert tried >= 20
    with session_scope(hostile.engine) as session:
        assert session.scalar(select(func.count()).select_from(ApiKey)) == key_count
    assert samples_count(hostile.engine) == before


def protected_routes(url: str) -> list[tuple[str, str]]:
    document = httpx.get(f"{url}/openapi.json", timeout=10).json()
    return [
        (method.upper(), re.sub(r"\{[^}]+\}", "1", path))
        for path, operations in document["paths"].items()
        if path.startswith(("/admin", "/analytics"))
        for method in operations
    ]


def test_every_admin_and_analytics_route_refuses_bad_and_wrong_role_keys(
    hostile: Loop, keys: dict[str, str]
) -> None:
    engine = hostile.engine
    now = datetime.now(UTC)
    with session_scope(engine) as session:
        revoked, revoked_secret = new_api_key(name="revoked", role=Role.ops)
        revoked.revoked_at = now - timedelta(minutes=1)
        expired, expired_secret = new_api_key(
            name="expired", role=Role.ops, expires_at=now - timedelta(minutes=1)
        )
        session.add_all([revoked, expired])
    routes = protected_routes(hostile.url)
    assert len(routes) >= 25
    for method, path in routes:
        wrong_role = keys["ide"] if path.startswith("/analytics") else keys["analyst"]
        for secret, expected in (
            (None, 401),
            ("rtrl_not-a-key", 401),
            (revoked_secret, 401),
            (expired_secret, 401),
            (wrong_role, 403),
        ):
            headers = {"Authorization": f"Bearer {secret}"} if secret else {}
            response = httpx.request(
                method, f"{hostile.url}{path}", headers=headers, json={}, timeout=30
            )
            assert response.status_code == expected, (method, path, secret, response.text)


def kafka_payloads(bootstrap: str) -> bytes:
    """Every message on every rtrl topic, concatenated."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        partitions = [
            TopicPartition(topic, p)
            for topic in DEFAULT_TOPICS
            for p in consumer.partitions_for_topic(topic) or ()
        ]
        consumer.assign(partitions)
        consumer.seek_to_beginning()
        ends = consumer.end_offsets(partitions)
        seen = b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
            consumer.position(tp) < end for tp, end in ends.items()
        ):
            for records in consumer.poll(timeout_ms=500).values():
                seen += b"".join((r.value or b"") + (r.key or b"") for r in records)
        return seen
    finally:
        consumer.close()


def database_text(engine: Engine) -> str:
    """Every row of every table, as text."""
    with engine.connect() as connection:
        tables = connection.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ).scalars()
        return "\n".join(
            str(row[0])
            for table in list(tables)
            for row in connection.execute(text(f'SELECT t::text FROM "{table}" t'))
        )


def test_privacy_mode_content_is_nowhere_kafka_postgres_or_logs(hostile: Loop) -> None:
    marker = f"PRIVATE{uuid.uuid4().hex[:10]}"
    key = make_key(hostile.engine, Role.ide, privacy_mode=True)
    headers = {
        "Authorization": f"Bearer {key}",
        "X-Session-Id": f"priv-{uuid.uuid4().hex[:12]}",
        "X-Request-Id": f"priv-{uuid.uuid4().hex[:8]}",
    }
    response = httpx.post(
        f"{hostile.url}/v1/chat/completions",
        json={
            "model": "rtrl",
            "messages": [{"role": "user", "content": f"Write f(x) for {marker} please."}],
            "max_tokens": 24,
        },
        headers=headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    request_id = headers["X-Request-Id"]
    feedback = httpx.post(
        f"{hostile.url}/v1/feedback",
        json={
            "events": [
                {
                    "kind": "followup_message",
                    "session_id": headers["X-Session-Id"],
                    "request_id": request_id,
                    "message": f"that is wrong, {marker} is broken",
                },
                {
                    "kind": "session_end",
                    "session_id": headers["X-Session-Id"],
                    "request_id": request_id,
                },
            ]
        },
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert feedback.status_code == 202, feedback.text

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with session_scope(hostile.engine) as session:
            sample = session.scalar(select(Sample).where(Sample.request_id == request_id))
            if sample is not None:
                assert sample.privacy and not sample.trainable
                break
        time.sleep(0.5)
    else:
        pytest.fail("the privacy-mode completion was never stored")
    time.sleep(2)  # the follow-up is stored by the same worker, just after

    assert marker.encode() not in kafka_payloads(hostile.settings.kafka_bootstrap_servers)
    assert marker not in database_text(hostile.engine)
    for log in (hostile.root / "logs").glob("*.log"):
        assert marker not in log.read_text(errors="replace"), log.name


@pytest.mark.parametrize("behind_proxy", [True, False])
def test_a_guesser_behind_the_load_balancer_locks_out_only_itself(
    engine: Engine,
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path: Path,
    behind_proxy: bool,
) -> None:
    # Every request reaches the gateway from 127.0.0.1, as from a load balancer; with the
    # balancer trusted, X-Forwarded-For names the client. Before, 3 bad keys from anyone
    # behind it answered 429 to every user of that gateway.
    loop = open_loop(
        engine,
        stack,
        vllm_server,
        tiny_model_dir,
        tmp_path,
        auth_failures_per_minute=3,
        trusted_proxies="127.0.0.1" if behind_proxy else "",
    )
    try:

        def models(key: str, client: str) -> int:
            return httpx.get(
                f"{loop.url}/v1/models",
                headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": client},
            ).status_code

        in_use = loop.ide_key
        assert models(in_use, "198.51.100.2") == 200
        # Failures are counted per clock minute: start the guesses well inside one, so the
        # window does not turn over between the third and the fourth.
        if (second := datetime.now(UTC).second) > 45:
            time.sleep(61 - second)
        for n in range(3):
            assert models(f"rtrl_guess-{n}", "203.0.113.7") == 401
        assert models("rtrl_guess-next", "203.0.113.7") == 429
        # A key in use is never held back by others' failures, whatever the header says.
        assert models(in_use, "198.51.100.2") == 200
        fresh = make_key(engine, Role.ide)
        if behind_proxy:
            assert models(fresh, "198.51.100.9") == 200  # another client: its own window
            assert models("rtrl_guess-other", "198.51.100.9") == 401
        else:
            # Untrusted, the header names nobody: every client is the peer, which waits.
            assert models(fresh, "198.51.100.9") == 429
    finally:
        loop.stop()
