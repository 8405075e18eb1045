"""Session-wide real services: the same launchers `rtrl services up` and `rtrl serve` use."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app.config import get_settings
from app.db import make_engine
from app.embedded.process import free_port
from app.embedded.stack import EmbeddedStack
from app.serving.vllm import VllmServer


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStack]:
    """Postgres, Kafka and Redis for this test session, migrated and with topics."""
    data_dir = tmp_path_factory.mktemp("rtrl")
    stack = EmbeddedStack.at(
        data_dir, postgres_port=free_port(), kafka_port=free_port(), redis_port=free_port()
    )
    stack.up()
    env = {
        "RTRL_DATA_DIR": str(data_dir),
        "RTRL_EMBEDDED_POSTGRES_PORT": str(stack.postgres.port),
        "RTRL_EMBEDDED_KAFKA_PORT": str(stack.kafka.port),
        "RTRL_EMBEDDED_REDIS_PORT": str(stack.redis.port),
        **stack.environment(),
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    get_settings.cache_clear()
    try:
        yield stack
    finally:
        stack.down()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        get_settings.cache_clear()


@pytest.fixture(scope="session")
def engine(stack: EmbeddedStack) -> Iterator[Engine]:
    engine = make_engine(stack.postgres.url)
    yield engine
    engine.dispose()


@pytest.fixture
def db_session(engine: Engine) -> Iterator[Session]:
    """A session inside a transaction that is rolled back after the test."""
    with engine.connect() as connection:
        transaction = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        try:
            yield session
        finally:
            session.close()
            transaction.rollback()


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|eos|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
WORDS = ["def", "return", "x", "y", "plus", "times", "print", "if", "else", "for", "in", "range"]


def build_tiny_llama(model_dir: Path, seed: int = 0) -> None:
    """Train a byte-level BPE tokenizer on generated text and save a random 2-layer Llama."""
    rng = random.Random(seed)
    lines = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + f" {rng.randint(0, 99)}"
        for _ in range(400)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(model_dir)

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        # Wider than the default 0.02 so that the next-token distributions are not flat.
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(model_dir)


def build_random_lora(model_dir: Path, adapter_dir: Path, seed: int = 1) -> None:
    """A rank-8 LoRA on the attention projections with random A and B, so outputs change."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
    )
    get_peft_model(model, config).save_pretrained(str(adapter_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reuse = os.environ.get("RTRL_TEST_BASE_MODEL")
    if reuse:
        return Path(reuse)
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(model_dir)
    return model_dir


@pytest.fixture(scope="session")
def lora_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    adapter_dir = tmp_path_factory.mktemp("lora")
    build_random_lora(tiny_model_dir, adapter_dir)
    return adapter_dir


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One real vLLM server on the tiny model for the whole session, fp32 so logprobs compare."""
    server = VllmServer(
        model_dir=tiny_model_dir,
        port=free_port(),
        root=tmp_path_factory.mktemp("vllm"),
        dtype="float32",
    )
    server.start(timeout=300)
    try:
        yield server
    finally:
        server.stop()
