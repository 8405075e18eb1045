"""A real IDE reports no verdict on a call it could not run: such a turn still earns its
reward (and its penalty) from the session's end alone, through Kafka and the worker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from app.abtest.assignment import Assignment
from app.gateway.schemas import ChatRequest
from app.gateway.service import ChatCall, CompletionRecord, completion_event
from app.signals.rewards import reward_weights
from tests.workers.conftest import Events

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("read_file", "edit_file")
]


def served(events: Events, n: int, arguments: str, name: str, turn: int) -> Any:
    """The completion event the gateway logs for a turn that called `name` with `arguments`."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix a.py"}]
    body: dict[str, Any] = {"messages": messages, "tools": TOOLS}
    call = ChatCall(
        request=ChatRequest.model_validate(body),
        body=body,
        session_id=events.session(1),
        request_id=events.request(n),
        user_hash="u" * 64,
        api_key_id=uuid.uuid4(),
        privacy=False,
        edit_requested=True,
        received_at=events.served_at,
        started=time.perf_counter() - 0.05,
    )
    record = CompletionRecord()
    record.add_choice(
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": f"c{n}", "function": {"name": name, "arguments": arguments}}],
            },
            "finish_reason": "tool_calls",
            "token_ids": [11, 12, 13],
            "logprobs": {"content": [{"token": "x", "logprob": -0.2}] * 3},
        },
        message_key="message",
        now=time.perf_counter(),
    )
    record.prompt_token_ids = [1, 2, 3]
    record.finished_at = time.perf_counter()
    event = completion_event(call, Assignment("ckpt-test"), record)
    first = events.request(n - turn)
    return event.model_copy(
        update={
            "trajectory_id": first,
            "turn_index": turn,
            "parent_request_id": events.request(n - 1) if turn else None,
        }
    )


def test_a_broken_edit_call_is_penalised_and_trainable_without_any_verdict(
    events: Events,
    publish: Callable[..., None],
    worker_thread: Any,
    read_rewards: Callable[[str], dict[str, Any]],
    wait_for: Callable[..., None],
) -> None:
    # An agent run: it reads the file, then calls edit_file with arguments the IDE cannot
    # parse. The IDE runs nothing, so it reports no accept or reject; the session ends.
    read = served(events, 1, '{"path": "a.py"}', "read_file", turn=0)
    broken = served(events, 2, '{"path": "a.py"', "edit_file", turn=1)
    assert broken.malformed_tool_calls == 1
    publish(read, broken, events.session_end(2, session=1))
    worker_thread()

    def final() -> bool:
        found = read_rewards(events.prefix)
        return len(found) == 2 and all(r.finalized_at is not None for r in found.values())

    wait_for(final, 60, "both turns' rewards to be final")
    found = read_rewards(events.prefix)
    penalty = reward_weights(found[broken.request_id].reward_version).malformed_tool_call_penalty
    # Both have a reward, so both are trained on: the broken call pays its penalty, and the
    # read that led to it shares the run's outcome (nothing kept).
    assert found[broken.request_id].reward is not None
    assert found[broken.request_id].reward <= -penalty < 0
    assert found[read.request_id].reward is not None
    assert found[read.request_id].reward <= 0
