"""The official `openai` client against the gateway on a real socket, vLLM behind it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest
import redis
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import Engine, select

from app.config import Settings
from app.db import session_scope
from app.events import COMPLETIONS_TOPIC, CompletionEvent
from app.gateway.service import request_key
from app.main import create_app
from app.models import Checkpoint, CheckpointStatus
from app.processes import free_port
from tests.conftest import past_the_context
from workers.config import WorkerConfig
from workers.store import sample_row, store_events

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Replace a file's content.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    }
]
# A conversation that already went through one tool call; the session's vLLM has no tool
# parser, so the model is asked not to call another (tool_choice="none").
TOOL_HISTORY = [
    {"role": "user", "content": "Fix the typo in a.py"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "edit_file", "arguments": '{"path": "a.py", "content": "x"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
]
MESSAGES = [{"role": "user", "content": "Write f(x) that returns x plus 3."}]


def production(engine: Engine) -> str:
    with session_scope(engine) as session:
        return session.scalar(
            select(Checkpoint.name).where(Checkpoint.status == CheckpointStatus.production)
        )


def client_for(server: Any, key: str, session: str) -> OpenAI:
    return OpenAI(
        api_key=key,
        base_url=f"{server.url}/v1",
        default_headers={"X-Session-Id": session},
        max_retries=0,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def test_non_streaming_completion_is_answered_and_logged_once(
    gateway_server: Any, ide_key: str, kafka: Any, registry: Engine
) -> None:
    session, request_id = new_id("s"), new_id("r")
    client = client_for(gateway_server, ide_key, session)
    since = kafka.end_offsets(COMPLETIONS_TOPIC)

    raw = client.chat.completions.with_raw_response.create(
        model="whatever-the-ide-says",
        messages=MESSAGES,
        max_tokens=8,
        extra_headers={"X-Request-Id": request_id},
    )
    completion = raw.parse()

    served_by = production(registry)
    assert completion.model == served_by
    assert raw.headers["x-request-id"] == request_id
    assert raw.headers["x-rtrl-checkpoint"] == served_by
    body = raw.http_response.json()
    assert body["choices"][0]["logprobs"] is None
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body

    events = kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
    mine = [event for event in events if event["request_id"] == request_id]
    assert len(mine) == 1
    event = mine[0]
    assert event["_key"] == session and event["session_id"] == session
    assert event["checkpoint"] == served_by and event["arm"] is None and not event["fallback"]
    assert event["status"] == "ok" and event["finish_reason"] == "length"
    assert event["completion_text"] == completion.choices[0].message.content
    assert len(event["completion_token_ids"]) == completion.usage.completion_tokens == 8
    assert len(event["behaviour_logprobs"]) == 8
    assert all(logprob <= 0 for logprob in event["behaviour_logprobs"])
    assert len(event["prompt_token_ids"]) == completion.usage.prompt_tokens
    assert event["prompt_messages"] == MESSAGES
    assert event["edit_requested"] is True
    # A whole answer's first token is timed by vLLM: before the end, by its decode time (it
    # was charged the whole latency, so the time-to-first-token penalty grew with length).
    assert event["ttft_measured"] and event["latency_ms"] > event["ttft_ms"] > 0
    assert "metrics" not in body
    assert len(event["user_hash"]) == 64


def test_streaming_completion_relays_chunks_and_logs_the_whole_answer(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    session, request_id = new_id("s"), new_id("r")
    client = client_for(gateway_server, ide_key, session)
    since = kafka.end_offsets(COMPLETIONS_TOPIC)

    stream = client.chat.completions.create(
        model="rtrl",
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        extra_headers={"X-Request-Id": request_id, "X-Rtrl-Edit-Request": "0"},
    )
    chunks = list(stream)

    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert all(chunk.choices[0].logprobs is None for chunk in chunks if chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    event = next(
        e
        for e in kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
        if e["request_id"] == request_id
    )
    assert event["completion_text"] == text
    assert len(event["completion_token_ids"]) == len(event["behaviour_logprobs"]) == 12
    assert event["prompt_token_ids"] and event["edit_requested"] is False
    assert 0 < event["ttft_ms"] <= event["latency_ms"]


@pytest.mark.parametrize("stream", [False, True])
def test_tools_and_tool_history_pass_through(
    gateway_server: Any, ide_key: str, kafka: Any, stream: bool
) -> None:
    session, request_id = new_id("s"), new_id("r")
    client = client_for(gateway_server, ide_key, session)
    since = kafka.end_offsets(COMPLETIONS_TOPIC)

    answer = client.chat.completions.create(
        model="rtrl",
        messages=TOOL_HISTORY,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=6,
        stream=stream,
        extra_headers={"X-Request-Id": request_id},
    )
    # Served as text (tool_choice "none"): the agent-trained model may stop after the tool
    # result before its six tokens are up.
    if stream:
        reasons = [
            c.choices[0].finish_reason for c in answer if c.choices and c.choices[0].finish_reason
        ]
        assert reasons and reasons[-1] in {"stop", "length"}
    else:
        assert answer.choices[0].finish_reason in {"stop", "length"}

    event = next(
        e
        for e in kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
        if e["request_id"] == request_id
    )
    # The history's call reached the model and the log as the client sent it. (What the
    # model writes within six tokens is its own: vLLM's streaming parser may read a call
    # even under tool_choice "none".)
    assert event["prompt_messages"][1]["tool_calls"][0]["function"]["name"] == "edit_file"


def test_logprobs_reach_the_client_only_when_asked_for(gateway_server: Any, ide_key: str) -> None:
    client = client_for(gateway_server, ide_key, new_id("s"))
    completion = client.chat.completions.create(
        model="rtrl", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.content) == 4
    assert all(len(token.top_logprobs) == 2 for token in logprobs.content)


def test_a_seeded_request_cannot_take_the_cpu_engine_down(
    gateway_server: Any, ide_key: str
) -> None:
    client = client_for(gateway_server, ide_key, new_id("s"))
    seeded = client.chat.completions.create(model="rtrl", messages=MESSAGES, max_tokens=4, seed=7)
    assert seeded.choices[0].message.content is not None
    after = client.chat.completions.create(model="rtrl", messages=MESSAGES, max_tokens=4)
    assert after.choices[0].message.content is not None


def test_privacy_mode_logs_no_content(gateway_server: Any, ide_key: str, kafka: Any) -> None:
    request_id = new_id("r")
    client = client_for(gateway_server, ide_key, new_id("s"))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)

    client.chat.completions.create(
        model="rtrl",
        messages=MESSAGES,
        max_tokens=4,
        extra_headers={"X-Request-Id": request_id, "X-Rtrl-Privacy": "1"},
    )

    event = next(
        e
        for e in kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
        if e["request_id"] == request_id
    )
    assert event["privacy"] is True
    for content in (
        "prompt_messages",
        "prompt_token_ids",
        "completion_token_ids",
        "behaviour_logprobs",
        "completion_text",
    ):
        assert event[content] is None
    assert event["completion_chars"] > 0


def test_models_lists_the_routed_model(gateway_server: Any, ide_key: str) -> None:
    models = client_for(gateway_server, ide_key, new_id("s")).models.list()
    assert [model.id for model in models.data] == ["rtrl"]


def test_a_reused_request_id_is_refused(gateway_server: Any, ide_key: str) -> None:
    client = client_for(gateway_server, ide_key, new_id("s"))
    request_id = new_id("r")
    ask: dict[str, Any] = {
        "model": "rtrl",
        "messages": MESSAGES,
        "max_tokens": 2,
        "extra_headers": {"X-Request-Id": request_id},
    }
    client.chat.completions.create(**ask)

    with pytest.raises(openai.ConflictError) as refused:
        client.chat.completions.create(**ask)
    assert refused.value.body["code"] == "duplicate_request_id"


def test_a_request_id_is_refused_at_any_age_even_after_redis_forgot_it(
    gateway_server: Any, ide_key: str, kafka: Any, engine: Engine, stack: Any
) -> None:
    session, request_id = new_id("s"), new_id("r")
    client = client_for(gateway_server, ide_key, session)
    ask: dict[str, Any] = {
        "model": "rtrl",
        "messages": MESSAGES,
        "max_tokens": 4,
        "extra_headers": {"X-Request-Id": request_id},
    }
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    client.chat.completions.create(**ask)
    (event,) = [
        e
        for e in kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
        if e["request_id"] == request_id
    ]
    # Long after: the sample is in Postgres, and Redis' reservation has expired.
    with engine.begin() as conn:
        store_events(
            conn,
            [sample_row(as_completion(event))],
            [],
            WorkerConfig(),
            now=datetime.now(UTC),
        )
    reservations = redis.Redis.from_url(stack.redis.url)
    reservations.delete(request_key(request_id))

    with pytest.raises(openai.ConflictError) as refused:
        client.chat.completions.create(**ask)
    assert refused.value.body["code"] == "duplicate_request_id"
    assert reservations.get(request_key(request_id)) is None  # feedback is not redirected
    fresh = client.chat.completions.create(**{**ask, "extra_headers": {}})
    assert fresh.choices


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_id_that_cannot_be_recorded_is_a_503_and_no_sample(
    gateway_settings: Settings, registry: Engine, ide_key: str, kafka: Any, stream: bool
) -> None:
    """Without Redis the id cannot be reserved: served anyway, its feedback would be refused
    forever and it would train as if nothing had happened to it."""
    settings = gateway_settings.model_copy(
        update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    )
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    request_id = new_id("r")
    with TestClient(create_app(settings)) as client:
        answer = client.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 4, "stream": stream},
            headers={
                "Authorization": f"Bearer {ide_key}",
                "X-Session-Id": new_id("s"),
                "X-Request-Id": request_id,
            },
        )
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "request_id_unavailable"
    # The app's exit sent its spool to Kafka: whatever it logged is there now.
    logged = kafka.read(COMPLETIONS_TOPIC, since, timeout=3)
    assert request_id not in {event["request_id"] for event in logged}


ABANDONED_MAX_TOKENS = 900
"""Long enough to be mid-stream when the client leaves: about 2 s of generation here, near
the tiny model's 1,024 positions."""


def abandon_once_the_answer_starts(gateway_server: Any, ide_key: str, kafka: Any) -> dict[str, Any]:
    """Stream a long answer and close the panel as soon as the response starts; the completion
    event logged.

    The client leaves on the response's headers, which the gateway sends once vLLM has taken
    the request, not on its first chunk: on these two cores the whole answer may reach the
    gateway at once (its first token within milliseconds of [DONE], in four of five tries of
    one CI run), and a client that waited for a chunk would then only ever leave a finished
    answer.
    """
    session, request_id = new_id("s"), new_id("r")
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    body = {
        "model": "rtrl",
        "messages": MESSAGES,
        "max_tokens": ABANDONED_MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {
        "Authorization": f"Bearer {ide_key}",
        "X-Session-Id": session,
        "X-Request-Id": request_id,
    }
    with (
        httpx.Client(base_url=gateway_server.url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
    return next(
        e
        for e in kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
        if e["request_id"] == request_id
    )


def test_a_stream_the_client_abandons_is_logged_as_cancelled_and_never_trained(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    """The one way an abandoned stream may be logged whole: the gateway had relayed all of it
    (read [DONE]) before the close reached it, which a stall of this machine through the whole
    generation can cause. That is retried; an answer cut short, or a cancellation never seen
    in five tries, fails."""
    for _ in range(5):
        event = abandon_once_the_answer_starts(gateway_server, ide_key, kafka)
        if event["status"] != "ok":
            break
        assert event["completion_tokens"] == ABANDONED_MAX_TOKENS, event["completion_tokens"]
        print(
            f"relayed whole ({event['latency_ms']:.0f} ms, the first token at "
            f"{event['ttft_ms']:.0f} ms) before the close arrived; again"
        )
    assert event["status"] == "cancelled"
    assert sample_row(as_completion(event))["trainable"] is False


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"X-Session-Id": "has space"}, "X-Session-Id"),
        ({"X-Session-Id": "x" * 129}, "X-Session-Id"),
        ({"X-Request-Id": "a/b"}, "X-Request-Id"),
        ({"X-User-Id": "we;ird"}, "X-User-Id"),
        ({"X-Rtrl-Privacy": "yes"}, "x-rtrl-privacy"),
    ],
)
def test_odd_headers_are_refused(
    gateway_server: Any, ide_key: str, extra: dict[str, str], param: str
) -> None:
    client = client_for(gateway_server, ide_key, new_id("s"))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="rtrl", messages=MESSAGES, max_tokens=2, extra_headers=extra
        )
    assert refused.value.body["param"] == param


def nested_items(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return {"type": "object", "properties": {"path": schema}}


@pytest.mark.parametrize(
    ("parameters", "names"),
    [
        (nested_items(300), "deeper than 32 levels"),  # was a RecursionError: a 500
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}, "#/$defs/gone"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s"}}}, "only '#/"),
    ],
)
def test_a_tool_schema_too_deep_or_pointing_outside_itself_is_a_400_before_vllm(
    gateway_server: Any, ide_key: str, parameters: dict[str, Any], names: str
) -> None:
    tool = {"type": "function", "function": {"name": "read_file", "parameters": parameters}}
    response = httpx.post(
        f"{gateway_server.url}/v1/chat/completions",
        json={"model": "rtrl", "messages": MESSAGES, "tools": [tool], "max_tokens": 2},
        headers={"Authorization": f"Bearer {ide_key}", "X-Session-Id": "s-1"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_value" and names in error["message"]


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"model": "rtrl"}', 400, "invalid_value"),
        (b'{"messages": [], "model": "rtrl"}', 400, "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "sometimes"}', 400, None),
        # Histories a hostile or broken client sends: each was a 500 or a dropped connection.
        (
            b'{"messages": [{"role": "user", "content": "hi"},'
            b' {"role": "assistant", "content": "", "tool_calls": 5}]}',
            400,
            "invalid_value",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"},'
            b' {"role": "tool", "content": "ok", "tool_call_id": []}]}',
            400,
            "invalid_value",
        ),
        (b'{"messages": [{"role": "boss", "content": "hi"}]}', 400, "invalid_value"),
        (b'{"messages": ["hi"]}', 400, "invalid_value"),
        (
            b'{"messages": [{"role": "assistant", "content": "",'
            b' "tool_calls": [{"id": "c1", "function": 3}]}]}',
            400,
            "invalid_value",
        ),
    ],
)
def test_malformed_bodies_get_an_openai_error(
    gateway_server: Any, ide_key: str, content: bytes, status: int, code: str | None
) -> None:
    response = httpx.post(
        f"{gateway_server.url}/v1/chat/completions",
        content=content,
        headers={"Authorization": f"Bearer {ide_key}", "X-Session-Id": "s-1"},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code


def test_a_request_vllm_refuses_is_relayed_and_its_id_can_be_reused(
    gateway_server: Any, ide_key: str
) -> None:
    client = client_for(gateway_server, ide_key, new_id("s"))
    request_id = new_id("r")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="rtrl",
            messages=[{"role": "user", "content": past_the_context("Read this. ")}],
            max_tokens=2,
            extra_headers={"X-Request-Id": request_id},
        )
    assert "maximum context length" in refused.value.message

    retried = client.chat.completions.create(
        model="rtrl", messages=MESSAGES, max_tokens=2, extra_headers={"X-Request-Id": request_id}
    )
    assert retried.choices


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_a_request_for_more_tokens_than_the_cap_is_served_at_the_cap_and_says_so(
    gateway_settings: Settings, start_gateway: Any, ide_key: str, kafka: Any, param: str
) -> None:
    # Coding agents ask for 32,000 by default, and some exit on a 400: clamp, never refuse.
    gateway = start_gateway(gateway_settings.model_copy(update={"max_completion_tokens": 12}))
    session = new_id("s")
    client = client_for(gateway, ide_key, session)
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    request_id = new_id("r")
    served = client.chat.completions.create(
        model="rtrl",
        messages=MESSAGES,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id},
        **{param: 32_000},
    )

    assert served.usage is not None and served.usage.completion_tokens == 12
    assert served.choices[0].finish_reason == "length"
    events = kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
    logged = [event for event in events if event["_key"] == session]
    assert [(e["request_id"], e["max_tokens"], e["max_tokens_asked"]) for e in logged] == [
        (request_id, 12, 32_000)
    ]


def test_oversized_bodies_are_refused_with_413(gateway_server: Any, ide_key: str) -> None:
    limit = gateway_server.settings.max_request_bytes
    big = {"model": "rtrl", "messages": [{"role": "user", "content": "x" * limit}]}
    response = httpx.post(
        f"{gateway_server.url}/v1/chat/completions",
        json=big,
        headers={"Authorization": f"Bearer {ide_key}", "X-Session-Id": "s-1"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"

    def chunks() -> Any:
        # No Content-Length: the limit is enforced as the body streams in.
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    response = httpx.post(
        f"{gateway_server.url}/v1/chat/completions",
        content=chunks(),
        headers={"Authorization": f"Bearer {ide_key}", "X-Session-Id": "s-1"},
    )
    assert response.status_code == 413


def test_unknown_routes_answer_in_the_openai_shape(gateway_server: Any) -> None:
    response = httpx.get(f"{gateway_server.url}/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def as_completion(event: dict[str, Any]) -> CompletionEvent:
    """The event as the worker decodes it (the reader adds the message key as `_key`)."""
    return CompletionEvent.model_validate({k: v for k, v in event.items() if k != "_key"})
