"""Run lookup against the real Redis: a long history costs linear hashing and a bounded
number of keys, and still finds its parent; a run is continued only by whom it was served."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from redis.asyncio import Redis

from app.gateway import trajectories
from app.gateway.schemas import ChatRequest
from app.gateway.service import ChatCall, logged_private
from app.gateway.trajectories import (
    MAX_PARENT_LOOKUPS,
    Placement,
    Trajectories,
    Turn,
    run_owner,
)
from app.processes import free_port
from rtrl.embedded.stack import EmbeddedStack

OWNER = run_owner(uuid.uuid4(), "user-hash")


def long_history(answers: int) -> list[dict[str, Any]]:
    """A hostile client's history: `answers` empty assistant messages after user ones."""
    history: list[dict[str, Any]] = []
    for index in range(answers):
        history += [
            {"role": "user", "content": f"step {index}"},
            {"role": "assistant", "content": ""},
        ]
    return history


def test_a_two_thousand_message_history_is_hashed_once_and_looks_up_few_keys(
    stack: EmbeddedStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    history = long_history(1000)
    parent = Turn("req-parent", "traj-1", 999, True, 10, "digest")
    canonicalized: list[int] = []
    looked_up: list[int] = []
    canonical = trajectories.canonical

    def counted(message: dict[str, Any]) -> dict[str, Any]:
        canonicalized.append(1)
        return canonical(message)

    monkeypatch.setattr(trajectories, "canonical", counted)

    async def scenario() -> Any:
        async with Redis(port=stack.redis.port) as redis:
            mget = redis.mget

            async def counted_mget(keys: list[str]) -> Any:
                looked_up.append(len(keys))
                return await mget(keys)

            runs = Trajectories(redis)
            await runs.remember(OWNER, parent, history[:-1], history[-1])
            monkeypatch.setattr(redis, "mget", counted_mget)
            canonicalized.clear()
            return await runs.place(
                OWNER, "req-next", [*history, {"role": "user", "content": "go on"}], None
            )

    placement = asyncio.run(scenario())

    assert placement.parent == parent and placement.turn_index == 1000
    # Each message hashed once (every prefix from scratch was 2,001,000 hashings), and one
    # round trip for at most MAX_PARENT_LOOKUPS of its 1,000 answers.
    assert len(canonicalized) <= len(history)
    assert looked_up == [MAX_PARENT_LOOKUPS]


def test_a_parent_a_few_answers_back_is_still_found(stack: EmbeddedStack) -> None:
    history = long_history(5)
    parent = Turn("req-old", "traj-2", 2, False, 4, "digest")

    async def scenario() -> Any:
        async with Redis(port=stack.redis.port) as redis:
            runs = Trajectories(redis)
            await runs.remember(OWNER, parent, history[:5], history[5])
            # The client dropped nothing but answered twice more without the gateway.
            return await runs.place(
                OWNER, "req-new", [*history, {"role": "user", "content": "x"}], None
            )

    placement = asyncio.run(scenario())
    assert placement.parent == parent and placement.turn_index == 3


def test_a_call_the_client_could_not_parse_re_sent_as_empty_arguments_continues_its_run(
    stack: EmbeddedStack,
) -> None:
    task = [{"role": "user", "content": "fix it"}]
    call = {"id": "call-0-r", "type": "function", "function": {"name": "edit"}}
    served = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {**call, "function": {"name": "edit", "arguments": '{"path": "a.py", "old'}}
        ],
    }
    re_sent = {**served, "tool_calls": [{**call, "function": {"name": "edit", "arguments": "{}"}}]}
    parent = Turn("req-broken", "traj-9", 0, True, 4, "digest")

    async def scenario() -> Placement:
        async with Redis(port=stack.redis.port) as redis:
            runs = Trajectories(redis)
            await runs.remember(OWNER, parent, task, served)
            result = {"role": "tool", "tool_call_id": "call-0-r", "content": "bad arguments"}
            return await runs.place(OWNER, "req-next", [*task, re_sent, result], None)

    placement = asyncio.run(scenario())
    assert placement.parent == parent and placement.parent_at == 1


def test_another_key_or_user_with_the_same_history_starts_a_run_of_its_own(
    stack: EmbeddedStack,
) -> None:
    # A stock first turn: two developers send the same question and get the same answer.
    history = [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Add type hints to a.py"},
        {"role": "assistant", "content": "Done."},
    ]
    parent = Turn("req-theirs", "traj-theirs", 0, True, 12, "digest", private=True)
    key = uuid.uuid4()
    owner, same_key_other_user, other_key = (
        run_owner(key, "alice"),
        run_owner(key, "bob"),
        run_owner(uuid.uuid4(), "alice"),
    )
    follow_up = [*history, {"role": "user", "content": "and tests"}]

    async def scenario() -> list[Any]:
        async with Redis(port=stack.redis.port) as redis:
            runs = Trajectories(redis)
            await runs.remember(owner, parent, history[:-1], history[-1])
            return [
                await runs.place(owner, "req-1", follow_up, None),
                await runs.place(same_key_other_user, "req-2", follow_up, None),
                await runs.place(other_key, "req-3", follow_up, None),
                # Naming their request id as the parent does not join their run either.
                await runs.place(other_key, "req-4", [follow_up[1]], "req-theirs"),
                await runs.place(owner, "req-5", [follow_up[1]], "req-theirs"),
            ]

    mine, bobs, others, named_by_other, named_by_owner = asyncio.run(scenario())
    assert mine.parent == parent and mine.trajectory_id == "traj-theirs"
    assert named_by_owner.parent == parent
    for placement, request_id in ((bobs, "req-2"), (others, "req-3"), (named_by_other, "req-4")):
        # A run of its own, and not private because theirs was.
        assert placement.parent is None and placement.trajectory_id == request_id
        assert not placement.private_run


def test_a_history_whose_lookup_fails_is_logged_as_private(stack: EmbeddedStack) -> None:
    # Redis down or too slow: the lookup cannot say whether the history carries a private
    # turn, so a request that continues a run is logged without content; a first turn is not.
    owner = run_owner(uuid.uuid4(), "user")
    history = [
        {"role": "user", "content": "Fix f in a.py so that it returns x plus 3."},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks, now add a test."},
    ]

    async def place_without_redis() -> Any:
        async with Redis(port=free_port(), socket_connect_timeout=1) as unreachable:
            return await Trajectories(unreachable).place(owner, "r-1", history, None)

    placement = asyncio.run(place_without_redis())
    assert placement.unknown and placement.parent is None
    assert logged_private(chat_call(history), placement)
    assert not logged_private(chat_call(history[:1]), placement)
    assert not logged_private(chat_call(history), Placement("r-1", 0, None))


def test_a_message_sent_in_privacy_mode_makes_any_later_request_carrying_it_private(
    stack: EmbeddedStack,
) -> None:
    owner = run_owner(uuid.uuid4(), "user")
    secret = {"role": "user", "content": "SECRET-MARKER-91 refactor billing.py"}

    async def placements() -> list[Any]:
        async with Redis(port=stack.redis.port) as redis:
            memory = Trajectories(redis)
            await memory.remember_private(owner, [{"role": "system", "content": "x" * 40}, secret])
            return [
                await memory.place(
                    owner, "r-2", [secret, {"role": "user", "content": "again"}], None
                ),
                await memory.place(run_owner(uuid.uuid4(), "user"), "r-3", [secret], None),
                await memory.place(owner, "r-4", [{"role": "system", "content": "x" * 40}], None),
            ]

    resent, other_owner, shared_system_prompt = asyncio.run(placements())
    assert resent.private_run
    assert not other_owner.private_run
    assert not shared_system_prompt.private_run


def chat_call(messages: list[dict[str, Any]]) -> ChatCall:
    return ChatCall(
        request=ChatRequest.model_validate({"messages": messages}),
        body={"messages": messages},
        session_id="s",
        request_id="r-1",
        user_hash="u",
        api_key_id=uuid.uuid4(),
        privacy=False,
        edit_requested=False,
        received_at=datetime.now(UTC),
        started=0.0,
    )
