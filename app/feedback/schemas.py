"""The body and answer of `POST /v1/feedback`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class FeedbackBatch(BaseModel):
    """IDE events, each one of the `rtrl.feedback.v1` kinds; validated one by one."""

    model_config = ConfigDict(extra="forbid")

    events: list[dict[str, Any]] = Field(min_length=1)


class FeedbackAccepted(BaseModel):
    """How many events were queued for Kafka, and how many were already seen."""

    accepted: int
    duplicates: int
