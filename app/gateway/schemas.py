"""The OpenAI-compatible wire shapes the gateway speaks."""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

import orjson
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_TOOLS = 128
"""Most tools one request may declare."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of a tool's parameter schema (objects and arrays): real tools nest a few
levels; 300 levels of `items` once overflowed the validator's recursion."""
MAX_SCHEMA_NODES = 10_000
"""Most values (objects, arrays, scalars) in one tool's parameter schema."""
MAX_REQUEST_SCHEMA_NODES = 20_000
"""Most values in all of one request's tool schemas together. Checking a schema against its
metaschema costs ~0.1 ms a value on this hardware, so this bounds what one request that
brings schemas never seen before costs (~2 s, off the event loop: `app.gateway.surfaces`);
the stock coding agents declare a few thousand."""
LARGE_CHECKED_SCHEMAS = 32
"""Schemas above `CHECKED_SCHEMA_BYTES` whose verdict is kept too, by digest: an agent that
declares one re-sends it every turn, and each check costs up to a second."""
CHECKED_SCHEMAS = 512
"""Tool schemas whose verdict and validator are kept: an agent declares the same tools on
every turn, and checking a schema against its metaschema costs milliseconds."""
CHECKED_SCHEMA_BYTES = 16_384
"""Larger schemas are checked every time they come, so the kept ones stay a few MB."""


def schema_values(schema: Any, limit: int) -> int:
    """How many values `schema` holds, counted up to `limit + 1` at most (iterative)."""
    pending, count = [schema], 0
    while pending and count <= limit:
        node = pending.pop()
        count += 1
        if isinstance(node, dict):
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return count


def schema_shape_problem(schema: dict[str, Any]) -> str | None:
    """What makes a tool schema unacceptable before it is compiled: too deep, too large, or
    a `$ref` that does not resolve inside it (checked here, so a call is never judged against
    a schema that fails after vLLM answered). None when it is fine. Iterative: no recursion
    however deep the input."""
    pending: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while pending:
        node, depth = pending.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"more than {MAX_SCHEMA_NODES} values (the limit)"
        if depth > MAX_SCHEMA_DEPTH:
            return f"nested deeper than {MAX_SCHEMA_DEPTH} levels (the limit)"
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not _resolves(schema, ref):
                return f"$ref {ref!r} does not point inside the schema (only '#/...' refs)"
            pending.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            pending.extend((value, depth + 1) for value in node)
    return None


def _resolves(schema: dict[str, Any], ref: str) -> bool:
    """Whether `ref` is a local JSON pointer (`#` or `#/a/b`) to a value inside `schema`."""
    if not (ref == "#" or ref.startswith("#/")):
        return False
    target: Any = schema
    for token in ref[2:].split("/") if ref != "#" else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and token in target:
            target = target[token]
        elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
            target = target[int(token)]
        else:
            return False
    return isinstance(target, dict | bool)


@dataclass(frozen=True, slots=True)
class CheckedSchema:
    """A tool's parameter schema as judged once: why it is refused, or its validator."""

    problem: str | None
    validator: Validator | None


def checked_schema(parameters: dict[str, Any]) -> CheckedSchema:
    """The verdict on a tool's parameter schema, kept for the next request that declares it
    (see `CHECKED_SCHEMAS`)."""
    try:
        encoded = orjson.dumps(parameters)
    except TypeError:  # not JSON (a caller's own objects): judged, not kept
        return _check_schema(parameters)
    if len(encoded) > CHECKED_SCHEMA_BYTES:
        return _kept_large_schema(encoded)
    return _kept_schema(encoded)


@functools.lru_cache(maxsize=CHECKED_SCHEMAS)
def _kept_schema(encoded: bytes) -> CheckedSchema:
    # Judged on a copy of its own: the validator outlives the request that brought it.
    return _check_schema(orjson.loads(encoded))


_large_schemas: OrderedDict[bytes, CheckedSchema] = OrderedDict()
_large_schemas_lock = threading.Lock()


def _kept_large_schema(encoded: bytes) -> CheckedSchema:
    digest = hashlib.blake2b(encoded, digest_size=20).digest()
    with _large_schemas_lock:
        if (kept := _large_schemas.get(digest)) is not None:
            _large_schemas.move_to_end(digest)
            return kept
    checked = _check_schema(orjson.loads(encoded))
    with _large_schemas_lock:
        _large_schemas[digest] = checked
        while len(_large_schemas) > LARGE_CHECKED_SCHEMAS:
            _large_schemas.popitem(last=False)
    return checked


def _check_schema(parameters: dict[str, Any]) -> CheckedSchema:
    problem = schema_shape_problem(parameters)
    if problem:
        return CheckedSchema(f"not an acceptable JSON Schema: {problem}", None)
    cls = validator_for(parameters, default=Draft202012Validator)
    try:
        cls.check_schema(parameters)
    except SchemaError as exc:
        return CheckedSchema(f"not a valid JSON Schema: {exc.message}", None)
    validator: Validator = cls(without_patterns(parameters))
    return CheckedSchema(None, validator)


# Keywords whose value is one subschema, a list of them, or a map of names to them.
_SUBSCHEMA = frozenset(
    {
        "additionalProperties", "additionalItems", "contains", "else", "if", "items", "not",
        "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
    }
)  # fmt: skip
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("$defs", "definitions", "dependentSchemas", "properties")


def without_patterns(schema: Any) -> Any:
    """`schema` with no client regex left in it: the validator of a tool's arguments never runs
    one. jsonschema matches `pattern` and `patternProperties` with Python's backtracking `re`,
    on what the model wrote, on the event loop: `^(\\w+\\s?)*$` against a sentence never
    returns. Leaving them out only ever accepts more, so a call is never counted malformed for
    a pattern; where `patternProperties` went, so do the `additionalProperties` and
    `unevaluatedProperties` beside it, which would otherwise refuse the names it matched."""
    if not isinstance(schema, dict):
        return schema
    kept = {key: value for key, value in schema.items() if key != "pattern"}
    if kept.pop("patternProperties", None) is not None:
        kept.pop("additionalProperties", None)
        kept.pop("unevaluatedProperties", None)
    for key, value in kept.items():
        if key in _SUBSCHEMA_LISTS and isinstance(value, list):
            kept[key] = [without_patterns(item) for item in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            kept[key] = {name: without_patterns(item) for name, item in value.items()}
        elif key in _SUBSCHEMA:
            kept[key] = without_patterns(value)
    return kept


class CheckedParameters(dict[str, Any]):
    """A tool's parameter schema as declared, carrying the verdict it was validated with: the
    answer's tool calls are judged by the same validator, not one looked up again."""

    __slots__ = ("checked",)

    def __init__(self, parameters: dict[str, Any], checked: CheckedSchema) -> None:
        super().__init__(parameters)
        self.checked = checked


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    _checked: CheckedSchema | None = PrivateAttr(default=None)

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if not parameters:
            return parameters
        checked = checked_schema(parameters)
        if checked.problem:
            raise ValueError(checked.problem)
        return CheckedParameters(parameters, checked)

    @property
    def validator(self) -> Validator | None:
        """The compiled validator of the parameters; None when they constrain nothing (or
        are not a schema a validator can be built from)."""
        if not self.parameters:
            return None
        if isinstance(self.parameters, CheckedParameters):
            return self.parameters.checked.validator
        if self._checked is None:
            self._checked = checked_schema(self.parameters)
        return self._checked.validator


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


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    """An assistant message's tool call as clients send it back in the history."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: str | None = None
    function: CalledFunction | None = None


class ChatMessage(BaseModel):
    """The shape of one history message; the request keeps the message as sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatRequest(BaseModel):
    """The fields of a chat completion request the gateway reads; the rest pass through."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    """Ignored for routing: the gateway decides which checkpoint answers."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
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
    prompt_logprobs: None = None
    """Refused (vLLM's extension): the prompt's logprobs make an answer as large as the prompt
    times the alternatives asked, and no client needs them from a coding assistant."""
    echo: Literal[False] | None = None
    """Refused when true (vLLM's extension, the prompt repeated in the answer), as above."""

    @field_validator("prompt_logprobs", "echo", mode="before")
    @classmethod
    def _no_prompt_in_the_answer(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or (info.field_name == "echo" and value is False):
            return value
        raise ValueError(
            "not served: the gateway answers with the completion only (it makes the answer as"
            " large as the prompt); leave it out"
        )

    @model_validator(mode="before")
    @classmethod
    def _tool_schemas_within_budget(cls, data: Any) -> Any:
        # Before any schema is compiled: the budget bounds what checking them costs.
        tools = data.get("tools") if isinstance(data, dict) else None
        if not isinstance(tools, list):
            return data
        left = MAX_REQUEST_SCHEMA_NODES
        for tool in tools[: MAX_TOOLS + 1]:
            function = tool.get("function") if isinstance(tool, dict) else None
            parameters = function.get("parameters") if isinstance(function, dict) else None
            left -= schema_values(parameters, left) if parameters is not None else 0
            if left < 0:
                raise ValueError(
                    "tools: their parameter schemas hold more than "
                    f"{MAX_REQUEST_SCHEMA_NODES} values together (the limit per request)"
                )
        return data

    @field_validator("messages")
    @classmethod
    def _well_formed_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for index, message in enumerate(messages):
            try:
                ChatMessage.model_validate(message)
            except ValidationError as exc:
                error = exc.errors()[0]
                where = "".join(
                    f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
                )
                raise ValueError(f"messages[{index}]{where}: {error['msg']}") from None
        return messages

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
