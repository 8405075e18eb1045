"""Agent runs: each completion's place in its trajectory (parent, turn, trajectory id).

An IDE agent sends the whole history again on every turn: the earlier turns' messages, the
model's answers (text and tool calls) and the tool results. The parent of a request is the
earlier completion whose messages plus answer are the longest prefix of the new request's
messages (the rule of AReaL's online proxy). Each served completion is remembered in Redis
under the hash of its messages plus its answer; a new request looks up the hashes of its
own history, cut after each of its last `MAX_PARENT_LOOKUPS` assistant messages, longest
first, in one round trip. The prefixes' digests are chained (each from the one before and one
message), so a history of any length is hashed once.
Messages are compared by role, text and tool calls (name and parsed arguments, without those
set to false or null, and `{}` for arguments that do not parse as an object: what clients
change when they re-send a call); ids that clients regenerate are left out.

Whether the token ids line up is recorded too: the parent's prompt + completion ids must be
an exact prefix of the new prompt's ids, or training on the turns as one sequence would
differ from what vLLM served. A history that matches no earlier completion although it
holds assistant messages (a client that edited or compacted it) starts a new segment.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from app.gateway.metrics import TRAJECTORY_LINKS
from app.signals.tools import call_arguments

log = logging.getLogger(__name__)

TURN_TTL_S = 6 * 3600
"""How long a turn can be continued: the feedback window of its request id."""
MAX_PARENT_LOOKUPS = 16
"""Most earlier answers of a history looked up as its parent, the latest first."""
PRIVATE_TTL_S = 30 * 24 * 3600
"""How long a private message is remembered: a later request of its owner that carries it
is private too, however its history was edited, for this long."""
MIN_PRIVATE_MESSAGE_CHARS = 16
"""Shorter messages ("continue", "yes") are not remembered as private: any conversation
carries them, and each would make the owner's other conversations private."""


@dataclass(frozen=True, slots=True)
class Turn:
    """A served completion as the next turn of its run sees it."""

    request_id: str
    trajectory_id: str
    turn_index: int
    edit_requested: bool
    """What the run was asked: an edit or not (set by its first turn)."""
    token_count: int
    """Prompt plus completion tokens vLLM served."""
    token_digest: str
    """Digest of those token ids, to check a continuation's prompt starts with them."""
    private: bool = False
    """Served in privacy mode: every later turn of the run is private too, header or not,
    since its history carries this turn's prompt and answer."""

    def encode(self) -> bytes:
        return orjson.dumps(self)  # orjson writes a dataclass's fields as an object

    @classmethod
    def decode(cls, raw: bytes | str) -> Turn:
        return cls(**orjson.loads(raw))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new completion sits in its run."""

    trajectory_id: str
    turn_index: int
    parent: Turn | None
    carries_private: bool = False
    """The history carries a message its owner sent in privacy mode (`private_messages`)."""
    unknown: bool = False
    """The lookup failed or did not finish: whether the history is private is not known."""
    parent_at: int | None = None
    """Where the parent's answer is in the new request's messages (what follows it is the
    client's account of what became of it: `app.signals.history`)."""

    @property
    def private_run(self) -> bool:
        """Whether an earlier turn of the run was private (see `Turn.private`), or the
        history carries a private message."""
        return (self.parent is not None and self.parent.private) or self.carries_private

    def token_prefix_match(self, prompt_token_ids: Sequence[int] | None) -> bool | None:
        """Whether the parent's served tokens are an exact prefix of this prompt's."""
        if self.parent is None or prompt_token_ids is None:
            return None
        head = prompt_token_ids[: self.parent.token_count]
        matched = len(head) == self.parent.token_count and token_digest(head) == (
            self.parent.token_digest
        )
        TRAJECTORY_LINKS.labels("token_prefix" if matched else "token_mismatch").inc()
        return matched


def token_digest(token_ids: Sequence[int]) -> str:
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    return hashlib.blake2b(orjson.dumps(ids), digest_size=16).hexdigest()


def _arguments(arguments: Any) -> dict[str, Any]:
    """A call's arguments as histories compare them: parsed (clients re-encode the JSON), an
    argument set to false or null left out (Claude Code re-sends its Edit calls with
    `"replace_all": false` added), and arguments that are not a JSON object as `{}` (clients
    re-send a call they could not parse with `{}`)."""
    return {
        name: value
        for name, value in call_arguments(arguments).items()
        if value is not None and value is not False
    }


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """A message as histories are compared: role, text, tool calls without their ids."""
    calls = [
        {
            "name": (call.get("function") or {}).get("name"),
            "arguments": _arguments((call.get("function") or {}).get("arguments")),
        }
        for call in message.get("tool_calls") or ()
        if isinstance(call, dict)
    ]
    return {"role": message.get("role"), "text": _text(message.get("content")), "calls": calls}


def run_owner(api_key_id: uuid.UUID, user_hash: str) -> str:
    """Whose runs these are: a run is continued only by the key and the user it was served
    to, so that another's identical history (a shared system prompt, a stock first turn) or a
    parent request id named by another key never joins it."""
    return hashlib.blake2b(f"{api_key_id}/{user_hash}".encode(), digest_size=12).hexdigest()


def history_digests(
    messages: Sequence[dict[str, Any]], owner: str = "", *, after: str | None = None
) -> list[str]:
    """The digest of every prefix of `messages` (one per message, the whole history last) as
    `owner` sent it, chained so that each costs one message's hashing: linear in the
    history, however long. `after`: the digest of the history these messages follow."""
    digests, running = [], bytes.fromhex(after) if after else owner.encode()
    for message in messages:
        encoded = orjson.dumps(canonical(message), option=orjson.OPT_SORT_KEYS)
        running = hashlib.blake2b(running + encoded, digest_size=20).digest()
        digests.append(running.hex())
    return digests


def history_digest(messages: Sequence[dict[str, Any]], owner: str = "") -> str:
    """The digest of the whole history (see `history_digests`)."""
    digests = history_digests(messages, owner)
    return digests[-1] if digests else ""


def private_messages(owner: str, messages: Sequence[dict[str, Any]]) -> list[str]:
    """Digests of the messages of `owner`'s request that mark a later request private when
    it carries one: what the user and the tools wrote, and answers, not the system prompt
    every conversation shares, nor a message too short to tell conversations apart."""
    digests = []
    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            continue
        # The text alone, as the client sends it again: tool calls are re-encoded by some
        # clients, and the text that carried the secret is what matters.
        text = _text(message.get("content"))
        if len(text) < MIN_PRIVATE_MESSAGE_CHARS:
            continue
        seed = f"{owner}/{role}/".encode()
        digests.append(hashlib.blake2b(seed + text.encode(), digest_size=16).hexdigest())
    return digests


def _private_key(owner: str) -> str:
    return f"rtrl:private:{owner}"


def _history_key(digest: str) -> str:
    return f"rtrl:turn:h:{digest}"


def _request_key(owner: str, request_id: str) -> str:
    return f"rtrl:turn:r:{owner}:{request_id}"


class Trajectories:
    """Places completions in their runs, and remembers them for the runs' next turns."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def place(
        self,
        owner: str,
        request_id: str,
        messages: Sequence[dict[str, Any]],
        parent_request_id: str | None,
        digests: Sequence[str] | None = None,
        *,
        count_miss: bool = True,
    ) -> Placement:
        """The run of `owner` (`run_owner`) a new request continues (an explicit parent
        wins), or a new one. `digests`: the messages' `history_digests`, if known;
        `count_miss`: False for a first look that is asked again when it misses."""
        try:
            parent, parent_at = await self._parent(owner, messages, parent_request_id, digests)
            carries_private = await self._carries_private(owner, messages)
        except RedisError:
            log.warning("request %s not linked to its run: Redis unavailable", request_id)
            TRAJECTORY_LINKS.labels("unavailable").inc()
            return Placement(request_id, 0, None, unknown=True)
        if parent is not None:
            TRAJECTORY_LINKS.labels("continued").inc()
            return Placement(
                parent.trajectory_id,
                parent.turn_index + 1,
                parent,
                carries_private,
                parent_at=parent_at,
            )
        if carries_private:
            return Placement(request_id, 0, None, carries_private=True)
        if count_miss:
            # A history with answers in it that continues nothing: edited, compacted, or old.
            edited = any(message.get("role") == "assistant" for message in messages)
            TRAJECTORY_LINKS.labels("new_segment" if edited else "new_run").inc()
        return Placement(request_id, 0, None)

    async def _carries_private(self, owner: str, messages: Sequence[dict[str, Any]]) -> bool:
        digests = private_messages(owner, messages)
        if not digests:
            return False
        return any(await self.redis.smismember(_private_key(owner), digests))

    async def remember_private(self, owner: str, messages: Sequence[dict[str, Any]]) -> None:
        """Remember the messages of `owner`'s private request (`private_messages`); raises
        RedisError when Redis cannot take them."""
        digests = private_messages(owner, messages)
        if not digests:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(_private_key(owner), *digests)
            pipe.expire(_private_key(owner), PRIVATE_TTL_S)
            await pipe.execute()

    async def _parent(
        self,
        owner: str,
        messages: Sequence[dict[str, Any]],
        parent_request_id: str | None,
        digests: Sequence[str] | None,
    ) -> tuple[Turn | None, int | None]:
        """The parent turn, and where its answer is in `messages` (the last answer, for a
        parent named by id)."""
        cuts = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if parent_request_id is not None:
            raw = await self.redis.get(_request_key(owner, parent_request_id))
            return (Turn.decode(raw), cuts[-1] if cuts else None) if raw else (None, None)
        if not cuts:
            return None, None
        if digests is None:
            digests = history_digests(messages[: cuts[-1] + 1], owner)
        # Longest first, and only the latest few: a run's parent is its last answer unless the
        # client dropped turns, and a history of thousands of answers must not cost thousands
        # of keys.
        latest = list(reversed(cuts[-MAX_PARENT_LOOKUPS:]))
        keys = [_history_key(digests[cut]) for cut in latest]
        for cut, raw in zip(latest, await self.redis.mget(keys), strict=True):
            if raw:
                return Turn.decode(raw), cut
        return None, None

    async def remember(
        self, owner: str, turn: Turn, messages: Sequence[dict[str, Any]], answer: dict[str, Any]
    ) -> None:
        """Let the run's next turn, sent by `owner`, find this completion, by history and by
        request id."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                queue_turn(pipe, owner, turn, messages, answer)
                await pipe.execute()
        except RedisError:
            log.warning("turn %s not remembered: Redis unavailable", turn.request_id)


def queue_turn(
    pipe: Pipeline,
    owner: str,
    turn: Turn,
    messages: Sequence[dict[str, Any]],
    answer: dict[str, Any],
    digests: Sequence[str] | None = None,
) -> None:
    """Queue on `pipe` what lets the run's next turn find `turn` (`Trajectories.remember`).
    `digests`: the messages' `history_digests`, if known."""
    encoded = turn.encode()
    if digests:
        digest = history_digests([answer], owner, after=digests[-1])[-1]
    else:
        digest = history_digest([*messages, answer], owner)
    pipe.set(_history_key(digest), encoded, ex=TURN_TTL_S)
    pipe.set(_request_key(owner, turn.request_id), encoded, ex=TURN_TTL_S)
