"""From vLLM's answer to the logged sample: tool calls, edits, questions, privacy."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from app.abtest.assignment import Assignment
from app.events import CompletionEvent, decode_completion
from app.gateway.schemas import ChatRequest
from app.gateway.service import (
    ChatCall,
    CompletionRecord,
    completion_event,
    completion_parts,
    encode_completion,
)
from workers.store import sample_row

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def call(
    privacy: bool = False,
    *,
    tools: bool = True,
    edit_requested: bool = True,
    session_id: str = "s-1",
    request_id: str = "r-1",
    received_at: datetime | None = None,
) -> ChatCall:
    """A request about a file: an agent's, with its tools declared, or a chat's without."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "fix a.py"}]}
    if tools:
        body["tools"] = TOOLS
    return ChatCall(
        request=ChatRequest.model_validate(body),
        body=body,
        session_id=session_id,
        request_id=request_id,
        user_hash="u" * 64,
        api_key_id=uuid.uuid4(),
        privacy=privacy,
        edit_requested=edit_requested,
        received_at=received_at or datetime.now(UTC),
        started=time.perf_counter() - 0.05,
    )


def streamed_tool_calls() -> CompletionRecord:
    """Chunks as vLLM streams two tool calls: ids and names first, arguments in pieces."""
    record = CompletionRecord()
    deltas = [
        {"role": "assistant", "content": ""},
        {"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "edit_file"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"a.py"}'}}]},
        {"tool_calls": [{"index": 1, "id": "c1", "function": {"name": "edit_file"}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"file": 3}'}}]},
    ]
    for n, delta in enumerate(deltas):
        choice = {"index": 0, "delta": delta, "token_ids": [n] if n else []}
        if n:
            choice["logprobs"] = {"content": [{"token": "x", "logprob": -0.1 * n}]}
        record.add_choice(choice, message_key="delta", now=time.perf_counter())
    record.add_choice(
        {"index": 0, "delta": {}, "finish_reason": "tool_calls"},
        message_key="delta",
        now=time.perf_counter(),
    )
    record.prompt_token_ids = [7, 8, 9]
    record.finished_at = time.perf_counter()
    return record


def answered(text: str) -> CompletionRecord:
    """A whole answer without tool calls, its tokens and logprobs logged."""
    record = CompletionRecord(completion_token_ids=[1, 2], logprobs=[-0.5, -0.25])
    record.add_choice(
        {"index": 0, "message": {"content": text}, "finish_reason": "stop"},
        message_key="message",
        now=time.perf_counter(),
    )
    record.prompt_token_ids = [7, 8]
    return record


def test_streamed_tool_calls_are_reassembled_and_checked() -> None:
    event = completion_event(call(), Assignment("ckpt-2", 3, "canary"), streamed_tool_calls())

    assert (event.tool_calls, event.malformed_tool_calls) == (2, 1)
    assert event.proposed_edit and not event.clarifying_question
    assert event.finish_reason == "tool_calls" and event.status == "ok"
    assert event.completion_token_ids == [1, 2, 3, 4, 5]
    assert event.behaviour_logprobs is not None and len(event.behaviour_logprobs) == 5
    assert (event.checkpoint, event.experiment_id, event.arm) == ("ckpt-2", 3, "canary")
    assert event.latency_ms >= event.ttft_ms >= 50


def test_privacy_mode_keeps_the_measurements_but_no_content() -> None:
    event = completion_event(call(privacy=True), Assignment("ckpt-2"), streamed_tool_calls())

    assert event.privacy and event.tool_calls == 2
    assert event.prompt_messages is None and event.prompt_token_ids is None
    assert event.completion_token_ids is None and event.behaviour_logprobs is None
    assert event.completion_text is None


def test_tokens_without_matching_logprobs_are_not_logged_as_trainable() -> None:
    record = CompletionRecord(completion_token_ids=[1, 2], logprobs=[-0.5])
    record.add_choice(
        {"index": 0, "message": {"content": "Which file?"}, "finish_reason": "stop"},
        message_key="message",
        now=time.perf_counter(),
    )

    event = completion_event(call(), Assignment("base"), record)

    assert event.completion_token_ids is None and event.behaviour_logprobs is None
    assert event.clarifying_question and not event.proposed_edit


def test_a_stream_the_model_server_ended_early_is_truncated_and_never_trained() -> None:
    record = streamed_tool_calls()
    record.finish_reason = None  # the stream stopped without a finish reason or [DONE]
    cut = completion_event(call(), Assignment("base"), record)
    left = streamed_tool_calls()
    left.cancelled = True
    abandoned = completion_event(call(), Assignment("base"), left)

    assert (cut.status, abandoned.status) == ("truncated", "cancelled")
    assert not sample_row(cut)["trainable"] and not sample_row(abandoned)["trainable"]
    assert sample_row(completion_event(call(), Assignment("base"), streamed_tool_calls()))[
        "trainable"
    ]


def test_whether_the_request_declared_tools_is_logged_and_stored() -> None:
    agent = completion_event(call(), Assignment("base"), streamed_tool_calls())
    chat = completion_event(call(tools=False), Assignment("base"), answered("Which file?"))

    assert agent.tools_declared and sample_row(agent)["tools_declared"]
    assert not chat.tools_declared and not sample_row(chat)["tools_declared"]


@pytest.mark.parametrize(
    ("privacy", "record"),
    [
        (False, streamed_tool_calls),
        (True, streamed_tool_calls),
        (False, lambda: answered("Which file?")),
        (
            False,
            lambda: CompletionRecord(error="upstream 500: boom", finished_at=time.perf_counter()),
        ),
    ],
    ids=["agent", "private", "chat", "failed"],
)
def test_what_the_gateway_spools_is_the_event_a_worker_reads(
    privacy: bool, record: Callable[[], CompletionRecord]
) -> None:
    event, content = completion_parts(call(privacy), Assignment("ckpt-2", 3, "canary"), record())

    logged = decode_completion(encode_completion(event, content))

    assert logged == completion_event_of(event, content)
    assert (logged.prompt_messages is None) == privacy
    if not privacy and logged.status == "ok":
        assert logged.prompt_messages == call().request.messages
        assert logged.completion_token_ids and logged.behaviour_logprobs
        assert len(logged.completion_token_ids) == len(logged.behaviour_logprobs)


def completion_event_of(event: CompletionEvent, content: dict[str, Any]) -> CompletionEvent:
    """The whole event, validated field by field, as `completion_event` builds it."""
    return CompletionEvent.model_validate(event.model_dump() | content)
