"""docker-compose.yml describes production with the same settings the code reads."""

from pathlib import Path

import yaml

from app.config import Settings

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
    for name, service in services.items():
        assert "healthcheck" in service or service.get("restart") == "no", name
        for variable in service.get("environment", {}):
            if variable.startswith("RTRL_"):
                assert variable in known, f"{name} sets unknown {variable}"
    rtrl_env = services["gateway"]["environment"]
    assert {"RTRL_DATABASE_URL", "RTRL_KAFKA_BOOTSTRAP_SERVERS", "RTRL_REDIS_URL"} <= set(rtrl_env)
