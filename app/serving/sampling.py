"""Sampling completions from a vLLM replica with the token ids and logprobs it used."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from app.serving.replicas import ReplicaError, refused_key, vllm_headers

MAX_PROMPTS_PER_REQUEST = 1024
"""vLLM's limit on a completions request's prompt list (`VLLM_MAX_COMPLETION_PROMPTS`)."""


@dataclass(frozen=True)
class ServedCompletion:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


def sample_completions(
    replica: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 48,
    temperature: float = 1.0,
    timeout: float = 300.0,
    api_key: str = "",
) -> list[ServedCompletion]:
    """One completion per prompt (token ids in), as the behaviour policy sampled it; more
    prompts than vLLM takes in one request go in several.

    No per-request `seed`: vLLM's CPU backend kills its engine on a seeded request
    ("CPU Generator does not use offset").
    """
    return [
        completion
        for start in range(0, len(prompts), MAX_PROMPTS_PER_REQUEST)
        for completion in _sample(
            replica,
            model,
            prompts[start : start + MAX_PROMPTS_PER_REQUEST],
            max_tokens=max_tokens,
            temperature=temperature,
            timeout=timeout,
            api_key=api_key,
        )
    ]


def _sample(
    replica: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    temperature: float,
    timeout: float,
    api_key: str,
) -> list[ServedCompletion]:
    body: dict[str, object] = {
        "model": model,
        "prompt": [list(prompt) for prompt in prompts],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "logprobs": 0,
        "return_token_ids": True,
    }
    try:
        response = httpx.post(
            f"{replica}/v1/completions", json=body, timeout=timeout, headers=vllm_headers(api_key)
        )
    except httpx.HTTPError as exc:
        raise ReplicaError(replica, f"unreachable ({exc})") from exc
    if response.status_code == 401:
        raise refused_key(replica, api_key)
    if response.status_code != 200:
        raise ReplicaError(
            replica, f"completions answered {response.status_code}: {response.text[:300]}"
        )
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    return [
        ServedCompletion(
            prompt_token_ids=list(prompt),
            completion_token_ids=list(choice["token_ids"]),
            logprobs=[float(lp) for lp in choice["logprobs"]["token_logprobs"]],
            text=choice["text"],
            finish_reason=choice.get("finish_reason"),
        )
        for prompt, choice in zip(prompts, choices, strict=True)
    ]
