"""The session's vLLM server with a random LoRA loaded by hand, for parity tests."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from app.serving.vllm import VllmServer


@pytest.fixture(scope="session")
def served_lora(vllm_server: VllmServer, lora_dir: Path) -> str:
    """The random LoRA, loaded into the session's server; returns the name it answers to."""
    name = "ckpt-parity"
    response = httpx.post(
        f"{vllm_server.url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(lora_dir)},
        timeout=60,
    )
    response.raise_for_status()
    return name
