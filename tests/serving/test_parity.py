"""Logprobs recomputed with transformers (+ peft) agree with what vLLM served."""

from __future__ import annotations

import math
import random
from pathlib import Path

import httpx
import pytest

from app.serving.parity import (
    completion_logprobs,
    load_policy,
    logprob_drift,
    recompute_logprobs,
)
from app.serving.vllm import VllmServer

PROMPTS = ["def add x", "fix the bug", "return x plus 3", "print the value", "for y in range 9"]


def sample_from_vllm(
    server: VllmServer, model: str
) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """Prompts, sampled completions and their logged logprobs, as the gateway records them."""
    prompts, completions, logged = [], [], []
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": model,
            "prompt": PROMPTS,
            "max_tokens": 48,
            "ignore_eos": True,  # every completion 48 tokens long, however the model behaves
            "temperature": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": 11,
        },
        timeout=60,
    )
    response.raise_for_status()
    for choice in response.json()["choices"]:
        prompts.append(choice["prompt_token_ids"])
        completions.append(choice["token_ids"])
        logged.append(choice["logprobs"]["token_logprobs"])

    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "add a test for the bug"}],
            "max_tokens": 48,
            "ignore_eos": True,
            "logprobs": True,
            "return_token_ids": True,
            "seed": 11,
        },
        timeout=60,
    )
    response.raise_for_status()
    body = response.json()
    prompts.append(body["prompt_token_ids"])
    completions.append(body["choices"][0]["token_ids"])
    logged.append([token["logprob"] for token in body["choices"][0]["logprobs"]["content"]])
    return prompts, completions, logged


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "lora"])
def test_served_logprobs_match_recomputation(
    vllm_server: VllmServer,
    served_lora: str,
    tiny_model_dir: Path,
    lora_dir: Path,
    with_adapter: bool,
) -> None:
    model = served_lora if with_adapter else "base"
    prompts, completions, logged = sample_from_vllm(vllm_server, model)

    recomputed = recompute_logprobs(
        tiny_model_dir, prompts, completions, adapter_dir=lora_dir if with_adapter else None
    )

    drift = logprob_drift(logged, recomputed)
    print(f"{model}: {drift.tokens} tokens, max |Δ| {drift.max_abs:.2e}, mean {drift.mean_abs:.2e}")
    assert drift.tokens > 100
    assert drift.within(1e-3)


def test_recomputation_catches_the_wrong_policy(
    vllm_server: VllmServer, served_lora: str, tiny_model_dir: Path
) -> None:
    prompts, completions, logged = sample_from_vllm(vllm_server, served_lora)

    drift = logprob_drift(logged, recompute_logprobs(tiny_model_dir, prompts, completions))

    assert not drift.within(1e-2)


def test_batched_recomputation_matches_one_sequence_at_a_time(
    tiny_model_dir: Path, lora_dir: Path
) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    completions = [[rng.randrange(300) for _ in range(rng.randint(0, 50))] for _ in range(12)]
    policy = load_policy(tiny_model_dir, lora_dir)

    batched = completion_logprobs(policy, prompts, completions, max_batch_tokens=256)
    one_by_one = [
        completion_logprobs(policy, [p], [c])[0] for p, c in zip(prompts, completions, strict=True)
    ]

    assert [len(lps) for lps in batched] == [len(c) for c in completions]
    assert logprob_drift(one_by_one, batched).max_abs < 1e-5


def test_drift_reports_max_and_mean_over_all_tokens() -> None:
    drift = logprob_drift([[-1.0, -2.0], [-3.0]], [[-1.5, -2.0], [-2.0]])

    assert (drift.max_abs, drift.mean_abs, drift.tokens) == (1.0, 0.5, 3)
    assert drift.within(1.0) and not drift.within(0.9)


def test_drift_refuses_misaligned_sequences() -> None:
    with pytest.raises(ValueError, match="sequence 1"):
        logprob_drift([[-1.0], [-1.0, -2.0]], [[-1.0], [-1.0]])


def test_nan_logprobs_never_pass() -> None:
    drift = logprob_drift([[-1.0, math.nan]], [[-1.0, -1.0]])

    assert not drift.within(1.0)
