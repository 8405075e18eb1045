"""`rtrl up` / `rtrl up --down`: the stack's own processes, started and stopped for real."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine

from app.config import Settings
from app.embedded.process import free_port
from app.embedded.stack import EmbeddedStack
from app.launcher import FullStack


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
