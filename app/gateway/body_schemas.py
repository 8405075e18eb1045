"""The request bodies of the Messages and Responses surfaces, as OpenAPI documents them.

Both routes read their bodies themselves (`app.gateway.surfaces`: a body is parsed once, on
the hot path, and translated to the chat call), so FastAPI has no model to describe them with.
These JSON Schemas say what the gateway reads of each API's body; every other field a client
sends is accepted and has no effect (`additionalProperties`), as the modules that translate
them say (`app.gateway.anthropic`, `app.gateway.openai_responses`). They document the routes
and let a fuzzer build bodies of the right shape; the translation, not the schema, decides
what is refused.
"""

from __future__ import annotations

from typing import Any

_TEXT = {"type": "string"}
_ANY_OBJECT = {"type": "object", "additionalProperties": True}

_ANTHROPIC_BLOCK: dict[str, Any] = {
    "type": "object",
    "required": ["type"],
    "additionalProperties": True,
    "properties": {
        "type": {
            "type": "string",
            "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"],
            "description": "Images and documents are refused: the served model reads text.",
        },
        "text": _TEXT,
        "id": {**_TEXT, "description": "A tool_use block's id (the gateway's call id)."},
        "name": _TEXT,
        "input": _ANY_OBJECT,
        "tool_use_id": _TEXT,
        "content": {"oneOf": [_TEXT, {"type": "array", "items": _ANY_OBJECT}]},
        "is_error": {"type": "boolean"},
        "cache_control": {**_ANY_OBJECT, "description": "Accepted; no effect."},
    },
}
_ANTHROPIC_CONTENT = {"oneOf": [_TEXT, {"type": "array", "items": _ANTHROPIC_BLOCK}]}

MESSAGES_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["max_tokens", "messages"],
    "additionalProperties": True,
    "description": (
        "Anthropic's Messages request. Also accepted and without effect: `metadata`, "
        "`thinking`, `context_management`, `output_config`, `safeguards`, `service_tier`."
    ),
    "properties": {
        "model": {**_TEXT, "description": "Ignored: the gateway picks the checkpoint."},
        "max_tokens": {
            "type": "integer",
            "minimum": 1,
            "description": "Held to the gateway's cap (`RTRL_MAX_COMPLETION_TOKENS`).",
        },
        "messages": {
            "type": "array",
            "minItems": 1,
            "description": (
                "`role` user, assistant or system (Claude Code puts system messages here); "
                "`content` a string or blocks: text, tool_use, tool_result (`is_error`), "
                "thinking (ignored); `cache_control` markers have no effect."
            ),
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "additionalProperties": True,
                "properties": {
                    "role": {"type": "string", "enum": ["user", "assistant", "system"]},
                    "content": _ANTHROPIC_CONTENT,
                },
            },
        },
        "system": {**_ANTHROPIC_CONTENT, "description": "A string or text blocks."},
        "stream": {"type": "boolean", "description": "Anthropic's server-sent events."},
        "temperature": {"type": "number"},
        "top_p": {"type": "number"},
        "top_k": {"type": "integer"},
        "stop_sequences": {"type": "array", "items": _TEXT},
        "tools": {
            "type": "array",
            "description": "`name`, `description`, `input_schema` (a JSON Schema).",
            "items": {
                "type": "object",
                "required": ["name", "input_schema"],
                "additionalProperties": True,
                "properties": {
                    "name": _TEXT,
                    "description": _TEXT,
                    "input_schema": _ANY_OBJECT,
                },
            },
        },
        "tool_choice": {
            "type": "object",
            "description": "`type` auto, any, tool (with `name`) or none.",
            "required": ["type"],
            "additionalProperties": True,
            "properties": {
                "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
                "name": _TEXT,
            },
        },
    },
}

_RESPONSES_ITEM: dict[str, Any] = {
    "type": "object",
    "additionalProperties": True,
    "description": (
        "A message (`role` user, assistant, system or developer; `content` a string or text "
        "parts), a `function_call` (`call_id`, `name`, `arguments`), a "
        "`function_call_output` (`call_id`, `output`), or a reasoning item (ignored)."
    ),
    "properties": {
        "type": _TEXT,
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [_TEXT, {"type": "array", "items": _ANY_OBJECT}]},
        "call_id": _TEXT,
        "name": _TEXT,
        "arguments": _TEXT,
        "output": {"oneOf": [_TEXT, {"type": "array", "items": _ANY_OBJECT}]},
    },
}

RESPONSES_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["input"],
    "additionalProperties": True,
    "description": (
        "OpenAI's Responses request, stateless (`store` has no effect; `previous_response_id` "
        "is refused). Also accepted and without effect: `include`, `reasoning`, `text`, "
        "`prompt_cache_key`, `metadata`, `client_metadata`, `truncation`, `service_tier`, "
        "`user`, `parallel_tool_calls`."
    ),
    "properties": {
        "model": {**_TEXT, "description": "Ignored: the gateway picks the checkpoint."},
        "instructions": {**_TEXT, "description": "The system message."},
        "input": {
            "oneOf": [_TEXT, {"type": "array", "items": _RESPONSES_ITEM}],
            "description": (
                "A user message's text, or items: messages (user, assistant, system, "
                "developer), `function_call`, `function_call_output`, reasoning (ignored)."
            ),
        },
        "max_output_tokens": {
            "type": "integer",
            "minimum": 1,
            "description": "Held to the gateway's cap (`RTRL_MAX_COMPLETION_TOKENS`).",
        },
        "stream": {"type": "boolean", "description": "The `response.*` server-sent events."},
        "temperature": {"type": "number"},
        "top_p": {"type": "number"},
        "tools": {
            "type": "array",
            "description": "`function` tools are shown to the model; other types are not.",
            "items": {
                "type": "object",
                "required": ["type"],
                "additionalProperties": True,
                "description": (
                    "`function` tools (`name`, `parameters`) are shown to the model; other "
                    "types (`web_search`, `namespace`, `custom`, ...) are accepted and not."
                ),
                "properties": {"type": _TEXT, "name": _TEXT, "parameters": _ANY_OBJECT},
            },
        },
        "tool_choice": {
            "oneOf": [
                {"type": "string", "enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "required": ["type", "name"],
                    "properties": {"type": {"const": "function"}, "name": _TEXT},
                },
            ]
        },
    },
}


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is read by the route itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
