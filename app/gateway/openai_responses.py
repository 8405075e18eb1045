"""OpenAI's Responses API on the wire, and its translation to and from the chat completion
the gateway serves every request as (`app.gateway.responses` serves it).

A Responses request reads as a chat request:
  instructions                                          a system message first
  input: a string                                       one user message
  input items: messages (user, assistant, system,       messages (`developer` as system), their
    developer) with text parts                          text parts joined
  function_call items (and an assistant message          one assistant message with tool calls
    before them)
  function_call_output items                            tool messages
  tools of type function                                function tools
  tool_choice auto, none, required, a function          the same
  max_output_tokens, temperature, top_p, stream         max_tokens, temperature, top_p, stream
Image and file parts are refused (400): the served model reads text only. Tools of other types
(`web_search`, `namespace`, `custom`, `file_search`, ...) are not shown to the model: it calls
only function tools, so a client that declared them never sees a call it must run. Reasoning
items, `store`, `include`, `reasoning`, `text`, `prompt_cache_key`, `metadata`,
`client_metadata`, `truncation`, `service_tier` and `user` are accepted and have no effect;
nothing is stored, so `previous_response_id` is refused (400): a client sends the whole
conversation in `input`, as Codex does (`store: false`).

The answer, whole or streamed, reads back as a Response or its `response.*` events.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from app.gateway.translation import Answering, exceeds_context, translated_events
from app.http.errors import ApiError

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_IGNORED_ITEMS = (
    "reasoning",
    "web_search_call",
    "file_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "item_reference",
)
"""Items of the model's reasoning or of hosted tools a client may re-send: the served model
writes none and runs no hosted tool."""
_MESSAGE_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}


def chat_body(asked: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request a Responses request asks for; 400 for what the served
    model cannot read."""
    if asked.get("previous_response_id"):
        raise _invalid(
            "previous_response_id: this gateway stores no responses; send the whole "
            "conversation in input (with store: false)",
            "previous_response_id",
        )
    messages = _instructions(asked.get("instructions")) + _input(asked.get("input"))
    if not messages:
        raise _invalid("input: a string or a non-empty list of input items is required", "input")
    body: dict[str, Any] = {"messages": messages, "stream": asked.get("stream", False)}
    if asked.get("max_output_tokens") is not None:
        body["max_tokens"] = asked["max_output_tokens"]
    for name in ("model", "temperature", "top_p", "parallel_tool_calls"):
        if asked.get(name) is not None:
            body[name] = asked[name]
    tools = _chat_tools(asked.get("tools"))
    if tools:
        body["tools"] = tools
        if asked.get("tool_choice") is not None:
            body["tool_choice"] = _chat_tool_choice(asked["tool_choice"])
    if body["stream"] is True:
        body["stream_options"] = {"include_usage": True}
    return body


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None or instructions == "":
        return []
    if not isinstance(instructions, str):
        raise _invalid("instructions: a string", "instructions")
    return [{"role": "system", "content": instructions}]


def _input(asked: Any) -> list[dict[str, Any]]:
    if isinstance(asked, str):
        return [{"role": "user", "content": asked}]
    if not isinstance(asked, list):
        raise _invalid("input: a string or a list of input items", "input")
    history: list[dict[str, Any]] = []
    for index, item in enumerate(asked):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _invalid(f"{where}: an input item is an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _add_message(history, item, where)
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(history, item, kind, where)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            text = _text_of(item.get("output") or "", f"{where}.output")
            history.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind not in _IGNORED_ITEMS:
            raise _invalid(
                f"{where}: {kind!r} items are not served: the model reads messages, "
                "function_call and function_call_output items only",
                where,
            )
    return history


def _add_message(history: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    role = _MESSAGE_ROLES.get(str(item.get("role")))
    if role is None:
        raise _invalid(
            f"{where}.role: must be user, assistant, system or developer", f"{where}.role"
        )
    history.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})


def _add_call(history: list[dict[str, Any]], item: dict[str, Any], kind: str, where: str) -> None:
    """A call the model made, onto the assistant message it belongs to (the one just before,
    when the answer had text or other calls; else a new one)."""
    if kind == "function_call":
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise _invalid(f"{where}.arguments: a string of JSON", f"{where}.arguments")
    else:
        arguments = orjson.dumps({"input": item.get("input", "")}).decode()
    call = {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": item.get("name"), "arguments": arguments},
    }
    last = history[-1] if history else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        history.append(last)
    last.setdefault("tool_calls", []).append(call)


def _text_of(content: Any, where: str) -> str:
    """The text of a string or of a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise _invalid(f"{where}: a string or a list of content parts", where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise _invalid(
                f"{where}[{index}]: {kind!r} parts are not served: the model reads text only",
                f"{where}[{index}]",
            )
        texts.append(str(part.get("text", part.get("refusal", ""))))
    return "\n\n".join(texts)


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """The function tools, as chat declares them; tools of other types are left out."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _invalid("tools: a list of tools", "tools")
    declared = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _invalid(f"tools[{index}]: a tool is an object", f"tools[{index}]")
        if tool.get("type") != "function":
            continue
        function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        declared.append({"type": "function", "function": function})
    return declared


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return "required" if choice.get("mode") == "required" else "auto"
    raise _invalid("tool_choice: must be auto, none, required, or a function tool", "tool_choice")


def response_body(content: bytes, answering: Answering) -> bytes:
    """The Response of a chat completion the gateway answered, as sent."""
    return orjson.dumps(response_object(orjson.loads(content), answering))


def response_object(completion: dict[str, Any], answering: Answering) -> dict[str, Any]:
    """A Response of a chat completion the gateway answered."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(_message_item(answering.request_id, message["content"]))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append(_call_item(call.get("id"), function.get("name"), function.get("arguments")))
    return _response(answering, output, choice.get("finish_reason"), completion.get("usage") or {})


def _message_item(request_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
    return {
        "type": "message",
        "id": f"msg_{request_id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _call_item(
    call_id: Any, name: Any, arguments: Any, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments if isinstance(arguments, str) else "",
        "status": status,
    }


def _response(
    answering: Answering,
    output: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, Any],
    *,
    status: str | None = None,
) -> dict[str, Any]:
    asked = answering.asked
    incomplete = finish_reason == "length"
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "id": f"resp_{answering.request_id}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status or ("incomplete" if incomplete else "completed"),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": asked.get("instructions"),
        "max_output_tokens": answering.body.get("max_tokens", asked.get("max_output_tokens")),
        "model": answering.checkpoint,
        "output": output,
        "parallel_tool_calls": asked.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": asked.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": asked.get("tool_choice", "auto"),
        "tools": asked.get("tools") or [],
        "top_p": asked.get("top_p"),
        "truncation": "disabled",
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
        "metadata": asked.get("metadata") or {},
    }


def response_events(chunks: AsyncIterator[bytes], answering: Answering) -> AsyncIterator[bytes]:
    """The Response's server-sent events, from the chat completion chunks the gateway relays."""
    return translated_events(chunks, _ResponseStream(answering))


class _ResponseStream:
    """The `response.*` events of one streamed answer: one output item for its text and one
    for each tool call, added as it begins and done when the next begins or the answer ends."""

    def __init__(self, answering: Answering) -> None:
        self.answering = answering
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: str | int | None = None
        """The open item: "text", a tool call's index, or None."""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}

    def start(self) -> bytes:
        response = _response(self.answering, [], None, {}, status="in_progress")
        return self._event("response.created", {"response": response}) + self._event(
            "response.in_progress", {"response": response}
        )

    def event_of(self, line: bytes) -> bytes:
        if not line.startswith(b"data:"):
            return b""
        data = line[5:].strip()
        if data == b"[DONE]":
            return self._end()
        chunk = orjson.loads(data)
        if "error" in chunk:
            return self._close() + self._failed(str(chunk["error"].get("message")))
        self.usage = chunk.get("usage") or self.usage
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events.append(self._text_delta(delta["content"]))
            for position, call in enumerate(delta.get("tool_calls") or []):
                events.append(self._call_delta(call.get("index", position), call))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return b"".join(events)

    @property
    def _at(self) -> int:
        return len(self.items) - 1

    def _text_delta(self, text: str) -> bytes:
        events = b""
        if self.open != "text":
            item = _message_item(self.answering.request_id, "", "in_progress")
            events += self._add("text", item)
            part = {"type": "output_text", "text": "", "annotations": []}
            events += self._event("response.content_part.added", self._text_at() | {"part": part})
            item["content"] = [part]
        part = self.items[-1]["content"][0]
        part["text"] += text
        return events + self._event("response.output_text.delta", self._text_at() | {"delta": text})

    def _text_at(self) -> dict[str, Any]:
        item_id = self.items[-1]["id"]
        return {"item_id": item_id, "output_index": self._at, "content_index": 0}

    def _call_delta(self, index: int, call: dict[str, Any]) -> bytes:
        events = b""
        function = call.get("function") or {}
        if self.open != index:
            item = _call_item(call.get("id"), function.get("name"), "", "in_progress")
            events += self._add(index, item)
        if function.get("arguments"):
            item = self.items[-1]
            item["arguments"] += function["arguments"]
            delta = {"item_id": item["id"], "output_index": self._at}
            events += self._event(
                "response.function_call_arguments.delta", delta | {"delta": function["arguments"]}
            )
        return events

    def _add(self, kind: str | int, item: dict[str, Any]) -> bytes:
        closed = self._close()
        self.open = kind
        self.items.append(item)
        added = {"output_index": self._at, "item": dict(item)}
        return closed + self._event("response.output_item.added", added)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        item, events = self.items[-1], b""
        if self.open == "text":
            text = item["content"][0]["text"]
            events += self._event("response.output_text.done", self._text_at() | {"text": text})
            part = item["content"][0]
            events += self._event("response.content_part.done", self._text_at() | {"part": part})
        else:
            done = {"item_id": item["id"], "output_index": self._at, "name": item["name"]}
            events += self._event(
                "response.function_call_arguments.done", done | {"arguments": item["arguments"]}
            )
        item["status"] = "completed"
        self.open = None
        return events + self._event(
            "response.output_item.done", {"output_index": self._at, "item": item}
        )

    def _end(self) -> bytes:
        response = _response(self.answering, self.items, self.finish_reason, self.usage)
        name = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._close() + self._event(name, {"response": response})

    def _failed(self, message: str) -> bytes:
        response = _response(self.answering, self.items, None, self.usage, status="failed")
        response["error"] = {"code": "server_error", "message": message}
        return self._event("response.failed", {"response": response})

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        payload = {"type": name, "sequence_number": self.sequence} | data
        self.sequence += 1
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def in_responses_terms(exc: ApiError) -> ApiError:
    """vLLM's answer to a prompt longer than the model's context, in OpenAI's words and code
    (`context_length_exceeded`, which Codex compacts its history on); any other error as it
    is."""
    if not exceeds_context(exc):
        return exc
    return ApiError(
        400,
        "Your input exceeds the context window of this model. Please adjust your input and "
        f"try again. ({exc.message})",
        code="context_length_exceeded",
        param="input",
    )


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)
