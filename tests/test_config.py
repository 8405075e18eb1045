import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import SecretStr

from app.config import (
    Settings,
    SettingsError,
    load_settings,
    refuse_development_secrets,
    settings_environment,
)
from app.main import create_app


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
        ("RTRL_KAFKA_SECURITY_PROTOCOL", "SASL_PLAIN"),
        ("RTRL_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT"),  # with no mechanism
        ("RTRL_KAFKA_SASL_MECHANISM", "PLAIN"),  # over PLAINTEXT
        ("RTRL_KAFKA_SASL_MECHANISM", "GSSAPI"),
    ],
)
def test_invalid_values_fail_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as excinfo:
        load_settings()
    assert variable in str(excinfo.value)


def test_kafka_sasl_and_the_vllm_key_are_read_and_kept_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().kafka_security_protocol == "PLAINTEXT"  # the embedded broker's
    assert Settings().vllm_api_key.get_secret_value() == ""  # no header sent
    monkeypatch.setenv("RTRL_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("RTRL_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("RTRL_KAFKA_SASL_USERNAME", "rtrl")
    monkeypatch.setenv("RTRL_KAFKA_SASL_PASSWORD", "k4fka")
    monkeypatch.setenv("RTRL_VLLM_API_KEY", "vllm-k3y")
    settings = load_settings()
    assert settings.kafka_sasl_password.get_secret_value() == "k4fka"
    assert settings.vllm_api_key.get_secret_value() == "vllm-k3y"
    assert "k4fka" not in repr(settings) and "vllm-k3y" not in repr(settings)
    # Child processes (`rtrl up`'s gateway and workers) read the same.
    assert (
        Settings(
            **{
                k.removeprefix("RTRL_").lower(): v
                for k, v in settings_environment(settings).items()
            }
        )
        == settings
    )

    monkeypatch.delenv("RTRL_KAFKA_SASL_PASSWORD")
    with pytest.raises(SettingsError, match="RTRL_KAFKA_SASL_PASSWORD"):
        load_settings()


PRODUCTION = {
    "RTRL_DATABASE_URL": "postgresql+psycopg://rtrl:rtrl@postgres:5432/rtrl",
    "RTRL_KAFKA_BOOTSTRAP_SERVERS": "kafka:9092",
    "RTRL_REDIS_URL": "redis://redis:6379/0",
    "RTRL_VLLM_URLS": "http://vllm:8000",
}


def test_development_secrets_are_refused_only_beside_external_services() -> None:
    external = Settings(database_url=PRODUCTION["RTRL_DATABASE_URL"])
    with pytest.raises(SettingsError) as refused:
        refuse_development_secrets(external)
    assert str(refused.value).startswith("RTRL_USER_HASH_SECRET ")
    assert "RTRL_DATABASE_URL" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(SettingsError):
        refuse_development_secrets(external.model_copy(update={"user_hash_secret": SecretStr("")}))
    with pytest.raises(SettingsError):
        create_app(external)

    refuse_development_secrets(external.model_copy(update={"user_hash_secret": SecretStr("s3")}))
    refuse_development_secrets(Settings())  # the embedded stack on loopback
    refuse_development_secrets(
        Settings(
            database_url="postgresql+psycopg://postgres@localhost:5432/rtrl",
            redis_url="unix:///tmp/redis.sock",
            vllm_urls=["http://[::1]:8000"],
        )
    )


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_gateway_and_workers_refuse_to_start_on_the_development_secret(
    command: str, tmp_path: Path
) -> None:
    environment = {"PATH": os.environ["PATH"], "RTRL_DATA_DIR": str(tmp_path), **PRODUCTION}

    started = subprocess.run(
        [sys.executable, "-m", "rtrl.cli", command],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert started.returncode == 1
    (line,) = started.stderr.strip().splitlines()
    assert line.startswith("error: RTRL_USER_HASH_SECRET must be set"), started.stderr
