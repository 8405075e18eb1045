"""What vLLM sampled from is what the event logs, and a sample drawn under anything the
trainer cannot reproduce is never trainable: real vLLM, gateway, Kafka, the worker's rows."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import SecretStr
from transformers import AutoModelForCausalLM

from app.config import Settings
from app.events import COMPLETIONS_TOPIC, CompletionEvent
from app.gateway.sampling import sampling_constraints, with_neutral_sampling
from app.serving.vllm import VllmServer
from tests.conftest import SHIPPED_SAMPLING
from tests.gateway.conftest import GatewayServer, KafkaTopics
from workers.store import sample_row

MESSAGES = [{"role": "user", "content": "Write f(x) that returns x plus 3."}]


@pytest.mark.parametrize(
    ("extra", "constraints"),
    [
        ({}, []),
        ({"temperature": 0.8, "stop": ["\n\n"], "seed": 3, "max_tokens": 9}, []),
        ({"min_p": 0.0, "repetition_penalty": 1, "min_tokens": 0, "ignore_eos": False}, []),
        ({"tool_choice": "auto", "response_format": {"type": "text"}, "logit_bias": {}}, []),
        (
            {"logit_bias": {"42": 5}, "min_tokens": 4, "ignore_eos": True},
            ["ignore_eos", "logit_bias", "min_tokens"],
        ),
        (
            {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -1},
            ["frequency_penalty", "min_p", "presence_penalty"],
        ),
        (
            {"repetition_penalty": 1.1, "use_beam_search": True},
            ["repetition_penalty", "use_beam_search"],
        ),
        ({"bad_words": ["x"], "allowed_token_ids": [1, 2]}, ["allowed_token_ids", "bad_words"]),
        ({"response_format": {"type": "json_object"}}, ["response_format"]),
        ({"structured_outputs": {"regex": "a+"}}, ["structured_outputs"]),
        ({"tool_choice": "required"}, ["tool_choice"]),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, ["tool_choice"]),
        ({"min_p": "lots"}, ["min_p"]),  # vLLM refuses it; nothing is trained either way
    ],
)  # fmt: skip
def test_the_parameters_the_trainer_cannot_reproduce_are_named(
    extra: dict[str, Any], constraints: list[str]
) -> None:
    assert sampling_constraints({"messages": MESSAGES, **extra}) == constraints


def test_left_out_sampling_parameters_are_sent_at_vllms_neutral_values() -> None:
    sent = with_neutral_sampling({"messages": MESSAGES, "temperature": 0.8, "top_p": None})
    assert sent["temperature"] == 0.8 and sent["top_p"] == 1.0 and sent["top_k"] == 0
    assert sent["repetition_penalty"] == 1.0 and sent["min_p"] == 0.0


@pytest.fixture
def production_gateway(
    gateway_settings: Settings,
    keyed_vllm_server: VllmServer,
    start_gateway: Callable[[Settings], GatewayServer],
) -> GatewayServer:
    """A gateway on the vLLM whose model ships its own sampling defaults."""
    return start_gateway(
        gateway_settings.model_copy(
            update={
                "vllm_urls": [keyed_vllm_server.url],
                "vllm_api_key": SecretStr(keyed_vllm_server.api_key),
            }
        )
    )


def served(server: GatewayServer, key: str, kafka: KafkaTopics, **fields: Any) -> dict[str, Any]:
    """The completion event of one chat request with these body fields."""
    request_id = f"r-{uuid.uuid4().hex}"
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 8, **fields},
        headers={
            "Authorization": f"Bearer {key}",
            "X-Session-Id": f"s-{uuid.uuid4().hex}",
            "X-Request-Id": request_id,
        },
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return next(
        event
        for event in kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
        if event["request_id"] == request_id
    )


def as_completion(event: dict[str, Any]) -> CompletionEvent:
    return CompletionEvent.model_validate({k: v for k, v in event.items() if k != "_key"})


def recomputed_logprobs(model_dir: Path, event: dict[str, Any]) -> list[float]:
    """The served tokens' logprobs under the model at temperature 1, nothing else applied:
    what the trainer computes from the logged sample."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt, completion = event["prompt_token_ids"], event["completion_token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.mark.scenario
def test_a_model_that_ships_sampling_defaults_is_sampled_at_what_the_event_logs(
    production_gateway: GatewayServer, ide_key: str, kafka: KafkaTopics, tiny_model_dir: Path
) -> None:
    # The model's generation_config.json asks for temperature 0.7, top-k 20 and a repetition
    # penalty; the IDE sets none of them, as most do.
    assert SHIPPED_SAMPLING["temperature"] != 1.0
    event = served(production_gateway, ide_key, kafka, max_tokens=16)
    assert (event["temperature"], event["top_p"], event["top_k"]) == (1.0, 1.0, -1)
    assert event["sampling_constraints"] == []
    assert sample_row(as_completion(event))["trainable"]
    # vLLM's logprobs are those of the distribution it sampled from (processed_logprobs): the
    # trainer's recomputation at the logged temperature finds the same, to float32 rounding
    # (under the model's own defaults they were up to 0.05 apart on this prompt, 0.7 on
    # others).
    assert recomputed_logprobs(tiny_model_dir, event) == pytest.approx(
        event["behaviour_logprobs"], abs=1e-4
    )


@pytest.mark.parametrize(
    ("fields", "constraints"),
    [
        (
            {"logit_bias": {"5": 3.0}, "min_tokens": 4, "ignore_eos": True},
            ["ignore_eos", "logit_bias", "min_tokens"],
        ),
        ({"repetition_penalty": 1.2}, ["repetition_penalty"]),
    ],
)  # fmt: skip
def test_a_sample_drawn_under_a_bias_or_a_forced_length_is_served_and_never_trainable(
    gateway_server: GatewayServer,
    ide_key: str,
    kafka: KafkaTopics,
    fields: dict[str, Any],
    constraints: list[str],
) -> None:
    event = served(gateway_server, ide_key, kafka, **fields)
    assert event["status"] == "ok" and event["completion_token_ids"]
    assert event["sampling_constraints"] == constraints
    assert not sample_row(as_completion(event))["trainable"]
