"""The official `anthropic` client against the gateway's Messages API, vLLM behind it."""

from __future__ import annotations

import re
import uuid
from typing import Any

import anthropic
import httpx
import pytest
from anthropic import Anthropic
from sqlalchemy import Engine, select

from app.db import session_scope
from app.events import COMPLETIONS_TOPIC
from app.models import Checkpoint, CheckpointStatus
from tests.conftest import past_the_context

TOOLS: list[dict[str, Any]] = [
    {
        "name": "Read",
        "description": "Read a file of the workspace.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
    },
    {
        "name": "Edit",
        "description": "Replace old_string by new_string in a file.",
        "input_schema": {
            "type": "object",
            "properties": {
                "file_path": {"type": "string"},
                "old_string": {"type": "string"},
                "new_string": {"type": "string"},
            },
            "required": ["file_path", "old_string", "new_string"],
        },
    },
]
TASK = "Fix the bug in calc.py: add() must return a plus b."


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def claude(server: Any, key: str, session: str, *, header: str = "auth_token") -> Anthropic:
    """The client as Claude Code configures it: the base URL without /v1, a bearer token (or,
    with `header="api_key"`, the key in x-api-key), its session header."""
    return Anthropic(
        base_url=server.url,
        **{header: key},
        default_headers={"X-Claude-Code-Session-Id": session},
        max_retries=0,
    )


def production(engine: Engine) -> str:
    with session_scope(engine) as session:
        name = session.scalar(
            select(Checkpoint.name).where(Checkpoint.status == CheckpointStatus.production)
        )
    assert name is not None
    return name


def answer(client: Anthropic, stream: bool, request_id: str, **params: Any) -> Any:
    """One Message, whole or put together from its events by the client's stream helper."""
    params.setdefault("model", "claude-sonnet-4-5")
    params.setdefault("max_tokens", 24)
    headers = {"X-Request-Id": request_id}
    if not stream:
        return client.messages.create(**params, extra_headers=headers)
    with client.messages.stream(**params, extra_headers=headers) as events:
        return events.get_final_message()


def logged(kafka: Any, since: dict[int, int], *request_ids: str) -> dict[str, dict[str, Any]]:
    events = kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests(set(request_ids)))
    return {event["request_id"]: event for event in events if event["request_id"] in request_ids}


def assert_trainable(event: dict[str, Any], message: Any) -> None:
    """The event is a whole sample: what vLLM served, token by token, with its logprobs."""
    assert event["surface"] == "messages" and event["status"] == "ok"
    assert len(event["completion_token_ids"]) == message.usage.output_tokens > 0
    assert len(event["behaviour_logprobs"]) == message.usage.output_tokens
    assert all(logprob <= 0 for logprob in event["behaviour_logprobs"])
    assert len(event["prompt_token_ids"]) == message.usage.input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_answer_is_a_message_logged_as_a_sample(
    gateway_server: Any, ide_key: str, kafka: Any, registry: Engine, stream: bool
) -> None:
    session, request_id = new_id("s"), new_id("r")
    client = claude(gateway_server, ide_key, session, header="api_key")
    since = kafka.end_offsets(COMPLETIONS_TOPIC)

    message = answer(
        client,
        stream,
        request_id,
        system=[{"type": "text", "text": "You fix Python bugs."}],
        messages=[{"role": "user", "content": TASK}],
    )

    served_by = production(registry)
    assert message.id == f"msg_{request_id}" and message.role == "assistant"
    assert message.model == served_by
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in message.content] in (["text"], [])
    event = logged(kafka, since, request_id)[request_id]
    assert event["session_id"] == session and event["checkpoint"] == served_by
    assert_trainable(event, message)
    assert event["completion_text"] == "".join(block.text for block in message.content)
    assert event["prompt_messages"] == [
        {"role": "system", "content": "You fix Python bugs."},
        {"role": "user", "content": TASK},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_round_trip_is_served_and_linked_into_one_run(
    gateway_server: Any, ide_key: str, kafka: Any, stream: bool
) -> None:
    client = claude(gateway_server, ide_key, new_id("s"))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    task = [{"role": "user", "content": TASK}]

    # The tiny test model has not learned to call tools by itself: the tool is named (vLLM
    # then constrains the call to it).
    first_id = new_id("r")
    read = answer(
        client,
        stream,
        first_id,
        messages=task,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "Read"},
        max_tokens=60,
    )
    calls = [block for block in read.content if block.type == "tool_use"]
    assert [call.name for call in calls] == ["Read"] and read.stop_reason == "tool_use"
    # The gateway's tool call id names the request that made it.
    assert calls[0].id == f"call-0-{first_id}"
    assert isinstance(calls[0].input, dict)

    second_id = new_id("r")
    history = [
        *task,
        {"role": "assistant", "content": [block.model_dump() for block in read.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": calls[0].id,
                    "content": [{"type": "text", "text": "def add(a, b):\n    return a - b\n"}],
                }
            ],
        },
    ]
    edit = answer(client, stream, second_id, messages=history, tools=TOOLS, max_tokens=24)
    assert edit.stop_reason in ("end_turn", "max_tokens", "tool_use")

    events = logged(kafka, since, first_id, second_id)
    first, second = events[first_id], events[second_id]
    assert_trainable(first, read)
    assert_trainable(second, edit)
    assert first["tool_calls"] == 1 and first["tools_declared"]
    assert second["parent_request_id"] == first_id
    assert second["trajectory_id"] == first_id and second["turn_index"] == 1
    assert second["prompt_messages"][2] == {
        "role": "tool",
        "tool_call_id": calls[0].id,
        "content": "def add(a, b):\n    return a - b\n",
    }


def test_max_tokens_beyond_the_cap_is_served_at_the_cap(
    gateway_settings: Any, start_gateway: Any, ide_key: str, kafka: Any
) -> None:
    # Claude Code asks for 32,000 by default: clamped, never refused.
    gateway = start_gateway(gateway_settings.model_copy(update={"max_completion_tokens": 12}))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    request_id = new_id("r")

    # Streamed, as Claude Code always asks: the client refuses 32,000 tokens unstreamed.
    message = answer(
        claude(gateway, ide_key, new_id("s")),
        True,
        request_id,
        max_tokens=32_000,
        messages=[{"role": "user", "content": TASK}],
    )

    assert message.usage.output_tokens <= 12
    event = logged(kafka, since, request_id)[request_id]
    assert (event["max_tokens"], event["max_tokens_asked"]) == (12, 32_000)


def test_errors_come_in_anthropic_shape(gateway_server: Any, ide_key: str, make_key: Any) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        claude(gateway_server, "not-a-key", new_id("s")).messages.create(
            model="claude", max_tokens=8, messages=[{"role": "user", "content": TASK}]
        )
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": refused.value.body["error"]["message"],
        },
    }

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(gateway_server, ide_key, new_id("s")).messages.create(
            model="claude",
            max_tokens=8,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": TASK}]}],
        )
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error" and "'image' blocks" in error["message"]

    limited_key = make_key(rate_limit_per_minute=1)
    client = claude(gateway_server, limited_key, new_id("s"))
    with pytest.raises(anthropic.RateLimitError) as refused:
        for _ in range(2):
            client.messages.create(
                model="claude", max_tokens=1, messages=[{"role": "user", "content": TASK}]
            )
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert refused.value.response.headers["retry-after"]

    # The OpenAI routes keep the OpenAI shape.
    response = httpx.post(f"{gateway_server.url}/v1/chat/completions", json={})
    assert response.status_code == 401 and set(response.json()) == {"error"}


def test_a_prompt_longer_than_the_context_is_too_long_in_claude_codes_words(
    gateway_server: Any, ide_key: str
) -> None:
    # Claude Code compacts its history when told "prompt is too long".
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(gateway_server, ide_key, new_id("s")).messages.create(
            model="claude",
            max_tokens=8,
            messages=[{"role": "user", "content": past_the_context("Read this. ")}],
        )
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 131072 maximum", error["message"])


def test_a_claude_code_run_of_three_turns_is_linked_into_one_run(
    gateway_settings: Any, start_gateway: Any, ide_key: str, kafka: Any
) -> None:
    # What Claude Code sends, at the tiny model's scale: system
    # blocks with cache markers, a system message inside `messages` (blocks on the first turn,
    # a string after), fields and beta headers the model cannot honour, streaming always.
    gateway = start_gateway(gateway_settings.model_copy(update={"max_completion_tokens": 160}))
    session = str(uuid.uuid4())
    client = Anthropic(
        base_url=gateway.url,
        auth_token=ide_key,
        default_headers={
            "X-Claude-Code-Session-Id": session,
            "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
            "x-app": "cli",
        },
        max_retries=0,
    )
    cached = {"cache_control": {"type": "ephemeral"}}
    claude_code = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32_000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
            {"type": "text", "text": "You are Claude Code.", **cached},
        ],
        "tools": TOOLS,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": '{"device_id": "c188", "session_id": "bc91"}'},
    }

    def turn(messages: list[dict[str, Any]], **params: Any) -> tuple[str, Any]:
        request_id = new_id("r")
        extra = {name: claude_code[name] for name in ("thinking", "output_config")}
        extra |= {name: claude_code[name] for name in ("context_management", "metadata")}
        with client.messages.stream(
            model=claude_code["model"],
            max_tokens=claude_code["max_tokens"],
            system=claude_code["system"],
            tools=claude_code["tools"],
            messages=messages,
            extra_body=extra,
            extra_headers={"X-Request-Id": request_id},
            **params,
        ) as events:
            return request_id, events.get_final_message()

    def replayed(message: Any) -> dict[str, Any]:
        return {"role": "assistant", "content": [block.model_dump() for block in message.content]}

    def result(message: Any, text: str) -> dict[str, Any]:
        call = next(block for block in message.content if block.type == "tool_use")
        block = {"type": "tool_result", "tool_use_id": call.id, "content": text, **cached}
        return {"role": "user", "content": [block]}

    environment = "Working directory: /repo"
    task = {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>git: clean</system-reminder>"},
            {"type": "text", "text": TASK, **cached},
        ],
    }
    since = kafka.end_offsets(COMPLETIONS_TOPIC)

    first_id, read = turn(
        [{"role": "system", "content": [{"type": "text", "text": environment}]}, task],
        tool_choice={"type": "tool", "name": "Read"},
    )
    history = [
        {"role": "system", "content": environment},
        # The cache marker moves to the newest message.
        {"role": "user", "content": [{"type": "text", "text": b["text"]} for b in task["content"]]},
        replayed(read),
        result(read, "1\tdef add(a, b):\n2\t    return a - b"),
    ]
    second_id, edit = turn(history, tool_choice={"type": "tool", "name": "Edit"})
    history = [*history, replayed(edit), result(edit, "The file calc.py has been updated.")]
    third_id, done = turn(history)

    events = logged(kafka, since, first_id, second_id, third_id)
    first, second, third = events[first_id], events[second_id], events[third_id]
    assert {event["session_id"] for event in events.values()} == {session}
    assert [event["turn_index"] for event in (first, second, third)] == [0, 1, 2]
    assert {event["trajectory_id"] for event in (first, second, third)} == {first_id}
    assert [event["parent_request_id"] for event in (first, second, third)] == [
        None,
        first_id,
        second_id,
    ]
    for event, message in ((first, read), (second, edit), (third, done)):
        assert_trainable(event, message)
        assert (event["max_tokens"], event["max_tokens_asked"]) == (160, 32_000)
    assert first["edit_requested"] and third["edit_requested"]


def test_count_tokens_counts_the_prompt_the_model_is_served(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    client = claude(gateway_server, ide_key, new_id("s"))
    prompt: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "system": [{"type": "text", "text": "You fix Python bugs."}],
        "tools": TOOLS,
        "messages": [{"role": "user", "content": TASK}],
    }
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    request_id = new_id("r")

    counted = client.messages.count_tokens(**prompt)
    served = answer(client, False, request_id, max_tokens=4, **prompt)

    assert counted.input_tokens == served.usage.input_tokens
    assert len(logged(kafka, since, request_id)[request_id]["prompt_token_ids"]) == (
        counted.input_tokens
    )


def test_a_conversation_is_the_same_prompt_on_either_surface(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    # The translation happens at the edge: vLLM is asked the same, token for token.
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    chat_id, messages_id = new_id("r"), new_id("r")
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool["description"],
                "parameters": tool["input_schema"],
            },
        }
        for tool in TOOLS
    ]
    httpx.post(
        f"{gateway_server.url}/v1/chat/completions",
        json={
            "model": "rtrl",
            "max_tokens": 2,
            "tools": tools,
            "messages": [
                {"role": "system", "content": "You fix Python bugs."},
                {"role": "user", "content": TASK},
            ],
        },
        headers={"Authorization": f"Bearer {ide_key}", "X-Request-Id": chat_id},
        timeout=60,
    ).raise_for_status()
    answer(
        claude(gateway_server, ide_key, new_id("s")),
        False,
        messages_id,
        max_tokens=2,
        tools=TOOLS,
        system="You fix Python bugs.",
        messages=[{"role": "user", "content": [{"type": "text", "text": TASK}]}],
    )

    events = logged(kafka, since, chat_id, messages_id)
    chat, messages = events[chat_id], events[messages_id]
    assert (chat["surface"], messages["surface"]) == ("chat", "messages")
    assert chat["prompt_token_ids"] == messages["prompt_token_ids"]
    assert chat["prompt_messages"] == messages["prompt_messages"]
