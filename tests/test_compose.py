"""docker-compose.yml describes production with the same settings and health checks the code
answers."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from sqlalchemy import Engine

from app.config import Settings, settings_environment
from app.embedded.process import free_port
from app.embedded.stack import EmbeddedStack
from app.launcher import RtrlProcess
from trainer.config import TrainSettings

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"


def test_compose_uses_only_real_settings_and_has_every_part() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {
        "postgres",
        "redis",
        "kafka",
        "vllm",
        "migrations",
        "gateway",
        "workers",
        "trainer",
    } <= set(services)
    known = {f"RTRL_{name.upper()}" for name in Settings.model_fields}
    known |= {f"RTRL_TRAIN_{name.upper()}" for name in TrainSettings.model_fields}
    for name, service in services.items():
        assert "healthcheck" in service or service.get("restart") == "no", name
        for variable in service.get("environment", {}):
            if variable.startswith("RTRL_"):
                assert variable in known, f"{name} sets unknown {variable}"
    # The trainer runs under torchrun: one rank per GPU of its reservation.
    trainer = services["trainer"]
    entrypoint = trainer["entrypoint"]
    assert entrypoint[0] == "torchrun" and entrypoint[-2:] == ["-m", "app.cli"]
    gpus = trainer["deploy"]["resources"]["reservations"]["devices"][0]["count"]
    assert f"--nproc-per-node={gpus}" in entrypoint
    train_env = {
        name.removeprefix("RTRL_TRAIN_").lower(): value
        for name, value in trainer["environment"].items()
        if name.startswith("RTRL_TRAIN_") and name != "RTRL_TRAIN_INTERVAL"
    }
    assert TrainSettings(**train_env).eval_gate == "logged_traffic"
    rtrl_env = services["gateway"]["environment"]
    assert {"RTRL_DATABASE_URL", "RTRL_KAFKA_BOOTSTRAP_SERVERS", "RTRL_REDIS_URL"} <= set(rtrl_env)


@pytest.mark.parametrize(
    ("service", "arguments", "metric"),
    [
        ("workers", ["worker"], "rtrl_consumer_lag_messages"),
        ("trainer", ["trainer"], "rtrl_training_runs_total"),
    ],
)
def test_each_process_passes_its_compose_healthcheck_while_it_runs_and_fails_once_it_stops(
    service: str,
    arguments: list[str],
    metric: str,
    stack: EmbeddedStack,
    engine: Engine,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    # The base model's path only: the trainer's first cycle is an interval away, so this
    # runs while the session's base model trains.
    compose = yaml.safe_load(COMPOSE.read_text())["services"][service]
    heartbeat = compose["environment"]["RTRL_HEARTBEAT_FILE"]
    check = compose["healthcheck"]["test"]
    assert check[0] == "CMD" and heartbeat in check
    # The compose command, pointed at this test's own heartbeat file.
    own_heartbeat = tmp_path / Path(heartbeat).name
    command = [str(own_heartbeat) if part == heartbeat else part for part in check[1:]]
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=f"postgresql+psycopg://postgres@localhost:{stack.postgres.port}/rtrl",
        kafka_bootstrap_servers=f"localhost:{stack.kafka.port}",
        redis_url=f"redis://localhost:{stack.redis.port}/0",
        base_model=tiny_model_dir,
        heartbeat_file=own_heartbeat,
        metrics_port=free_port(),
    )
    environment = settings_environment(settings)

    def healthcheck() -> subprocess.CompletedProcess[str]:
        rtrl = [sys.executable, "-m", "app.cli", *command[1:]]
        return subprocess.run(rtrl, env=environment, capture_output=True, text=True, timeout=60)

    assert healthcheck().returncode == 1  # nothing has beaten yet
    if service == "workers":
        # A group of its own: a stopped member of the product's default group could stall
        # the rebalance of a later test's workers (the embedded broker was seen to for minutes).
        arguments = [*arguments, "--group-id", f"compose-test-{uuid.uuid4().hex[:8]}"]
    process = RtrlProcess(service, arguments, tmp_path / "run", tmp_path / "logs", environment)
    process.start()
    try:
        deadline = time.monotonic() + 90
        while healthcheck().returncode != 0:
            assert time.monotonic() < deadline, f"{service} never became healthy"
            time.sleep(1)
        first_beat = own_heartbeat.stat().st_mtime
        deadline = time.monotonic() + 30
        while own_heartbeat.stat().st_mtime == first_beat:
            assert time.monotonic() < deadline, f"{service} stopped refreshing its heartbeat"
            time.sleep(0.5)
        # What Prometheus scrapes at RTRL_METRICS_PORT.
        metrics = httpx.get(f"http://127.0.0.1:{settings.metrics_port}/metrics").text
        assert metric in metrics
    finally:
        process.stop()
    max_age = float(command[command.index("--max-age") + 1])
    stale = time.time() - max_age - 1
    os.utime(own_heartbeat, (stale, stale))  # as if the window had passed with no beat
    failed = healthcheck()
    assert failed.returncode == 1 and "unhealthy" in failed.stderr
