"""The headers every API surface of the gateway reads, and those its answers carry.

Headers the gateway reads:
  Authorization: Bearer <key>   an `ide` key.
  X-Session-Id                  optional; the IDE session, key of the logged events. An IDE
                                that sends none (Continue, Cline, Roo, Aider, Zed configured
                                with a base URL and a key) gets one derived from its key, its
                                user and the conversation's first user message
                                (`derived_session_id`), returned in X-Rtrl-Session-Id.
  X-Request-Id                  optional; unique forever (a reused one is answered 409 at
                                any age, since a completion is never replayed); generated if
                                absent and always returned in the response header.
  X-User-Id                     optional; the IDE's stable user id (default: the key's id).
  X-Rtrl-Privacy: 1             optional; no content is logged (also a per-key setting).
  X-Rtrl-Edit-Request: 1|0      optional; whether the user asked for an edit (default: what
                                the agent run's first turn was asked, judged by a heuristic
                                over its user message).
  X-Rtrl-Parent-Request-Id      optional; the request this turn continues (default: the
                                completion whose messages and answer this history extends).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from app.gateway.toolcalls import message_text
from app.http.errors import ApiError

# The event schema's alphabet for ids: nothing that could smuggle a header or a log line.
_ID_CHARS = re.compile(r"[A-Za-z0-9._:@-]+")


def id_header(request: Request, name: str, *, max_length: int = 128) -> str | None:
    """An id header's value; 400 unless it is 1-`max_length` characters of the ids' alphabet."""
    value = request.headers.get(name)
    if value is None:
        return None
    if len(value) > max_length or not _ID_CHARS.fullmatch(value):
        raise ApiError(
            400,
            f"The {_title(name)} header must be 1-{max_length} characters of A-Z a-z 0-9 . _ : @ -",
            code="invalid_header",
            param=_title(name),
        )
    return value


def flag_header(request: Request, name: str) -> bool | None:
    """A flag header's value; 400 unless it is 0 or 1."""
    value = request.headers.get(name)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ApiError(
            400, f"The {_title(name)} header must be 0 or 1.", code="invalid_header", param=name
        )
    return value == "1"


def derived_session_id(
    api_key_id: uuid.UUID, user_id: str, messages: Sequence[dict[str, Any]], secret: str
) -> str:
    """The session of a request that names none: one per key, user and conversation, the
    conversation known by its first user message (every turn re-sends the history, so every
    turn of it has the same one). Two conversations that open with the same message are one
    session; their runs are still told apart by the run lookup.

    Keyed with the server's secret (`RTRL_USER_HASH_SECRET`): the id is stored and exported
    for private conversations too, and an unkeyed digest would let whoever reads it confirm a
    guess of the opening message."""
    first = next((m for m in messages if m.get("role") == "user"), messages[0])
    opening = message_text(first)
    digest = hashlib.blake2b(
        f"{api_key_id}\0{user_id}\0{opening}".encode(errors="replace"),
        digest_size=16,
        key=hashlib.sha256(secret.encode()).digest(),
        person=b"rtrl-session",
    )
    return f"auto-{digest.hexdigest()}"


def served_headers(
    checkpoint: str, session_id: str, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """The headers of an answer: the checkpoint that served it and the session it joined."""
    return {"X-Rtrl-Checkpoint": checkpoint, "X-Rtrl-Session-Id": session_id, **(extra or {})}


def _title(name: str) -> str:
    return "-".join("Id" if part == "id" else part.capitalize() for part in name.split("-"))
