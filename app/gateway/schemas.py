"""The OpenAI-compatible wire shapes the gateway speaks, errors included."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "conflict_error",
    "rate_limit_error",
    "request_too_large",
    "service_unavailable",
    "api_error",
]


class ApiError(Exception):
    """An error answered in the OpenAI error shape: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: ErrorType = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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
