"""Kafka event schemas: one pydantic model per event type, JSON on the wire."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from uuid import UUID, uuid4

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

COMPLETIONS_TOPIC = "rtrl.completions.v1"
FEEDBACK_TOPIC = "rtrl.feedback.v1"
DLQ_TOPIC = "rtrl.dlq.v1"
TOPICS = (COMPLETIONS_TOPIC, FEEDBACK_TOPIC, DLQ_TOPIC)

SCHEMA_VERSION: Literal[1] = 1

SessionId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")]
RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")]


def utcnow() -> datetime:
    return datetime.now(UTC)


SideRequest = Literal["title", "commit_message", "summary", "suggestion", "memory"]
"""What a client asks besides its agent or chat turns (`app.signals.side_requests`)."""

Surface = Literal["chat", "messages", "responses"]
"""The APIs the gateway speaks; each is served as the one chat call."""


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: UUID = Field(default_factory=uuid4)
    schema_version: Literal[1] = SCHEMA_VERSION
    occurred_at: datetime = Field(default_factory=utcnow)
    session_id: SessionId
    request_id: RequestId


CompletionStatus = Literal["ok", "error", "cancelled", "truncated"]
"""How a completion ended: answered to the end; failed; the client went away before the end;
the model server ended the stream without finishing it. Only `ok` is ever trained on."""


class CompletionEvent(Event):
    """What the gateway served for one request."""

    event_type: Literal["completion"] = "completion"
    checkpoint: str
    experiment_id: int | None = None
    arm: str | None = None
    fallback: bool = False
    """The arm's checkpoint was not being served, so production answered instead."""
    user_hash: str
    api_key_id: UUID | None = None
    privacy: bool = False
    edit_requested: bool = False
    """Whether the run asked for an edit (its first turn decides for the turns after it)."""
    tools_declared: bool = False
    """Whether the request declared tools (agent traffic rather than one-turn chat)."""
    surface: Surface | None = None
    """The API the client spoke: OpenAI Chat Completions, Anthropic Messages or OpenAI
    Responses (None on events logged before surfaces were recorded)."""
    side_request: SideRequest | None = None
    """What the client asked besides its turns (`app.signals.side_requests`): a title, a
    commit message, a summary, a suggestion or memories; None for an agent or chat turn.
    Never trained on."""
    trajectory_id: str | None = Field(default=None, max_length=128)
    """The agent run: the request id of its first turn."""
    turn_index: int = Field(default=0, ge=0)
    parent_request_id: str | None = Field(default=None, max_length=128)
    """The completion whose messages and answer this request's history continues."""
    token_prefix_match: bool | None = None
    """Whether the parent's prompt + completion token ids exactly prefix this prompt's."""
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    """-1: no top-k truncation."""
    max_tokens: int | None = Field(default=None, ge=1)
    max_tokens_asked: int | None = Field(default=None, ge=1)
    """What the client asked for when it was more than the gateway's cap: the completion was
    served with `max_tokens` at the cap instead."""
    sampling_constraints: list[str] = Field(default_factory=list, max_length=32)
    """Parameters of the request that changed the distribution vLLM sampled from in a way the
    trainer cannot reproduce (`app.gateway.sampling`): the sample is never trained on."""
    prompt_messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    behaviour_logprobs: list[float] | None = None
    completion_text: str | None = None
    finish_reason: str | None = None
    status: CompletionStatus = "ok"
    error: str | None = None
    ttft_ms: float = Field(ge=0)
    ttft_measured: bool = True
    """False for a whole (non-streamed) answer whose first token vLLM did not time: `ttft_ms`
    is then the whole latency, and neither a time-to-first-token nor a per-token penalty is
    charged from it."""
    latency_ms: float = Field(ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    """Tokens generated, also for privacy-mode completions (time per output token)."""
    tool_calls: int = Field(default=0, ge=0)
    malformed_tool_calls: int = Field(default=0, ge=0)
    proposed_edit: bool = False
    completion_chars: int = Field(default=0, ge=0)
    clarifying_question: bool = False

    @model_validator(mode="after")
    def _privacy_has_no_content(self) -> CompletionEvent:
        content = (
            self.prompt_messages,
            self.prompt_token_ids,
            self.completion_token_ids,
            self.behaviour_logprobs,
            self.completion_text,
        )
        if self.privacy and any(field is not None for field in content):
            raise ValueError("privacy-mode completions carry no content")
        if (self.completion_token_ids is None) != (self.behaviour_logprobs is None):
            raise ValueError("completion_token_ids and behaviour_logprobs come together")
        if (
            self.completion_token_ids is not None
            and self.behaviour_logprobs is not None
            and len(self.completion_token_ids) != len(self.behaviour_logprobs)
        ):
            raise ValueError("one behaviour logprob per completion token")
        if self.malformed_tool_calls > self.tool_calls:
            raise ValueError("malformed_tool_calls cannot exceed tool_calls")
        return self


class FeedbackEventBase(Event):
    """What every IDE signal carries besides its kind."""

    received_at: datetime | None = None
    """When a gateway accepted the event, stamped there whatever the client sent: the one time
    of it the client does not choose. None on events queued before gateways stamped it."""
    source: str | None = Field(default=None, max_length=64)
    """None: the client reported it (set so by the gateway, whatever the client sent);
    `history:<client>:<rule>`: the gateway read it from the run's next request
    (`app.signals.history`); `otlp:<client>:<signal>`: from the client's telemetry export
    (`app.client_events.decisions`)."""


class EditAccepted(FeedbackEventBase):
    kind: Literal["edit_accepted"] = "edit_accepted"


class EditRejected(FeedbackEventBase):
    kind: Literal["edit_rejected"] = "edit_rejected"


class EditSurvival(FeedbackEventBase):
    """Share of the accepted edit still present `elapsed_s` after acceptance, or a window the
    IDE never observed (`censored`: it closed, or stopped tracking, before the window)."""

    kind: Literal["edit_survival"] = "edit_survival"
    elapsed_s: float = Field(ge=0, le=7 * 24 * 3600)
    surviving_share: float | None = Field(default=None, ge=0, le=1)
    censored: bool = False
    """No share was measured at this window, nor will be at any later one: missing, not 0."""

    @model_validator(mode="after")
    def _share_or_censored(self) -> EditSurvival:
        if self.censored == (self.surviving_share is not None):
            raise ValueError("a survival report has a surviving_share, or is censored without one")
        return self


class FollowupMessage(FeedbackEventBase):
    """The user's next message in the session after this completion."""

    kind: Literal["followup_message"] = "followup_message"
    message: str | None = Field(default=None, max_length=16_000)
    dissatisfied: bool | None = None
    """Set at the edge for privacy-mode traffic, whose message text is never kept."""

    @model_validator(mode="after")
    def _message_or_verdict(self) -> FollowupMessage:
        if self.message is None and self.dissatisfied is None:
            raise ValueError("a follow-up needs its message or a dissatisfied verdict")
        return self


class SessionEnd(FeedbackEventBase):
    kind: Literal["session_end"] = "session_end"
    api_key_id: UUID | None = None
    """The key that ended the session (set by the gateway, whatever the client sent): a
    session's end finalizes only that key's completions, so a session id that two keys chose
    alike is never ended by the other. None on ends logged before keys were recorded."""


FeedbackEvent = Annotated[
    EditAccepted | EditRejected | EditSurvival | FollowupMessage | SessionEnd,
    Field(discriminator="kind"),
]
FEEDBACK_KINDS = (
    "edit_accepted",
    "edit_rejected",
    "edit_survival",
    "followup_message",
    "session_end",
)


class DeadLetter(BaseModel):
    """A message a worker could not process, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source_topic: str
    partition: int
    offset: int
    key: str | None
    payload: str
    """The original bytes, decoded as UTF-8 with replacement."""
    reason: str
    failed_at: datetime = Field(default_factory=utcnow)


feedback_adapter: TypeAdapter[FeedbackEvent] = TypeAdapter(FeedbackEvent)


def encode(event: BaseModel) -> bytes:
    """Serialize an event for Kafka."""
    return orjson.dumps(event.model_dump(mode="json"))


def decode_completion(raw: bytes) -> CompletionEvent:
    """Parse a `rtrl.completions.v1` message; raises ValueError on bad input."""
    return CompletionEvent.model_validate_json(raw)


def decode_feedback(
    raw: bytes,
) -> EditAccepted | EditRejected | EditSurvival | FollowupMessage | SessionEnd:
    """Parse a `rtrl.feedback.v1` message; raises ValueError on bad input."""
    return feedback_adapter.validate_json(raw)
