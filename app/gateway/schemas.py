"""The OpenAI-compatible wire shapes the gateway speaks."""

from __future__ import annotations

from typing import Any, Literal

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters:
            try:
                validator_for(parameters, default=Draft202012Validator).check_schema(parameters)
            except SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return parameters


class NamedFunction(BaseModel):
    name: str = Field(min_length=1, max_length=128)


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call this tool."""

    type: Literal["function"]
    function: NamedFunction


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
    n: int | None = Field(default=None, ge=1)
    """One choice per request: each completion is one logged sample."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n > 1:
            raise ValueError(
                "only 1 is served: every choice is a logged, trained-on sample, so send n "
                "requests instead (each with its own X-Request-Id)"
            )
        return n

    @model_validator(mode="after")
    def _tools_are_consistent(self) -> ChatRequest:
        declared = {tool.function.name for tool in self.tools or ()}
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in declared:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, "
                    "which is not among the declared tools"
                )
        elif self.tool_choice == "required" and not declared:
            raise ValueError('tool_choice "required" needs declared tools')
        called: set[str] = set()
        for index, message in enumerate(self.messages):
            for call in message.get("tool_calls") or ():
                if isinstance(call, dict) and call.get("id"):
                    called.add(str(call["id"]))
            if message.get("role") == "tool" and message.get("tool_call_id") not in called:
                raise ValueError(
                    f"messages[{index}] answers tool call {message.get('tool_call_id')!r}, "
                    "which no earlier assistant message made"
                )
        return self


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "rtrl"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
