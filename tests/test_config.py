from datetime import timedelta
from pathlib import Path

import pytest

from app.config import SettingsError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("RTRL_"):
            monkeypatch.delenv(name)


def test_defaults_point_at_the_embedded_stack() -> None:
    settings = load_settings()
    assert settings.data_dir == Path("./var")
    assert settings.database_url == "postgresql+psycopg://postgres@127.0.0.1:54329/rtrl"
    assert settings.kafka_bootstrap_servers == "127.0.0.1:19092"
    assert settings.redis_url == "redis://127.0.0.1:16379/0"
    assert settings.vllm_urls == ["http://127.0.0.1:18000"]
    assert settings.train_interval == timedelta(hours=5)
    assert settings.survival_horizon == timedelta(minutes=15)
    assert settings.guardrail_interval is None  # guardrails roll back only when ops ask
    assert settings.base_model_path == Path("./var/models/base")


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RTRL_DATA_DIR", "/srv/rtrl")
    monkeypatch.setenv("RTRL_DATABASE_URL", "postgresql://app@db.internal/rtrl")
    monkeypatch.setenv("RTRL_VLLM_URLS", "http://vllm-0:8000, http://vllm-1:8000/")
    monkeypatch.setenv("RTRL_TRAIN_INTERVAL", "PT30M")
    monkeypatch.setenv("RTRL_SURVIVAL_HORIZON", "600")
    monkeypatch.setenv("RTRL_GUARDRAIL_INTERVAL", "PT1M")
    monkeypatch.setenv("RTRL_EMBEDDED_REDIS_PORT", "16400")
    settings = load_settings()
    assert settings.database_url == "postgresql+psycopg://app@db.internal/rtrl"
    assert settings.vllm_urls == ["http://vllm-0:8000", "http://vllm-1:8000"]
    assert settings.train_interval == timedelta(minutes=30)
    assert settings.survival_horizon == timedelta(minutes=10)
    assert settings.guardrail_interval == timedelta(minutes=1)
    assert settings.redis_url == "redis://127.0.0.1:16400/0"
    assert settings.base_model_path == Path("/srv/rtrl/models/base")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("RTRL_DATABASE_URL", "mysql://root@localhost/rtrl"),
        ("RTRL_KAFKA_BOOTSTRAP_SERVERS", "broker-without-port"),
        ("RTRL_REDIS_URL", "http://localhost:6379"),
        ("RTRL_VLLM_URLS", "vllm:8000"),
        ("RTRL_TRAIN_INTERVAL", "five hours"),
        ("RTRL_TRAIN_INTERVAL", "-60"),
        ("RTRL_SURVIVAL_HORIZON", "0"),
        ("RTRL_GUARDRAIL_INTERVAL", "0"),
        ("RTRL_EMBEDDED_POSTGRES_PORT", "70000"),
    ],
)
def test_invalid_values_fail_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as excinfo:
        load_settings()
    assert variable in str(excinfo.value)
