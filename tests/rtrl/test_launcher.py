"""`rtrl up` / `rtrl up --down`: the stack's own processes, started and stopped for real."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.config import Settings
from app.processes import free_port
from rtrl.embedded.stack import EmbeddedStack
from rtrl.launcher import FullStack
from sandbox.bases import DEFAULT_BASE, BaseModelError, shipped_base_dir, verify_base


def test_down_stops_every_worker_up_started_whatever_workers_down_is_given(
    stack: EmbeddedStack, engine: Engine, tmp_path: Path
) -> None:
    # The session's services addressed as external ones: this stack starts and stops none.
    settings = Settings(
        data_dir=tmp_path,
        database_url=f"postgresql+psycopg://postgres@localhost:{stack.postgres.port}/rtrl",
        kafka_bootstrap_servers=f"localhost:{stack.kafka.port}",
        redis_url=f"redis://localhost:{stack.redis.port}/0",
        vllm_urls=[f"http://127.0.0.1:{free_port()}"],
    )
    started = FullStack.from_settings(settings, workers=2, trainer=False, progress=lambda _: None)
    for worker in started.workers:
        worker.start()
    assert all(worker.pid() is not None for worker in started.workers)

    FullStack.from_settings(settings, workers=1, trainer=False, progress=lambda _: None).down()

    assert [worker.pid() for worker in started.workers] == [None, None]
    assert not list((tmp_path / "run").glob("worker-*.pid"))


def test_up_installs_the_shipped_base_and_says_which_and_refuses_a_changed_one(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    stack = FullStack.from_settings(
        Settings(data_dir=tmp_path), trainer=False, progress=said.append
    )
    stack.ensure_base_model()

    base = tmp_path / "models" / "base"
    shipped = verify_base(shipped_base_dir(DEFAULT_BASE))
    assert verify_base(base).checksum == shipped.checksum
    assert any(f"{DEFAULT_BASE} sha256:{shipped.checksum[:12]}" in line for line in said), said
    assert any(shipped.checksum in line for line in said), said

    # A weight file changed after it was installed: the next `up` stops on it, naming it.
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BaseModelError, match=r"model\.safetensors does not match"):
        stack.ensure_base_model()
