"""The official `openai` client against the gateway's Responses API, vLLM behind it."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from app.events import COMPLETIONS_TOPIC
from tests.conftest import past_the_context

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run a shell command in the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
        "strict": False,
    },
]
HOSTED = [
    {"type": "web_search", "external_web_access": False},
    {"type": "namespace", "name": "multi_agent_v1", "tools": []},
]
"""Tools Codex declares that the served model cannot run."""
TASK = "Fix the bug in calc.py: add() must return a plus b."


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def codex(server: Any, key: str, thread: str) -> OpenAI:
    """The client as Codex configures it: the base URL with /v1, a bearer key, and its
    thread id as `session-id` and `thread-id`."""
    return OpenAI(
        base_url=f"{server.url}/v1",
        api_key=key,
        default_headers={"session-id": thread, "thread-id": thread, "originator": "codex_exec"},
        max_retries=0,
    )


def respond(client: OpenAI, stream: bool, request_id: str, **params: Any) -> Any:
    """One Response, whole or, streamed, the one its last event carries (as Codex reads it:
    `response.completed`, or `response.incomplete` when the answer ran out of tokens), its
    text checked against the deltas streamed before."""
    params.setdefault("model", "gpt-5.1-codex")
    params.setdefault("max_output_tokens", 24)
    headers = {"X-Request-Id": request_id}
    if not stream:
        return client.responses.create(**params, extra_headers=headers)
    events = list(client.responses.create(**params, stream=True, extra_headers=headers))
    sequence = [event.sequence_number for event in events]
    assert sequence == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    response = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [item.id for item in done] == [item.id for item in response.output]
    return response


def logged(kafka: Any, since: dict[int, int], *request_ids: str) -> dict[str, dict[str, Any]]:
    events = kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests(set(request_ids)))
    return {event["request_id"]: event for event in events if event["request_id"] in request_ids}


def assert_trainable(event: dict[str, Any], response: Any) -> None:
    """The event is a whole sample: what vLLM served, token by token, with its logprobs."""
    assert event["surface"] == "responses" and event["status"] == "ok"
    assert len(event["completion_token_ids"]) == response.usage.output_tokens > 0
    assert len(event["behaviour_logprobs"]) == response.usage.output_tokens
    assert all(logprob <= 0 for logprob in event["behaviour_logprobs"])
    assert len(event["prompt_token_ids"]) == response.usage.input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_answer_is_a_response_logged_as_a_sample(
    gateway_server: Any, ide_key: str, kafka: Any, stream: bool
) -> None:
    thread, request_id = str(uuid.uuid4()), new_id("r")
    since = kafka.end_offsets(COMPLETIONS_TOPIC)

    response = respond(
        codex(gateway_server, ide_key, thread),
        stream,
        request_id,
        instructions="You fix Python bugs.",
        input=[
            {"role": "developer", "content": "Sandbox: workspace-write."},
            {"role": "user", "content": [{"type": "input_text", "text": TASK}]},
        ],
        store=False,
        include=["reasoning.encrypted_content"],
        reasoning={"summary": "auto"},
        extra_body={"prompt_cache_key": thread, "client_metadata": {"thread_id": thread}},
    )

    assert response.id == f"resp_{request_id}" and response.object == "response"
    assert response.status in ("completed", "incomplete")
    event = logged(kafka, since, request_id)[request_id]
    assert event["session_id"] == thread and response.model == event["checkpoint"]
    assert_trainable(event, response)
    assert event["completion_text"] == response.output_text
    assert event["prompt_messages"] == [
        {"role": "system", "content": "You fix Python bugs."},
        {"role": "system", "content": "Sandbox: workspace-write."},
        {"role": "user", "content": TASK},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_codex_shaped_run_is_served_and_linked_into_one_run(
    gateway_settings: Any, start_gateway: Any, ide_key: str, kafka: Any, stream: bool
) -> None:
    # As Codex sends it: developer messages, an environment
    # context, function tools beside hosted ones, the input re-sent with the call as served
    # and its output appended. The cap is within the tiny model's 1,024-token context, and
    # leaves a named call room to close its arguments (at 48 one run's call did not).
    gateway = start_gateway(gateway_settings.model_copy(update={"max_completion_tokens": 160}))
    thread = str(uuid.uuid4())
    client = codex(gateway, ide_key, thread)
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    task: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": "You are Codex."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "<environment_context>/repo"}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]},
    ]
    codex_fields: dict[str, Any] = {
        "tools": [*TOOLS, *HOSTED],
        "parallel_tool_calls": True,
        "store": False,
        "max_output_tokens": 32_000,
    }

    # The tiny test model has not learned to call tools by itself: the tool is named (vLLM
    # then constrains the call to it). Now and then it still writes no call that parses (once
    # in CI): it is asked again, up to three times, each a run of its own.
    for _ in range(3):
        first_id = new_id("r")
        read = respond(
            client,
            stream,
            first_id,
            input=task,
            tool_choice={"type": "function", "name": "exec_command"},
            **codex_fields,
        )
        calls = [item for item in read.output if item.type == "function_call"]
        if calls:
            break
    [call] = calls
    assert call.name == "exec_command" and call.call_id == f"call-0-{first_id}"

    second_id = new_id("r")
    history = [
        *task,
        *(item.model_dump(exclude_none=True) for item in read.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": "def add(a, b): ..."},
    ]
    done = respond(client, stream, second_id, input=history, **codex_fields)
    third_id = new_id("r")
    follow_up = {"type": "message", "role": "user", "content": "Thanks; now run the tests."}
    respond(
        client,
        stream,
        third_id,
        input=[*history, *(item.model_dump(exclude_none=True) for item in done.output), follow_up],
        **codex_fields,
    )

    events = logged(kafka, since, first_id, second_id, third_id)
    first, second, third = events[first_id], events[second_id], events[third_id]
    assert {event["session_id"] for event in events.values()} == {thread}
    assert {event["trajectory_id"] for event in events.values()} == {first_id}
    assert [first["turn_index"], second["turn_index"]] == [0, 1]
    assert (second["parent_request_id"], third["parent_request_id"]) == (first_id, second_id)
    assert first["tool_calls"] == 1 and first["tools_declared"]
    assert_trainable(first, read)
    assert_trainable(second, done)
    # A 32,000-token budget is served at the cap, and the event says what was asked.
    assert (first["max_tokens"], first["max_tokens_asked"]) == (160, 32_000)
    assert second["prompt_messages"][-1] == {
        "role": "tool",
        "tool_call_id": call.call_id,
        "content": "def add(a, b): ...",
    }


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(
    gateway_server: Any, ide_key: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        codex(gateway_server, ide_key, str(uuid.uuid4())).responses.create(
            model="gpt-5.1-codex",
            max_output_tokens=8,
            input=past_the_context("Read this. "),
        )
    assert refused.value.code == "context_length_exceeded"
    assert "exceeds the context window" in refused.value.message


def test_what_cannot_be_served_is_a_clear_400_in_openais_shape(
    gateway_server: Any, ide_key: str
) -> None:
    client = codex(gateway_server, ide_key, str(uuid.uuid4()))
    image = {"type": "input_image", "image_url": "data:image/png;base64,"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model="gpt-5.1-codex",
            input=[{"role": "user", "content": [image, {"type": "input_text", "text": TASK}]}],
        )
    assert "'input_image' parts are not served" in refused.value.message
    assert refused.value.body["param"] == "input[0].content[0]"  # type: ignore[index]

    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model="gpt-5.1-codex", input="Go on.", previous_response_id="resp_earlier"
        )
    assert "stores no responses" in refused.value.message

    response = httpx.post(f"{gateway_server.url}/v1/responses", json={"input": TASK})
    assert response.status_code == 401 and set(response.json()) == {"error"}


def test_a_budget_beyond_the_cap_is_served_within_it(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    # opencode, Kilo and Qwen Code ask 32,000 of any model: served at the gateway's cap (4,096
    # by default), and the event records what was asked.
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    request_id = new_id("r")
    client = OpenAI(base_url=f"{gateway_server.url}/v1", api_key=ide_key, max_retries=0)
    answer = client.chat.completions.create(
        model="rtrl",
        messages=[{"role": "user", "content": TASK}],
        max_tokens=32_000,
        extra_headers={"X-Request-Id": request_id},
    )
    assert answer.choices[0].message is not None
    event = logged(kafka, since, request_id)[request_id]
    assert event["status"] == "ok" and event["max_tokens_asked"] == 32_000
