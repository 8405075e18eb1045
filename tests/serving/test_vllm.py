"""The launcher starts a real vLLM that serves the base and hot-loaded LoRAs, then stops clean."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from app.config import Settings
from app.processes import ServiceError, free_port
from app.serving.replicas import ReplicaError, served_models
from app.serving.sampling import sample_completions
from app.serving.vllm import VllmServer, is_healthy, wait_until_healthy


def post(server: VllmServer, path: str, body: Mapping[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def first_token_top_logprobs(server: VllmServer, model: str) -> dict[str, float]:
    response = post(
        server,
        "/v1/completions",
        {"model": model, "prompt": "def add x", "max_tokens": 1, "logprobs": 5},
    )
    response.raise_for_status()
    top: dict[str, float] = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return top


def test_models_lists_the_base_under_its_stable_name(
    vllm_server: VllmServer, tiny_model_dir: Path
) -> None:
    models = httpx.get(f"{vllm_server.url}/v1/models", timeout=10).json()["data"]
    base = next(model for model in models if model["id"] == "base")
    assert Path(base["root"]) == tiny_model_dir.resolve()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert base["max_model_len"] == config["max_position_embeddings"]


def test_completion_answers_with_token_ids_and_logprobs(
    vllm_server: VllmServer, tiny_model_dir: Path
) -> None:
    response = post(
        vllm_server,
        "/v1/completions",
        {
            "model": "base",
            "prompt": "def add x",
            "max_tokens": 8,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": 7,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert choice["prompt_token_ids"] == tokenizer.encode("def add x")
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(choice["token_ids"]) == len(logprobs) == body["usage"]["completion_tokens"] > 0
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)


def test_chat_completion_answers_with_token_ids_and_logprobs(
    vllm_server: VllmServer, tiny_model_dir: Path
) -> None:
    messages = [{"role": "user", "content": "fix the bug in add"}]
    response = post(
        vllm_server,
        "/v1/chat/completions",
        {
            "model": "base",
            "messages": messages,
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            "seed": 7,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected_prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert body["prompt_token_ids"] == expected_prompt
    choice = body["choices"][0]
    logprobs = [token["logprob"] for token in choice["logprobs"]["content"]]
    assert len(choice["token_ids"]) == len(logprobs) == body["usage"]["completion_tokens"] > 0
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)


def test_loaded_lora_answers_under_its_name_with_its_own_logprobs(
    vllm_server: VllmServer, lora_dir: Path
) -> None:
    started = time.perf_counter()
    response = post(
        vllm_server,
        "/v1/load_lora_adapter",
        {"lora_name": "lora-by-hand", "lora_path": str(lora_dir)},
    )
    print(f"load_lora_adapter took {(time.perf_counter() - started) * 1000:.0f} ms")
    assert response.status_code == 200, response.text

    assert "lora-by-hand" in served_models(vllm_server.url)
    assert first_token_top_logprobs(vllm_server, "lora-by-hand") != first_token_top_logprobs(
        vllm_server, "base"
    )


def test_unloaded_lora_no_longer_answers(vllm_server: VllmServer, lora_dir: Path) -> None:
    body = {"lora_name": "ckpt-retired", "lora_path": str(lora_dir)}
    assert post(vllm_server, "/v1/load_lora_adapter", body).status_code == 200
    assert post(vllm_server, "/v1/unload_lora_adapter", {"lora_name": "ckpt-retired"}).is_success

    response = post(vllm_server, "/v1/completions", {"model": "ckpt-retired", "prompt": "x"})
    assert response.status_code == 404


def test_unknown_adapter_is_not_found_by_name(vllm_server: VllmServer) -> None:
    response = post(
        vllm_server,
        "/v1/completions",
        {"model": "ckpt-404", "prompt": "def add x", "max_tokens": 4},
    )
    assert response.status_code == 404
    assert "ckpt-404" in response.json()["error"]["message"]


def test_start_is_a_no_op_when_the_server_already_runs(vllm_server: VllmServer) -> None:
    pid = vllm_server.pid()
    vllm_server.start(timeout=10)
    assert vllm_server.pid() == pid


def test_start_refuses_a_port_where_vllm_already_answers(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    other = VllmServer(vllm_server.model_dir, vllm_server.port, root=tmp_path)
    with pytest.raises(ServiceError, match="already used by a vLLM server"):
        other.start()


def test_start_refuses_a_taken_port(tiny_model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        server = VllmServer(tiny_model_dir, sock.getsockname()[1], root=tmp_path)
        with pytest.raises(ServiceError, match="already used by another process"):
            server.start()
    assert not server.pid_file.exists()


def test_start_refuses_a_missing_model_dir(tmp_path: Path) -> None:
    server = VllmServer(tmp_path / "missing", free_port(), root=tmp_path / "vllm")
    with pytest.raises(ServiceError, match="does not exist"):
        server.start()


def test_start_refuses_a_dir_without_config_json(tmp_path: Path) -> None:
    server = VllmServer(tmp_path, free_port(), root=tmp_path / "vllm")
    with pytest.raises(ServiceError, match=r"has no config\.json"):
        server.start()


def test_waiting_fails_early_with_the_log_tail_when_the_server_exits(tmp_path: Path) -> None:
    log_file = tmp_path / "vllm.log"
    with log_file.open("wb") as log:
        crashed = subprocess.Popen(
            [sys.executable, "-c", "print('ValueError: no-such-architecture'); exit(3)"],
            stdout=log,
        )
    started = time.monotonic()

    with pytest.raises(ServiceError, match="exited with code 3") as failure:
        wait_until_healthy(
            f"http://127.0.0.1:{free_port()}", 60, process=crashed, log_file=log_file
        )

    assert time.monotonic() - started < 10
    assert "no-such-architecture" in str(failure.value)


def test_waiting_gives_up_after_the_timeout() -> None:
    with pytest.raises(ServiceError, match=r"not healthy .* within 1 s"):
        wait_until_healthy(f"http://127.0.0.1:{free_port()}", 1)


def test_a_server_started_with_an_api_key_serves_only_the_calls_that_carry_it(
    keyed_vllm_server: VllmServer,
) -> None:
    server, key = keyed_vllm_server, keyed_vllm_server.api_key
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=wrong, timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # compose's check

    # rtrl's own calls send it: the health check that waited for the start, listing, sampling.
    assert server.healthy()
    assert "base" in served_models(server.url, api_key=key)
    (served,) = sample_completions(server.url, "base", [[1, 2, 3]], max_tokens=4, api_key=key)
    assert served.completion_token_ids
    # Without it, a refusal that says what is missing.
    assert not is_healthy(server.url, model="base")
    with pytest.raises(ReplicaError, match="rtrl sent no API key"):
        served_models(server.url)
    with pytest.raises(ReplicaError, match="rtrl sent no API key"):
        sample_completions(server.url, "base", [[1, 2, 3]], max_tokens=4)
    # Given through the environment: neither the process listing nor the log shows it.
    assert key not in " ".join(server.command())
    assert key not in server.log_file.read_text()


@pytest.mark.scenario
@pytest.mark.slow
def test_the_launched_server_caps_max_tokens_and_streams_in_the_set_interval(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = Settings(
        data_dir=tmp_path, base_model=tiny_model_dir, embedded_vllm_port=free_port()
    ).model_copy(update={"max_completion_tokens": 8, "vllm_stream_interval": 3})
    server = VllmServer.from_settings(settings)
    server.start(timeout=300)
    try:

        def generated(**limit: int) -> tuple[int, str]:
            body = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
            response = post(server, "/v1/chat/completions", body | {"ignore_eos": True} | limit)
            response.raise_for_status()
            answer = response.json()
            return answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]

        # Without it, the tiny model would go on to its 131,072-token context.
        assert generated() == (8, "length")
        assert generated(max_tokens=3) == (3, "length")

        # Streamed: the first token at once, then (at least) three a chunk, each with its logprob.
        chunks: list[tuple[int, int]] = []
        body = {
            "model": "base",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
        }
        stream = httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120)
        with stream as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        entries = (choice.get("logprobs") or {}).get("content") or []
                        chunks.append((len(choice.get("token_ids") or []), len(entries)))
        tokens = [count for count, _ in chunks if count]
        # [1, 3, 3, 1] on a quiet machine; a busy server may fold a late chunk into the next
        # ([1, 3, 4] seen in CI), never split one below the interval but at the end.
        assert tokens[0] == 1 and sum(tokens) == 8 and len(tokens) <= 4, tokens
        assert all(count >= 3 for count in tokens[1:-1]), tokens
        assert all(count == logprobs for count, logprobs in chunks)
    finally:
        server.stop()
