"""Run lookup against the real Redis: a long history costs linear hashing and a bounded
number of keys, and still finds its parent."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from app.embedded.stack import EmbeddedStack
from app.gateway import trajectories
from app.gateway.trajectories import MAX_PARENT_LOOKUPS, Trajectories, Turn


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
            await runs.remember(parent, history[:-1], history[-1])
            monkeypatch.setattr(redis, "mget", counted_mget)
            canonicalized.clear()
            return await runs.place(
                "req-next", [*history, {"role": "user", "content": "go on"}], None
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
            await runs.remember(parent, history[:5], history[5])
            # The client dropped nothing but answered twice more without the gateway.
            return await runs.place("req-new", [*history, {"role": "user", "content": "x"}], None)

    placement = asyncio.run(scenario())
    assert placement.parent == parent and placement.turn_index == 3
