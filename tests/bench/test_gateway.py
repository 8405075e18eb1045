"""bench.gateway's Messages and Responses requests are the chat it times them against."""

from __future__ import annotations

import pytest

from app.gateway import anthropic, openai_responses
from bench.gateway import COMPLETION_TOKENS, WORKLOADS, surface_request


@pytest.mark.parametrize(
    ("workload", "translate"),
    [
        ("messages-agent-fresh", anthropic.chat_body),
        ("responses-agent-fresh", openai_responses.chat_body),
    ],
)
def test_the_gateway_reads_a_surface_request_as_the_agent_chat(workload, translate) -> None:
    agent = WORKLOADS["agent-fresh"]
    chat = {"model": "rtrl", "messages": agent.messages, "max_tokens": COMPLETION_TOKENS}
    chat["tools"] = agent.tools

    asked = surface_request(WORKLOADS[workload].surface, chat)

    assert translate(asked) == chat | {"stream": False}
