"""Base-model requests stay base-model answers while every LoRA slot is busy beside them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.serving.replicas import load_adapter, unload_adapter
from app.serving.vllm import VllmServer
from tests.conftest import build_random_lora

PROMPT = [{"role": "user", "content": "Write a Python function f(x) that returns x plus 7."}]


def answer(url: str, model: str, max_tokens: int = 24, **extra: Any) -> tuple[str, list[float]]:
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        **extra,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


@pytest.fixture
def every_slot_filled(
    vllm_server: VllmServer, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[list[str]]:
    names = [f"slot-{n}" for n in range(vllm_server.max_loras)]
    for seed, name in enumerate(names, start=11):
        build_random_lora(tiny_model_dir, tmp_path / name, seed=seed)
        load_adapter(vllm_server.url, name, tmp_path / name)
    yield names
    for name in names:
        unload_adapter(vllm_server.url, name)


def test_base_answers_are_unchanged_while_every_lora_slot_decodes_beside_them(
    vllm_server: VllmServer, every_slot_filled: list[str]
) -> None:
    url = vllm_server.url
    alone_text, alone_logprobs = answer(url, "base")
    with ThreadPoolExecutor(len(every_slot_filled) + 1) as pool:
        # Long adapter answers occupy every slot while the base request joins the batch.
        busy = [pool.submit(answer, url, name, 160, ignore_eos=True) for name in every_slot_filled]
        time.sleep(1.0)
        mixed_text, mixed_logprobs = pool.submit(answer, url, "base").result()
        adapter_texts = {future.result()[0] for future in busy}
    assert mixed_text == alone_text
    assert mixed_logprobs == pytest.approx(alone_logprobs, abs=1e-4)
    # The adapters were really in use: random ones answer differently from the base.
    assert alone_text not in adapter_texts
