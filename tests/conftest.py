"""Session-wide real services: the same launchers `rtrl services up` and `rtrl serve` use."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
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
from app.embedded.kafka import ensure_topics
from app.embedded.process import free_port
from app.embedded.stack import EmbeddedStack
from app.events import COMPLETIONS_TOPIC, FEEDBACK_TOPIC
from app.models import ApiKey, Role
from app.serving.checkpoints import ensure_base_checkpoint
from app.serving.vllm import VllmServer
from trainer.bootstrap import BootstrapConfig, build_corpus, pretrain
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
def clean_registry(engine: Engine, tiny_model_path: Path) -> Engine:
    """A clean slate: only the base checkpoint, in production; no samples, runs or experiments."""
    return reset_registry(engine, tiny_model_path)


def reset_registry(engine: Engine, base_model: Path) -> Engine:
    """Truncate the registry and the loop's tables; `base_model` is checkpoint `base`, in
    production."""
    with engine.begin() as connection:
        connection.execute(
            text(
                "TRUNCATE rewards, samples, feedback_events, training_runs, arms, experiments,"
                " alerts, checkpoints CASCADE"
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


class BackgroundBootstrap:
    """A base model bootstrapped in a subprocess while the tests that need no weights run (it
    takes minutes on two cores)."""

    def __init__(
        self, name: str, train_steps: int, *, niceness: int = 0, agent_check: bool = False
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"rtrl-test-{name}-model-"))
        self.model_dir = self.root / name
        self.log = self.root / "bootstrap.log"
        self.train_steps = train_steps
        self.niceness = niceness
        # The bootstrap's agent-run check (`BootstrapConfig.min_agent_solved`) may add steps;
        # off, the model trains exactly `train_steps`.
        self.agent_check = agent_check
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> BackgroundBootstrap:
        code = (
            "import dataclasses, logging, os, sys\n"
            "os.nice(int(sys.argv[3]))\n"
            # Its steps and agent-run checks in the log, which a failed bootstrap shows.
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "from pathlib import Path\n"
            "from trainer.bootstrap import BootstrapConfig, bootstrap_model\n"
            "config = dataclasses.replace(BootstrapConfig(), threads=1,"
            " train_steps=int(sys.argv[2]))\n"
            "if sys.argv[4] != '1':\n"
            "    config = dataclasses.replace(config, min_agent_solved=0.0)\n"
            "bootstrap_model(Path(sys.argv[1]), config)\n"
        )
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    code,
                    str(self.model_dir),
                    str(self.train_steps),
                    str(self.niceness),
                    "1" if self.agent_check else "0",
                ],
                stdout=log,
                stderr=log,
            )
        return self

    def wait(self) -> Path:
        assert self.process is not None, "the bootstrap was never started"
        if self.process.wait() != 0:
            pytest.fail(f"bootstrapping the test model failed:\n{self.log.read_text()[-3000:]}")
        return self.model_dir

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)


# The session's base: the default configuration at 500 steps, the base every test's figures
# were measured on. The one-cycle learning test (tests/trainer/test_cycle.py) measured +4.2
# to +8.7 pp over four seeds on it, while on the 1,000-step default three runs gained 14.4 to
# 14.6 pp and one (in CI) lost 5.8, so its one cycle is not yet judged on that base.
_bootstrap: BackgroundBootstrap | None = None
# The agent base: the 1,000-step default with its agent-run check, as `rtrl model bootstrap`
# builds it, for the agent-learning test alone (the 500-step base solves 11.5% of held-out
# agent runs, too few for a gain to show). It trains after the
# session's base, at a lower priority than the tests, on the CPU they leave idle.
_agent_bootstrap: BackgroundBootstrap | None = None
_agent_chain: threading.Thread | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _bootstrap
    if not os.environ.get("RTRL_TEST_BASE_MODEL") and _needs_a_model(session):
        _bootstrap = BackgroundBootstrap("base", 500).start()
        # The bootstrap is the session's critical path (every weight-needing test waits for
        # it); the tests that run beside it, and the services they start, yield the CPU to
        # it. A lower priority can be taken by any user and is inherited by every process
        # this one starts; nothing competes with them once the bootstrap is done.
        os.nice(5)


def start_agent_bootstrap() -> None:
    """The agent base's bootstrap, once the session's base is done."""
    global _agent_bootstrap, _agent_chain
    _agent_bootstrap = BackgroundBootstrap("agent-base", 1000, niceness=10, agent_check=True)
    first = _bootstrap

    def chain() -> None:
        if first is not None and first.process is not None and first.process.wait() != 0:
            return  # failed or killed at the session's end: its tests report it
        assert _agent_bootstrap is not None
        _agent_bootstrap.start()

    _agent_chain = threading.Thread(target=chain, daemon=True)
    _agent_chain.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    # The session's base first: the agent base's chain waits for it, then starts nothing.
    if _bootstrap is not None:
        _bootstrap.close()
    if _agent_chain is not None:
        _agent_chain.join()
    if _agent_bootstrap is not None:
        _agent_bootstrap.close()


@pytest.hookimpl(trylast=True)  # after `-k` and `-m` have deselected
def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    """Modules whose tests need the weights run last: the others run while the base model
    trains; the modules that need the agent base run after all, while it trains.

    Whole modules move, in their order, so module-scoped services start once.
    """

    def modules_using(fixture: str) -> set[str]:
        return {
            item.nodeid.split("::")[0]
            for item in items
            if fixture in getattr(item, "fixturenames", ())
        }

    needs_weights, needs_agent_base = (
        modules_using("tiny_model_dir"),
        modules_using("agent_model_dir"),
    )
    items.sort(
        key=lambda item: (
            item.nodeid.split("::")[0] in needs_agent_base,
            item.nodeid.split("::")[0] in needs_weights,
        )
    )
    if needs_agent_base and not os.environ.get("RTRL_TEST_AGENT_MODEL") and _needs_a_model(session):
        start_agent_bootstrap()


def _needs_a_model(session: pytest.Session) -> bool:
    """Not for a run that only lists tests or asks for help."""
    options = session.config.option
    return not (getattr(options, "collectonly", False) or getattr(options, "help", False))


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Where the session's base model is (or will be): for what only needs its path."""
    reuse = os.environ.get("RTRL_TEST_BASE_MODEL")
    if reuse:
        return Path(reuse)
    assert _bootstrap is not None
    return _bootstrap.model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_path: Path) -> Path:
    """The bootstrapped base model (task family, agent runs, noisy habits), as
    `rtrl model bootstrap` builds it; waits for the background bootstrap.

    `RTRL_TEST_BASE_MODEL` reuses an existing model directory to save those minutes.
    """
    if _bootstrap is not None:
        return _bootstrap.wait()
    return tiny_model_path


@pytest.fixture(scope="session")
def agent_model_dir() -> Path:
    """The default 1,000-step base (`rtrl model bootstrap`), for agent learning; waits for its
    background bootstrap. `RTRL_TEST_AGENT_MODEL` reuses an existing model directory."""
    reuse = os.environ.get("RTRL_TEST_AGENT_MODEL")
    if reuse:
        return Path(reuse)
    assert _agent_chain is not None and _agent_bootstrap is not None
    _agent_chain.join()
    if _agent_bootstrap.process is None:
        pytest.fail("the agent base was not bootstrapped: the session's base failed first")
    return _agent_bootstrap.wait()


@pytest.fixture(scope="session")
def lora_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    adapter_dir = tmp_path_factory.mktemp("lora")
    build_random_lora(tiny_model_dir, adapter_dir)
    return adapter_dir


@contextmanager
def running_vllm(model_dir: Path, root: Path) -> Iterator[VllmServer]:
    """A real vLLM server on `model_dir`, fp32 so logprobs compare, stopped on exit."""
    server = VllmServer(model_dir=model_dir, port=free_port(), root=root, dtype="float32")
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
