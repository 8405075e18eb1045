"""Anthropic's Messages API on the wire, and its translation to and from the chat completion
the gateway serves every request as (`app.gateway.messages` serves it).

A Messages request reads as a chat request:
  system (a string or text blocks), and `role: "system"` messages   system messages
  text blocks                                                       message text
  tool_use blocks                                                   an assistant's tool calls
  tool_result blocks (text; `is_error` marks the text "Error: ")     tool messages
  tools (name, description, input_schema)                          function tools
  tool_choice auto, any, tool, none                                 auto, required, named, none
  max_tokens, temperature, top_p, top_k, stream                     the same
  stop_sequences                                                    stop
Image and document blocks, and server tools, are refused (400): the served model reads text
only. Thinking blocks, `cache_control`, `thinking`, `metadata`, `context_management`,
`output_config` and `safeguards` are accepted and have no effect. The answer, whole or
streamed, reads back as a Message or its server-sent events.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import orjson

from app.gateway.translation import exceeds_context, translated_events
from app.http.errors import ApiError

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_IGNORED_BLOCKS = ("thinking", "redacted_thinking")
"""Blocks of the model's own reasoning a client re-sends: the served model writes none."""


def chat_body(asked: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request a Messages request asks for; 400 for what the served model
    cannot read."""
    max_tokens = asked.get("max_tokens")
    if max_tokens is None:
        raise _invalid("max_tokens: Field required", "max_tokens")
    if not isinstance(asked.get("messages"), list) or not asked["messages"]:
        raise _invalid("messages: a non-empty list of messages is required", "messages")
    body: dict[str, Any] = {
        "messages": [*_system_messages(asked.get("system")), *_history(asked["messages"])],
        "max_tokens": max_tokens,
        "stream": asked.get("stream", False),
    }
    for name in ("model", "temperature", "top_p", "top_k"):
        if asked.get(name) is not None:
            body[name] = asked[name]
    if asked.get("stop_sequences"):
        body["stop"] = asked["stop_sequences"]
    if asked.get("tools"):
        body["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(asked["tools"])]
    if asked.get("tool_choice") is not None:
        body["tool_choice"] = _chat_tool_choice(asked["tool_choice"])
    if body["stream"] is True:
        body["stream_options"] = {"include_usage": True}
    return body


def _system_messages(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": _text_of(system, "system")}]


def _history(asked: list[Any]) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = []
    for index, message in enumerate(asked):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _invalid(f"{where}: a message is an object", where)
        role, content = message.get("role"), message.get("content")
        if role == "system":
            history.append({"role": "system", "content": _text_of(content, where)})
        elif role == "user":
            history += _user_messages(content, where)
        elif role == "assistant":
            history.append(_assistant_message(content, where))
        else:
            raise _invalid(f"{where}.role: must be user or assistant", f"{where}.role")
    return history


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages (they answer the calls just before),
    then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, texts = [], []
    for index, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "tool_result":
            text = _text_of(block.get("content") or "", f"{where}.content[{index}].content")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": f"Error: {text}" if block.get("is_error") else text,
                }
            )
        elif kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind not in _IGNORED_BLOCKS:
            raise _unreadable(kind, f"{where}.content[{index}]")
    return results + ([{"role": "user", "content": "\n\n".join(texts)}] if texts else [])


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for index, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind not in _IGNORED_BLOCKS:
            raise _unreadable(kind, f"{where}.content[{index}]")
    message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise _invalid(f"{where}.content: a string or a list of content blocks", where)
    return content


def _text_of(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    texts = []
    for index, block in enumerate(_blocks(content, where)):
        if block.get("type") == "text":
            texts.append(str(block.get("text", "")))
        elif block.get("type") not in _IGNORED_BLOCKS:
            raise _unreadable(block.get("type"), f"{where}[{index}]")
    return "\n\n".join(texts)


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise _invalid(
            f"{where}: tool type {kind!r} is not served; declare tools with a name, a "
            "description and an input_schema",
            where,
        )
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise _invalid("tool_choice.type: must be auto, any, tool or none", "tool_choice")


def anthropic_message(
    completion: dict[str, Any], request_id: str, stop_sequences: list[str]
) -> dict[str, Any]:
    """A Message of a chat completion the gateway answered."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": _input(function.get("arguments")),
            }
        )
    usage = completion.get("usage") or {}
    stop_reason, stop_sequence = _stop(choice, bool(message.get("tool_calls")), stop_sequences)
    return {
        "id": f"msg_{request_id}",
        "type": "message",
        "role": "assistant",
        "model": completion.get("model"),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
        },
    }


def message_events(
    chunks: AsyncIterator[bytes], request_id: str, checkpoint: str, stop_sequences: list[str]
) -> AsyncIterator[bytes]:
    """The Message's server-sent events, from the chat completion chunks the gateway relays."""
    return translated_events(chunks, _MessageStream(request_id, checkpoint, stop_sequences))


class _MessageStream:
    """Anthropic's events for one streamed answer: one content block per text run or tool
    call, opened as it begins and closed when the next begins or the answer ends."""

    def __init__(self, request_id: str, checkpoint: str, stop_sequences: list[str]) -> None:
        self.request_id = request_id
        self.checkpoint = checkpoint
        self.stop_sequences = stop_sequences
        self.blocks = 0
        self.open: str | int | None = None
        """The open block: "text", a tool call's index, or None."""
        self.choice: dict[str, Any] = {}
        self.tool_calls = False
        self.usage: dict[str, Any] = {}

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": f"msg_{self.request_id}",
            "type": "message",
            "role": "assistant",
            "model": self.checkpoint,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", {"message": message})

    def event_of(self, line: bytes) -> bytes:
        if not line.startswith(b"data:"):
            return b""
        data = line[5:].strip()
        if data == b"[DONE]":
            return self._end()
        chunk = orjson.loads(data)
        if "error" in chunk:
            error = {"type": "api_error", "message": str(chunk["error"].get("message"))}
            return self._close() + _event("error", {"error": error})
        self.usage = chunk.get("usage") or self.usage
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open != "text":
                    events.append(self._open("text", {"type": "text", "text": ""}))
                text = {"type": "text_delta", "text": delta["content"]}
                events.append(_event("content_block_delta", {"index": self._at, "delta": text}))
            for position, call in enumerate(delta.get("tool_calls") or []):
                events.append(self._tool_call_delta(call.get("index", position), call))
            if choice.get("finish_reason"):
                self.choice = choice
        return b"".join(events)

    @property
    def _at(self) -> int:
        return self.blocks - 1

    def _tool_call_delta(self, index: int, call: dict[str, Any]) -> bytes:
        events = []
        function = call.get("function") or {}
        if self.open != index:
            self.tool_calls = True
            block = {"type": "tool_use", "id": call.get("id"), "name": function.get("name")}
            events.append(self._open(index, block | {"input": {}}))
        if function.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append(_event("content_block_delta", {"index": self._at, "delta": delta}))
        return b"".join(events)

    def _open(self, block: str | int, content_block: dict[str, Any]) -> bytes:
        closed = self._close()
        self.open, self.blocks = block, self.blocks + 1
        start = {"index": self._at, "content_block": content_block}
        return closed + _event("content_block_start", start)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _event("content_block_stop", {"index": self._at})

    def _end(self) -> bytes:
        stop_reason, stop_sequence = _stop(self.choice, self.tool_calls, self.stop_sequences)
        usage = {
            "input_tokens": self.usage.get("prompt_tokens", 0),
            "output_tokens": self.usage.get("completion_tokens", 0),
        }
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return (
            self._close()
            + _event("message_delta", {"delta": delta, "usage": usage})
            + _event("message_stop", {})
        )


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name} | data) + b"\n\n"


def _stop(
    choice: dict[str, Any], called_tools: bool, stop_sequences: list[str]
) -> tuple[str | None, str | None]:
    """Anthropic's stop reason, and the stop sequence that ended the answer, if one did."""
    finish_reason = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if finish_reason == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    if called_tools and finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    return _STOP_REASONS.get(finish_reason or "", "end_turn"), None


def _input(arguments: Any) -> Any:
    """A tool call's arguments as the object Anthropic's `input` is; `{}` when the model wrote
    none that parse as one (the gateway logs such a call as malformed)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def in_anthropic_terms(exc: ApiError) -> ApiError:
    """vLLM's answer to a prompt longer than the model's context, in the words Claude Code
    compacts its history on (with the counts it reads, when vLLM gave them); any other error
    as it is."""
    if not exceeds_context(exc):
        return exc
    limit = _CONTEXT_LIMIT.search(exc.message)
    prompt = _PROMPT_TOKENS.search(exc.message)
    if limit and prompt:
        message = f"prompt is too long: {prompt[1]} tokens > {limit[1]} maximum"
    else:
        message = f"prompt is too long: {exc.message}"
    return ApiError(400, message, code="context_length_exceeded")


# vLLM's words: "This model's maximum context length is 1024 tokens. However, your prompt
# contains 1503 input tokens, ..." or "Input length (1503) exceeds model's maximum context
# length (1024)."
_CONTEXT_LIMIT = re.compile(r"maximum context length(?: is|) \(?(\d+)")
_PROMPT_TOKENS = re.compile(r"(?:contains (?:at least )?|Input length \()(\d+)(?: input tokens|\))")


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


def _unreadable(kind: Any, where: str) -> ApiError:
    return _invalid(
        f"{where}: {kind!r} blocks are not served: the model reads text, tool_use and "
        "tool_result blocks only",
        where,
    )
