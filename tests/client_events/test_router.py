"""`POST /v1/adapters/continue`: Continue's own events land on the completions rtrl served."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.gateway.joins import (
    ANSWER_TTL_S,
    MAX_BLOCKS,
    SHORT_ANSWER_TTL_S,
    answer_digests,
    tool_call_id,
    with_client_ids,
)

PROMPT = "Write a function f(x) that returns x plus 3, with a docstring."


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


@pytest.fixture
def served(client: TestClient, ide_key: str) -> Callable[..., dict[str, Any]]:
    """A chat answered as a stock client asks (no rtrl header): the response and its ids."""

    def serve(key: str | None = None) -> dict[str, Any]:
        for _ in range(5):  # the tiny model may stop early; its answer must be quotable
            response = client.post(
                "/v1/chat/completions",
                json={
                    "model": "gpt-4o",
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": 32,
                    "temperature": 1.0,
                },
                headers=auth(key or ide_key),
            )
            assert response.status_code == 200, response.text
            body = response.json()
            if len(" ".join((body["choices"][0]["message"]["content"] or "").split())) >= 16:
                return body | {
                    "request_id": response.headers["x-request-id"],
                    "session_id": response.headers["x-rtrl-session-id"],
                    "text": body["choices"][0]["message"]["content"],
                }
        raise AssertionError("the model gave no answer of 16 characters in five tries")

    return serve


def envelope(
    name: str, data: dict[str, Any], schema: str = "0.2.0", level: str = "all"
) -> dict[str, Any]:
    base = {
        "eventName": name,
        "schema": schema,
        "timestamp": "2026-12-05T08:00:00.000Z",
        "userId": "continue-user",
        "userAgent": "Visual Studio Code/1.96 (Continue/1.1.0)",
        "selectedProfileId": "local",
        "someFieldContinueAddsLater": {"nested": [1, 2]},
    }
    return {
        "name": name,
        "data": base | data,
        "schema": schema,
        "level": level,
        "profileId": "local",
    }


def test_the_response_id_is_the_request_id_that_continue_echoes(
    client: TestClient, ide_key: str, served: Callable[..., dict[str, Any]], feedback_topic: Any
) -> None:
    answer = served()
    assert answer["id"] == answer["request_id"]
    since = feedback_topic.mark()
    posted = client.post(
        "/v1/adapters/continue",
        json=envelope(
            "nextEditOutcome",
            {"completionId": answer["id"], "accepted": True, "elapsed": 900, "modelName": "rtrl"},
        ),
        headers=auth(ide_key),
    )
    assert posted.status_code == 202, posted.text
    outcome = posted.json()
    assert (outcome["outcome"], outcome["feedback"], outcome["request_id"]) == (
        "mapped",
        ["edit_accepted"],
        answer["request_id"],
    )
    sentinel = _sentinel(client, ide_key, served)
    published = [
        e
        for e in feedback_topic.read_until(since, sentinel)
        if e["request_id"] == answer["request_id"]
    ]
    assert [(e["kind"], e["session_id"]) for e in published] == [
        ("edit_accepted", answer["session_id"])
    ]


@pytest.mark.parametrize(("schema", "level"), [("0.2.0", "all"), ("0.1.0", "all")])
def test_chat_feedback_joins_by_the_answers_text_once_however_often_it_is_posted(
    client: TestClient,
    ide_key: str,
    served: Callable[..., dict[str, Any]],
    feedback_topic: Any,
    schema: str,
    level: str,
) -> None:
    answer = served()
    since = feedback_topic.mark()
    thumbs_down = envelope(
        "chatFeedback",
        {
            "feedback": False,
            "prompt": PROMPT,
            "completion": answer["text"] + "\n",
            "sessionId": str(uuid.uuid4()),
            "modelTitle": "rtrl",
        },
        schema,
        level,
    )
    first = client.post("/v1/adapters/continue", json=thumbs_down, headers=auth(ide_key))
    again = client.post("/v1/adapters/continue", json=thumbs_down, headers=auth(ide_key))
    assert first.status_code == again.status_code == 202
    assert (first.json()["outcome"], first.json()["request_id"]) == ("mapped", answer["request_id"])
    assert again.json()["outcome"] == "duplicate"
    sentinel = _sentinel(client, ide_key, served)
    published = [
        e
        for e in feedback_topic.read_until(since, sentinel)
        if e["request_id"] == answer["request_id"]
    ]
    assert [(e["kind"], e["dissatisfied"], e["message"]) for e in published] == [
        ("followup_message", True, None)
    ]


def test_what_cannot_be_joined_or_carries_no_verdict_is_answered_and_counted(
    client: TestClient,
    ide_key: str,
    make_key: Callable[..., str],
    served: Callable[..., dict[str, Any]],
) -> None:
    answer = served()
    cases = {
        # noCode: Continue drops the completion, so nothing names the answer.
        "unjoinable": [
            envelope("chatFeedback", {"feedback": False, "sessionId": "c1"}, level="noCode"),
            envelope(
                "editOutcome", {"accepted": True, "completion": "def g(): pass  # never served"}
            ),
            envelope("nextEditOutcome", {"completionId": "not-ours", "accepted": False}),
            envelope(
                "toolUsage",
                {
                    "toolCallId": "toolu_01abc",
                    "functionName": "edit_file",
                    "functionArgs": "{}",
                    "parsedArgs": {},
                },
            ),
        ],
        "ignored": [
            envelope("autocomplete", {"accepted": True, "completionId": answer["id"]}),
            envelope("chatInteraction", {"prompt": PROMPT, "completion": answer["text"]}),
            envelope(
                "toolUsage",
                {
                    "toolCallId": tool_call_id(answer["request_id"], 0, 0),
                    "functionName": "read_file",
                },
            ),
            envelope("somethingNew", {"x": 1}),
        ],
    }
    for expected, envelopes in cases.items():
        for body in envelopes:
            posted = client.post("/v1/adapters/continue", json=body, headers=auth(ide_key))
            assert posted.status_code == 202, posted.text
            assert posted.json()["outcome"] == expected, (body["name"], posted.json())
            assert posted.json()["reason"]
    # Another key quoting the same answer, or naming its id, joins nothing of ours.
    stranger = make_key()
    for body in (
        envelope("chatFeedback", {"feedback": False, "completion": answer["text"]}),
        envelope("nextEditOutcome", {"completionId": answer["id"], "accepted": True}),
    ):
        posted = client.post("/v1/adapters/continue", json=body, headers=auth(stranger))
        assert posted.json()["outcome"] == "unjoinable"
    metrics = client.get("/metrics").text
    assert 'rtrl_continue_events_total{event="chatFeedback",outcome="unjoinable"}' in metrics


def test_an_edit_tool_call_continue_ran_is_an_accepted_edit_and_one_refused_a_rejection(
    client: TestClient, ide_key: str, served: Callable[..., dict[str, Any]], feedback_topic: Any
) -> None:
    answer = served()
    since = feedback_topic.mark()
    for position, verdict in enumerate(
        ({"accepted": True, "succeeded": True}, {"accepted": False})
    ):
        body = envelope(
            "toolUsage",
            {
                "toolCallId": tool_call_id(answer["request_id"], 0, position),
                "functionName": "edit_existing_file",
                "functionArgs": "{}",
                "parsedArgs": {},
            }
            | verdict,
        )
        posted = client.post("/v1/adapters/continue", json=body, headers=auth(ide_key))
        assert posted.json()["outcome"] == "mapped", posted.json()
    sentinel = _sentinel(client, ide_key, served)
    kinds = sorted(
        e["kind"]
        for e in feedback_topic.read_until(since, sentinel)
        if e["request_id"] == answer["request_id"]
    )
    assert kinds == ["edit_accepted", "edit_rejected"]


def test_a_body_that_is_not_a_continue_event_is_a_clear_4xx(
    client: TestClient, ide_key: str
) -> None:
    for body, status in ((b"{", 400), (b'{"data": {}}', 422), (b'{"name": "x", "data": 3}', 422)):
        posted = client.post("/v1/adapters/continue", content=body, headers=auth(ide_key))
        assert posted.status_code == status, posted.text
        assert posted.json()["error"]["message"]
    assert client.post("/v1/adapters/continue", json=envelope("toolUsage", {})).status_code == 401


def test_tool_call_ids_carry_the_request_in_whole_answers_and_stream_chunks() -> None:
    whole = {
        "id": "chatcmpl-abc",
        "choices": [
            {
                "index": 0,
                "message": {
                    "tool_calls": [
                        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f"}},
                        {"id": "chatcmpl-tool-2", "type": "function", "function": {"name": "g"}},
                    ]
                },
            }
        ],
    }
    chunk = {
        "id": "chatcmpl-abc",
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [{"index": 1, "id": "chatcmpl-tool-2", "function": {"name": "g"}}]
                },
            }
        ],
    }
    with_client_ids("r-1.a", whole)
    with_client_ids("r-1.a", chunk)
    assert whole["id"] == chunk["id"] == "r-1.a"
    calls = whole["choices"][0]["message"]["tool_calls"]
    assert [c["id"] for c in calls] == ["call-0-r-1.a", "call-1-r-1.a"]
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["id"] == "call-1-r-1.a"


def _sentinel(client: TestClient, key: str, served: Callable[..., dict[str, Any]]) -> str:
    """An event sent last through /v1/feedback: once it is in Kafka, so is everything before."""
    answer = served(key)
    event_id = str(uuid.uuid4())
    posted = client.post(
        "/v1/feedback",
        json={
            "events": [
                {
                    "event_id": event_id,
                    "kind": "session_end",
                    "session_id": answer["session_id"],
                    "request_id": answer["request_id"],
                }
            ]
        },
        headers=auth(key),
    )
    assert posted.status_code == 202, posted.text
    return event_id


def test_a_short_answer_is_found_by_its_text_for_minutes_a_long_one_for_hours() -> None:
    assert list(answer_digests("Done.").values()) == [SHORT_ANSWER_TTL_S]
    fenced = "Here it is:\n```python\ndef f(x):\n    return x + 3\n```\n"
    assert list(answer_digests(fenced).values()) == [ANSWER_TTL_S, ANSWER_TTL_S]
    assert answer_digests("  \n ") == {}
    # Whitespace is not the answer: a client's copy with other line ends still finds it.
    assert answer_digests(fenced).keys() == answer_digests(fenced.replace("\n", "\r\n")).keys()


def test_a_quote_of_thousands_of_code_blocks_costs_a_bounded_lookup() -> None:
    # A megabyte of distinct fenced blocks once held the event loop 0.2 s: a digest and a
    # Redis key per block. The whole text and the first MAX_BLOCKS blocks are looked up.
    quote = "".join(f"```\nx = {n}\n```\n" for n in range(10_000))
    digests = answer_digests(quote)
    assert len(digests) == 1 + MAX_BLOCKS
    # An early block still finds its answer: its code's digest is among them.
    assert answer_digests("```\nx = 3\n```").keys() & digests.keys()
