"""Session-wide real services: the same launchers `rtrl services up` and `rtrl serve` use."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata
from peft import LoraConfig, get_peft_model
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

from app.auth.service import new_api_key
from app.config import Settings, get_settings
from app.db import make_engine, session_scope
from app.events import COMPLETIONS_TOPIC, FEEDBACK_TOPIC
from app.kafka.admin import ensure_topics
from app.models import ApiKey, Role
from app.processes import free_port
from app.serving.publish import ensure_base_checkpoint
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from sandbox.bases import DEFAULT_BASE, HACKING_BASE, install_base, shipped_base_dir
from sandbox.bootstrap import BootstrapConfig, build_corpus, pretrain
from workers.config import WorkerConfig


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
def make_key(engine: Engine) -> Callable[..., tuple[ApiKey, str]]:
    """Creates an API key in Postgres: its row (detached) and its secret."""

    def make(role: Role = Role.ide, **fields: Any) -> tuple[ApiKey, str]:
        with session_scope(engine) as session:
            row, secret = new_api_key(name=f"test-{uuid.uuid4().hex[:8]}", role=role, **fields)
            session.add(row)
            session.flush()
            session.expunge(row)
        return row, secret

    return make


@pytest.fixture
def clean_registry(engine: Engine, tiny_model_dir: Path) -> Engine:
    """A clean slate: only the base checkpoint, in production; no samples, runs or experiments."""
    return reset_registry(engine, tiny_model_dir)


def reset_registry(engine: Engine, base_model: Path) -> Engine:
    """Truncate the registry and the loop's tables; `base_model` is checkpoint `base`, in
    production. Ids start again at 1, so a test that slices samples by id (the held-out
    slice is `id % 100`) sees the same split whatever ran before it in this process."""
    with engine.begin() as connection:
        connection.execute(
            text(
                "TRUNCATE rewards, samples, feedback_events, training_runs, arms, experiments,"
                " alerts, checkpoints RESTART IDENTITY CASCADE"
            )
        )
    with session_scope(engine) as session:
        ensure_base_checkpoint(session, str(base_model))
    return engine


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


def external_settings(
    stack: EmbeddedStack, vllm: VllmServer, model_dir: Path, data_dir: Path
) -> Settings:
    """Settings that address the session's services and vLLM as external ones, so whatever
    runs on them (the demo, `rtrl` subprocesses) starts and stops none of them."""
    return Settings(
        data_dir=data_dir,
        database_url=f"postgresql+psycopg://postgres@localhost:{stack.postgres.port}/rtrl",
        kafka_bootstrap_servers=f"localhost:{stack.kafka.port}",
        redis_url=f"redis://localhost:{stack.redis.port}/0",
        base_model=model_dir,
        vllm_urls=[vllm.url],
        gateway_port=free_port(),
    )


def start_group_at_end(bootstrap_servers: str, group_id: str) -> None:
    """Commit the ends of the completions and feedback topics for `group_id`: its workers
    start with the traffic that comes next, not the session's earlier tests' events."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=group_id, enable_auto_commit=False
    )
    try:
        partitions = [
            TopicPartition(topic, partition)
            for topic in (COMPLETIONS_TOPIC, FEEDBACK_TOPIC)
            for partition in consumer.partitions_for_topic(topic) or ()
        ]
        consumer.commit(
            {
                tp: OffsetAndMetadata(end, "", -1)
                for tp, end in consumer.end_offsets(partitions).items()
            }
        )
    finally:
        consumer.close()


def fresh_worker_config(kafka_url: str, partitions: int = 4, **overrides: Any) -> WorkerConfig:
    """Topics and a consumer group of one test's own (created here), short group timeouts,
    no housekeeping unless `overrides` (by field name) turn some on."""
    suffix = uuid.uuid4().hex[:10]
    config = WorkerConfig(
        completions_topic=f"test.completions.{suffix}",
        feedback_topic=f"test.feedback.{suffix}",
        dlq_topic=f"test.dlq.{suffix}",
        group_id=f"test-workers-{suffix}",
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        poll_timeout_ms=200,
        sweep_interval_s=None,
        monitor_interval_s=None,
        **overrides,
    )
    ensure_topics(
        kafka_url,
        {
            config.completions_topic: partitions,
            config.feedback_topic: partitions,
            config.dlq_topic: 1,
        },
    )
    return config


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
    """The session's base model (task family, agent runs, noisy habits): the shipped 500-step
    base (`rtrl-base-500`), installed as `rtrl up` installs a base."""
    return install_base(HACKING_BASE, tmp_path_factory.mktemp("bases") / HACKING_BASE).path


@pytest.fixture(scope="session")
def agent_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped default base (`rtrl-base`, 1,000 steps and its agent-run check), the one
    `rtrl up` and the demo start from, for agent learning: the 500-step base solves too few
    held-out agent runs for a gain to show."""
    return install_base(DEFAULT_BASE, tmp_path_factory.mktemp("bases") / DEFAULT_BASE).path


@pytest.fixture(scope="session")
def lora_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    adapter_dir = tmp_path_factory.mktemp("lora")
    build_random_lora(tiny_model_dir, adapter_dir)
    return adapter_dir


@contextmanager
def running_vllm(model_dir: Path, root: Path, api_key: str = "") -> Iterator[VllmServer]:
    """A real vLLM server on `model_dir`, fp32 so logprobs compare, stopped on exit."""
    server = VllmServer(
        model_dir=model_dir, port=free_port(), root=root, dtype="float32", api_key=api_key
    )
    server.start(timeout=300)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One real vLLM server on the tiny model for the whole session."""
    with running_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm")) as server:
        yield server


@pytest.fixture(scope="session")
def keyed_vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A second real vLLM server, started as production's is: with an API key (its
    `api_key`; every /v1 call without `Authorization: Bearer <key>` is refused), on a model
    that ships sampling defaults in its `generation_config.json` as published models do
    (`SHIPPED_SAMPLING`, which vLLM applies to requests that leave them out)."""
    root = tmp_path_factory.mktemp("keyed-vllm")
    model_dir = shutil.copytree(tiny_model_dir, root / "model")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(generation | SHIPPED_SAMPLING))
    with running_vllm(model_dir, root, api_key=f"vllm-{uuid.uuid4().hex}") as server:
        yield server


def past_the_context(phrase: str, model_dir: Path | None = None) -> str:
    """`phrase` repeated until it is longer than the model's context (the shipped bases' by
    default), by its own tokenizer's count: a prompt vLLM refuses."""
    model_dir = model_dir or shipped_base_dir(HACKING_BASE)
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    per_phrase = len(tokenizer(phrase * 100)["input_ids"]) / 100
    return phrase * (int(context / per_phrase) + 100)


SHIPPED_SAMPLING = {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.3}
"""Sampling defaults a published model's generation_config.json sets (Qwen's are alike)."""


def fine_tune_toward_malformed_calls(model_dir: Path, adapter_dir: Path) -> None:
    """A LoRA adapter taught, on agent runs that each make one malformed call, the habit the
    flawed formula 0 rewarded in the full reward-hacking run (where it took two cycles to
    emerge, too long for a test): nearly twice as many of its calls are malformed (20.8% →
    36.3% offline, 19.9% → 38.4% served, in one run each)."""
    config = BootstrapConfig(
        seed=7,
        corpus_examples=512,
        agent_share=1.0,
        malformed_rate=1.0,
        clarifying_rate=0.0,
        train_steps=40,
        batch_size=16,
        learning_rate=3e-3,
        warmup_steps=5,
        threads=1,
        min_agent_solved=0.0,
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    torch.manual_seed(config.seed)
    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    pretrain(policy, tokenizer, build_corpus(config), config, time.monotonic())
    policy.save_pretrained(str(adapter_dir))
