"""What every surface's translation shares (`app.gateway.surfaces` serves the surfaces)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from app.http.errors import ApiError


@dataclass(frozen=True, slots=True)
class Answering:
    """What translating an answer back needs besides the answer."""

    request_id: str
    checkpoint: str
    """The checkpoint that answered (the surface's `model`)."""
    asked: dict[str, Any]
    """The request as the client sent it."""
    body: dict[str, Any]
    """The chat body it became (what vLLM was sent)."""


def exceeds_context(error: ApiError) -> bool:
    """Whether `error` is vLLM's refusal of a prompt longer than the model's context."""
    return error.status_code == 400 and "maximum context length" in error.message


class EventTranslator(Protocol):
    """One streamed answer's events in a surface's terms."""

    def start(self) -> bytes:
        """The events before the first chunk."""
        ...

    def event_of(self, line: bytes) -> bytes:
        """The events one server-sent chat chunk (`data: ...`) becomes, maybe none."""
        ...


async def translated_events(
    chunks: AsyncIterator[bytes], stream: EventTranslator
) -> AsyncIterator[bytes]:
    """A surface's server-sent events, from the chat completion chunks the gateway relays
    (which it has logged by the time they arrive here)."""
    yield stream.start()
    async for relayed in chunks:
        events = [stream.event_of(line) for line in relayed.split(b"\n\n") if line]
        if any(events):
            yield b"".join(events)
