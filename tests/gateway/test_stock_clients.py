"""An assistant configured with a base URL and a key alone (Continue, Cline, Roo, Aider,
Zed): no session header, no rtrl header at all. Its conversation is still one session and one
run, and nobody else's identical conversation joins it."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from typing import Any

from openai import OpenAI

from app.events import COMPLETIONS_TOPIC
from app.gateway.headers import derived_session_id
from tests.gateway.conftest import KafkaTopics

OPENING = {"role": "user", "content": "Write f(x) that returns x plus 3."}
FOLLOW_UPS = ["Now add a docstring.", "And a type hint."]


def converse(server: Any, key: str) -> list[str]:
    """Three turns as a stock chat client sends them (the whole history each time); the
    request ids the gateway answered with."""
    client = OpenAI(api_key=key, base_url=f"{server.url}/v1", max_retries=0)
    messages: list[dict[str, Any]] = [OPENING]
    request_ids = []
    for follow_up in [None, *FOLLOW_UPS]:
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=messages, max_tokens=6
        )
        answer = raw.parse()
        assert raw.headers["x-rtrl-session-id"].startswith("auto-")
        request_ids.append(raw.headers["x-request-id"])
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    return request_ids


def test_a_client_with_only_a_base_url_and_a_key_gets_one_session_and_one_run(
    gateway_server: Any, make_key: Callable[..., str], kafka: KafkaTopics
) -> None:
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    mine = converse(gateway_server, make_key())
    theirs = converse(gateway_server, make_key())  # the same words, from another key
    events = {
        event["request_id"]: event
        for event in kafka.read(
            COMPLETIONS_TOPIC, since, until=kafka.for_requests({*mine, *theirs})
        )
    }
    for run in (mine, theirs):
        turns = [events[request_id] for request_id in run]
        assert len({turn["session_id"] for turn in turns}) == 1
        assert [turn["trajectory_id"] for turn in turns] == [run[0]] * 3
        assert [turn["turn_index"] for turn in turns] == [0, 1, 2]
        assert [turn["parent_request_id"] for turn in turns] == [None, run[0], run[1]]
    assert events[mine[0]]["session_id"] != events[theirs[0]]["session_id"]


def test_a_derived_session_id_cannot_be_recomputed_from_the_key_user_and_opening() -> None:
    # The id is stored and exported for private conversations too: whoever reads it must not
    # be able to confirm a guess of the opening message without the server's secret.
    key_id, user_id, opening = uuid.uuid4(), "alice", "fix the bug in auth.py"
    messages = [{"role": "user", "content": opening}]
    unkeyed = hashlib.blake2b(f"{key_id}\0{user_id}\0{opening}".encode(), digest_size=16)
    ours = derived_session_id(key_id, user_id, messages, "secret-one")
    assert ours == derived_session_id(key_id, user_id, messages, "secret-one")
    assert ours != f"auto-{unkeyed.hexdigest()}"
    assert ours != derived_session_id(key_id, user_id, messages, "secret-two")
