"""Chat prompts as token ids, and answers generated with transformers (greedy or sampled)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast

Conversation = str | list[dict[str, Any]]
"""A one-turn request, or an agent run's messages so far."""


def prompt_ids(
    tokenizer: PreTrainedTokenizerFast, conversation: Conversation, tools: list[Any] | None = None
) -> list[int]:
    """Token ids of a chat prompt (with the declared tools, if any), ending where the
    assistant's answer starts."""
    messages = (
        [{"role": "user", "content": conversation}]
        if isinstance(conversation, str)
        else conversation
    )
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(rendered, str)
    return tokenizer.encode(rendered, add_special_tokens=False)


@torch.no_grad()
def generate_answers(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    conversations: Sequence[Conversation],
    *,
    sample: bool,
    max_new_tokens: int,
    batch_size: int = 64,
    tools: list[Any] | None = None,
) -> list[str]:
    """The model's next answers to chat conversations, greedy or sampled at temperature 1."""
    assert tokenizer.pad_token_id is not None
    # Sampling from the full distribution, as vLLM does at temperature 1 by default.
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **(sampling if sample else {"do_sample": False}),
    )
    answers = []
    for start in range(0, len(conversations), batch_size):
        prompts = [
            prompt_ids(tokenizer, conversation, tools)
            for conversation in conversations[start : start + batch_size]
        ]
        width = max(len(ids) for ids in prompts)
        # Left padding, so every answer continues right after its prompt.
        input_ids = torch.tensor(
            [[tokenizer.pad_token_id] * (width - len(ids)) + ids for ids in prompts]
        )
        attention_mask = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts]
        )
        output = model.generate(  # type: ignore[operator]
            input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
        )
        answers += tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    return answers
