"""How a client's own events find the completion they are about, when they name no rtrl id.

Stock clients report outcomes in their own vocabulary: Continue's `nextEditOutcome` names the
response's `id`, its `toolUsage` the tool call's `id`, and its `editOutcome` and
`chatFeedback` only the answer's text. So the gateway answers with ids that carry the
request id (the response's `id` is the request id; a tool call's is `call-<n>-<request id>`)
and remembers a digest of each answer's text, scoped to the key and user it was served to.
Claude Code's telemetry names an edit only by its session, its tool and its time: the gateway
also remembers, per key and session, the edit tool calls it served and when.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from app.signals.tools import is_edit_tool

ANSWER_TTL_S = 6 * 3600
"""How long an answer's text finds its request: the feedback window of its request id."""
SHORT_ANSWER_CHARS = 16
SHORT_ANSWER_TTL_S = 5 * 60
"""Shorter answers ("Done.", an agent's last word) repeat within hours, so they name their
completion only for minutes: a thumb on one comes right after it, and the newest wins."""

SESSION_CALLS_TTL_S = ANSWER_TTL_S
"""How long a session's edit calls can be found by their tool and time."""
MAX_SESSION_CALLS = 512
"""Most edit calls remembered per session, the latest kept: a decision comes seconds after
its call, so a session of thousands of edits needs only its last few."""

MAX_BLOCKS = 64
"""Most fenced blocks of a text digested: a served answer (held to the token cap) has a
few; a client's quote of a megabyte of blocks would otherwise cost ~0.2 s of digests and
keys on the event loop."""

_TOOL_CALL_ID = re.compile(r"call-(?:\d+\.)?\d+-([A-Za-z0-9._:@-]{1,128})")


def tool_call_id(request_id: str, choice: int, position: int) -> str:
    """The id a client sees for the `position`-th tool call of a response's choice."""
    prefix = f"{choice}." if choice else ""
    return f"call-{prefix}{position}-{request_id}"


def request_of_tool_call(call_id: str) -> str | None:
    """The request whose response carried the tool call `call_id`, if it is one of ours."""
    match = _TOOL_CALL_ID.fullmatch(call_id)
    return match.group(1) if match else None


def with_client_ids(request_id: str, data: dict[str, Any]) -> None:
    """Give a response (or one stream chunk) the ids clients echo back in their events."""
    if "id" in data:
        data["id"] = request_id
    for choice in data.get("choices") or []:
        message = choice.get("message") or choice.get("delta") or {}
        for position, call in enumerate(message.get("tool_calls") or []):
            if isinstance(call, dict) and call.get("id"):
                index = call.get("index", position)
                call["id"] = tool_call_id(request_id, choice.get("index", 0), index)


def answer_digests(text: str) -> dict[str, int]:
    """Digests that find an answer from a client's copy of it, each with how long it may: the
    whole text, and the code of its fenced blocks (what an editor applies), compared with
    whitespace collapsed (the first `MAX_BLOCKS` blocks)."""
    digests: dict[str, int] = {}
    for candidate in (text, *_fenced_blocks(text)):
        normalized = " ".join(candidate.split())
        if normalized:
            digest = hashlib.blake2b(normalized.encode(errors="replace"), digest_size=16)
            short = len(normalized) < SHORT_ANSWER_CHARS
            digests.setdefault(digest.hexdigest(), SHORT_ANSWER_TTL_S if short else ANSWER_TTL_S)
    return digests


def _fenced_blocks(text: str) -> list[str]:
    """The code of each closed fenced block, in one pass over the lines (client text is
    untrusted: a scan per opening fence would be quadratic)."""
    blocks: list[str] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.lstrip(" \t").startswith(("```", "~~~")):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
                if len(blocks) == MAX_BLOCKS:
                    break
        elif current is not None:
            current.append(line)
    return blocks


def answer_key(owner: str, digest: str) -> str:
    return f"rtrl:ans:{owner}:{digest}"


def queue_answer(pipe: Pipeline, owner: str, request_id: str, text: str) -> None:
    """Queue on `pipe` what lets a client's copy of the answer find its request; the newest
    identical answer wins."""
    for digest, ttl_s in answer_digests(text).items():
        pipe.set(answer_key(owner, digest), request_id, ex=ttl_s)


async def request_of_answer(redis: Redis, owner: str, text: str) -> str | None:
    """The request (of `owner`) whose answer the client quotes, if one is remembered."""
    digests = answer_digests(text)
    if not digests:
        return None
    for found in await redis.mget([answer_key(owner, digest) for digest in digests]):
        if found:
            return found.decode() if isinstance(found, bytes) else str(found)
    return None


def session_calls_key(api_key_id: str, session_id: str) -> str:
    """The sorted set of the edit calls served to a key in a session (member: `SessionCall`
    encoded, score: when the request arrived, in seconds since the epoch)."""
    return f"rtrl:calls:{api_key_id}:{session_id}"


def queue_session_calls(
    pipe: Pipeline,
    api_key_id: str,
    session_id: str,
    request_id: str,
    tool_names: dict[int, str],
    served_at: float,
) -> None:
    """Queue on `pipe` the edit calls of an answer (position -> tool name), so an edit decision
    that names only its session, tool and time finds them."""
    members = {
        f"{tool_call_id(request_id, 0, position)} {name}": served_at
        for position, name in tool_names.items()
        if is_edit_tool(name)
    }
    if not members:
        return
    key = session_calls_key(api_key_id, session_id)
    pipe.zadd(key, members)
    pipe.zremrangebyrank(key, 0, -MAX_SESSION_CALLS - 1)
    pipe.expire(key, SESSION_CALLS_TTL_S)


async def session_calls(
    redis: Redis, api_key_id: str, session_id: str
) -> list[tuple[str, str, float]]:
    """The session's remembered edit calls: (tool call id, tool name, served at), oldest first."""
    found = await redis.zrange(session_calls_key(api_key_id, session_id), 0, -1, withscores=True)
    calls = []
    for pair in found:
        member, score = pair[0], pair[1]
        text = member.decode() if isinstance(member, bytes) else str(member)
        call_id, _, name = text.partition(" ")
        calls.append((call_id, name, float(score)))
    return calls
