"""The OpenAI-compatible wire shapes the gateway speaks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatRequest(BaseModel):
    """The fields of a chat completion request the gateway reads; the rest pass through."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    """Ignored for routing: the gateway decides which checkpoint answers."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    tools: list[ToolSpec] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=None, ge=1, le=1)
    """One choice per request: each completion is one logged sample."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "rtrl"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
