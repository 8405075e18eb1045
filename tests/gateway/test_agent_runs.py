"""Agent runs through the gateway: tools served, turns linked into one trajectory."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from redis.asyncio import Redis
from sqlalchemy import Engine, select

from app.abtest.assignment import hash_user
from app.auth.service import hash_secret
from app.db import session_scope
from app.events import COMPLETIONS_TOPIC
from app.gateway.trajectories import Trajectories, run_owner
from app.http.state import app_state
from app.models import ApiKey
from rtrl.embedded.stack import EmbeddedStack

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Replace old_string by new_string in a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old_string": {"type": "string"},
                    "new_string": {"type": "string"},
                },
                "required": ["path", "old_string", "new_string"],
            },
        },
    },
]
TASK = [{"role": "user", "content": "Fix f in a.py so that it returns x plus 3."}]
OTHER_TASK = [{"role": "user", "content": "Fix g in b.py so that it returns x times 2."}]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def agent(server: Any, key: str, session: str) -> OpenAI:
    """The official client, as an IDE agent configures it for one session."""
    return OpenAI(
        api_key=key,
        base_url=f"{server.url}/v1",
        default_headers={"X-Session-Id": session},
        max_retries=0,
    )


def ask(
    client: OpenAI,
    messages: list[dict[str, Any]],
    stream: bool,
    headers: dict[str, str] | None = None,
    max_tokens: int = 160,
    **options: Any,
) -> Any:
    """One turn, as the agent sees it: the assistant message (content and tool calls)."""
    request_id = new_id("r")
    answer = client.chat.completions.create(
        model="rtrl",
        messages=messages,
        tools=TOOLS,
        max_tokens=max_tokens,
        stream=stream,
        extra_headers={"X-Request-Id": request_id, **(headers or {})},
        **options,
    )
    if not stream:
        return request_id, answer.choices[0].message.model_dump(exclude_none=True)
    content, calls = "", {}
    for chunk in answer:
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(
                delta_call.index,
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["id"] = delta_call.id or call["id"]
            if delta_call.function and delta_call.function.name:
                call["function"]["name"] += delta_call.function.name
            if delta_call.function and delta_call.function.arguments:
                call["function"]["arguments"] += delta_call.function.arguments
        if chunk.choices and chunk.choices[0].delta.content:
            content += chunk.choices[0].delta.content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return request_id, message


def placed(
    stack: EmbeddedStack, owner: str, messages: list[dict[str, Any]], expected: tuple[str, int]
) -> tuple[str, int]:
    """Where the gateway would place a request of `owner` with these messages, asked until it
    is `expected` or for 5 s: the turn's memory is written as its answer goes out, not waited
    for (a next turn that looks first looks again once its own answer is in, which the
    events below check), so on a loaded machine it may land just after the client is done."""

    async def place() -> tuple[str, int]:
        async with Redis(port=stack.redis.port) as redis:
            placement = await Trajectories(redis).place(owner, new_id("probe"), messages, None)
        return placement.trajectory_id, placement.turn_index

    deadline = time.monotonic() + 5
    found = asyncio.run(place())
    while found != expected and time.monotonic() < deadline:
        time.sleep(0.05)
        found = asyncio.run(place())
    return found


def owner_of(server: Any, registry: Engine, key: str) -> str:
    """Whose runs the requests of `key` continue (it sends no X-User-Id: the user is the key)."""
    with session_scope(registry) as session:
        key_id = session.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_secret(key)))
    assert key_id is not None
    secret = server.settings.user_hash_secret.get_secret_value()
    return run_owner(key_id, hash_user(secret, str(key_id)))


def results_of(message: dict[str, Any], result: str) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "tool_call_id": call["id"], "content": result}
        for call in message.get("tool_calls") or []
    ]


def use(tool: str) -> dict[str, Any]:
    """A `tool_choice` naming the tool (vLLM then constrains the call to it)."""
    return {"type": "function", "function": {"name": tool}}


def logged(kafka: Any, since: dict[int, int], *request_ids: str) -> dict[str, dict[str, Any]]:
    """The completion events of these requests, by request id."""
    events = kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests(set(request_ids)))
    return {e["request_id"]: e for e in events}


@pytest.mark.parametrize("stream", [False, True])
def test_a_three_turn_agent_run_is_served_and_linked_turn_by_turn(
    gateway_server: Any,
    ide_key: str,
    kafka: Any,
    stack: EmbeddedStack,
    registry: Engine,
    stream: bool,
) -> None:
    client = agent(gateway_server, ide_key, new_id("s"))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)

    # The tiny test model has not learned to call tools by itself, so the first two turns
    # name the tool (vLLM then constrains the call); the third leaves the choice to it.
    first_id, read = ask(
        client,
        TASK,
        stream,
        tool_choice=use("read_file"),
    )
    assert read["tool_calls"][0]["function"]["name"] == "read_file"
    history = [*TASK, read, *results_of(read, "def f(x):\n    return x + 2\n")]
    # The turn is findable as the agent has its answer: a next turn sent at once continues
    # the run rather than starting a new one.
    owner = owner_of(gateway_server, registry, ide_key)
    assert placed(stack, owner, history, (first_id, 1)) == (first_id, 1)
    second_id, edit = ask(
        client,
        history,
        stream,
        tool_choice=use("edit_file"),
    )
    assert edit["tool_calls"][0]["function"]["name"] == "edit_file"
    history = [*history, edit, *results_of(edit, "edited a.py")]
    assert placed(stack, owner, history, (first_id, 2)) == (first_id, 2)
    third_id, _ = ask(client, history, stream)  # tool_choice left to its default: auto

    events = logged(kafka, since, first_id, second_id, third_id)
    first, second, third = events[first_id], events[second_id], events[third_id]
    assert [e["turn_index"] for e in (first, second, third)] == [0, 1, 2]
    assert {e["trajectory_id"] for e in (first, second, third)} == {first_id}
    assert [e["parent_request_id"] for e in (first, second, third)] == [
        None,
        first_id,
        second_id,
    ]
    assert first["token_prefix_match"] is None
    # Recorded for every continuation; whether the tokens line up depends on the calls the
    # (untrained) model wrote, checked exactly below on a turn that repeats them faithfully.
    assert isinstance(second["token_prefix_match"], bool)
    assert isinstance(third["token_prefix_match"], bool)
    # The run asked for an edit; its read and test turns are judged by that, not by a regex
    # over the tool results that end their histories.
    assert all(e["edit_requested"] for e in (first, second, third))
    assert first["tool_calls"] == 1
    assert (first["temperature"], first["top_p"], first["top_k"]) == (1.0, 1.0, -1)


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_whose_run_lookup_is_slower_than_the_model_still_continues_its_run(
    gateway_server: Any, ide_key: str, kafka: Any, stream: bool
) -> None:
    # A Redis far away or a loaded machine: the lookup of the run answers after vLLM.
    trajectories = app_state(gateway_server.app).gateway.trajectories
    place = trajectories.place

    async def slow_place(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(1.5)
        return await place(*args, **kwargs)

    client = agent(gateway_server, ide_key, new_id("s"))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    first_id, read = ask(
        client,
        TASK,
        stream,
        tool_choice=use("read_file"),
    )
    trajectories.place = slow_place
    history = [*TASK, read, *results_of(read, "def f(x):\n    return x + 2\n")]
    second_id, edit = ask(client, history, stream, max_tokens=4)
    history = [*history, edit, *results_of(edit, "edited a.py")]
    trajectories.place = place
    third_id, _ = ask(client, history, stream, max_tokens=4)

    events = logged(kafka, since, first_id, second_id, third_id)
    turns = [events[first_id], events[second_id], events[third_id]]
    assert [(e["trajectory_id"], e["turn_index"]) for e in turns] == [
        (first_id, 0),
        (first_id, 1),
        (first_id, 2),
    ]


def test_a_continuation_that_repeats_the_served_answer_starts_with_its_exact_tokens(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    client = agent(gateway_server, ide_key, new_id("s"))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    ask_once = [{"role": "user", "content": "Write f(x) that returns x plus 3."}]
    first_id, answer = ask(client, ask_once, False, temperature=0.0)
    follow_up = [*ask_once, answer, {"role": "user", "content": "Now add a test."}]
    second_id, _ = ask(client, follow_up, False)

    events = logged(kafka, since, first_id, second_id)
    second = events[second_id]
    assert (second["parent_request_id"], second["turn_index"]) == (first_id, 1)
    assert second["token_prefix_match"] is True
    assert events[first_id]["temperature"] == 0.0


def test_an_edited_history_starts_a_new_segment_and_a_header_names_the_parent(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    client = agent(gateway_server, ide_key, new_id("s"))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    first_id, read = ask(
        client,
        TASK,
        False,
        tool_choice=use("read_file"),
    )
    compacted = {**read, "content": "(summarised)"}
    edited_id, _ = ask(client, [*TASK, compacted, *results_of(read, "x")], False)
    named_id, _ = ask(
        client,
        [*TASK, compacted, *results_of(read, "x")],
        False,
        headers={"X-Rtrl-Parent-Request-Id": first_id},
    )
    by_request = logged(kafka, since, first_id, edited_id, named_id)
    assert by_request[edited_id]["parent_request_id"] is None
    assert by_request[edited_id]["turn_index"] == 0
    named = by_request[named_id]
    assert named["parent_request_id"] == first_id and named["turn_index"] == 1
    assert named["token_prefix_match"] is False  # the history it sent differs from the served


def test_a_call_re_sent_with_a_default_argument_or_re_encoded_still_continues_its_run(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    # What clients change when they re-send a served call: the JSON re-encoded (key order,
    # spacing), a default argument added (Claude Code's `"replace_all": false`).
    client = agent(gateway_server, ide_key, new_id("s"))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    first_id, edit = ask(client, TASK, False, tool_choice=use("edit_file"))
    [call] = edit["tool_calls"]
    served = json.loads(call["function"]["arguments"])
    re_sent = dict(reversed(list({**served, "replace_all": False}.items())))
    changed = {
        **edit,
        "tool_calls": [
            {**call, "function": {"name": "edit_file", "arguments": json.dumps(re_sent, indent=1)}}
        ],
    }
    second_id, _ = ask(client, [*TASK, changed, *results_of(edit, "done")], False, max_tokens=8)

    events = logged(kafka, since, first_id, second_id)
    assert events[second_id]["parent_request_id"] == first_id
    assert events[second_id]["turn_index"] == 1


def test_a_turn_that_continues_a_private_run_is_private_without_the_header(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    client = agent(gateway_server, ide_key, new_id("s"))
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    private_id, read = ask(
        client, TASK, False, headers={"X-Rtrl-Privacy": "1"}, tool_choice=use("read_file")
    )
    # The next turn re-sends the private prompt and answer as history, without the header.
    history = [*TASK, read, *results_of(read, "def f(x):\n    return x + 2\n")]
    next_id, _ = ask(client, history, False)
    unrelated_id, _ = ask(client, OTHER_TASK, False)

    by_request = logged(kafka, since, private_id, next_id, unrelated_id)
    continued = by_request[next_id]
    assert continued["parent_request_id"] == private_id
    assert continued["privacy"] is True
    assert continued["prompt_messages"] is None and continued["completion_token_ids"] is None
    assert by_request[unrelated_id]["privacy"] is False  # a new run of the same key is not


def test_a_private_turn_the_user_stopped_keeps_the_next_turn_that_resends_it_private(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    # The user presses Stop: the private turn ends cancelled, and the client sends its prompt
    # again, without the header, beside a new message (no answer in it to link by).
    secret = [{"role": "user", "content": f"SECRET-{uuid.uuid4().hex} refactor billing.py"}]
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    stopped_id = new_id("r")
    body = {"model": "rtrl", "messages": secret, "stream": True, "max_tokens": 400}
    headers = {
        "Authorization": f"Bearer {ide_key}",
        "X-Rtrl-Privacy": "1",
        "X-Request-Id": stopped_id,
    }
    with httpx.stream(
        "POST", f"{gateway_server.url}/v1/chat/completions", json=body, headers=headers
    ) as stream:
        assert stream.status_code == 200
        next(stream.iter_lines())
    client = agent(gateway_server, ide_key, new_id("s"))
    again_id, _ = ask(client, [*secret, {"role": "user", "content": "try again"}], False)

    by_request = logged(kafka, since, stopped_id, again_id)
    assert by_request[stopped_id]["privacy"] is True
    again = by_request[again_id]
    assert again["privacy"] is True
    assert again["prompt_messages"] is None and again["completion_token_ids"] is None


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": [*TASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}]}, None),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools.0.function.parameters",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "unknown"}}}, None),
        ({"n": 2}, "n"),
    ],
)
def test_bad_agent_requests_get_a_clear_400_and_nothing_is_served(
    gateway_server: Any, ide_key: str, change: dict[str, Any], param: str | None
) -> None:
    client = agent(gateway_server, ide_key, new_id("s"))
    body: dict[str, Any] = {"model": "rtrl", "messages": TASK, "tools": TOOLS, **change}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**body)
    error = refused.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
