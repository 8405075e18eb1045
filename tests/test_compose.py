"""docker-compose.yml describes production with the same settings and health checks the code
answers."""

import ipaddress
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from sqlalchemy import Engine

from app.config import Settings, refuse_development_secrets, settings_environment
from app.kafka.clients import kafka_security
from app.processes import free_port
from rtrl.embedded.stack import EmbeddedStack
from rtrl.launcher import RtrlProcess
from trainer.config import TrainSettings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
CADDYFILE = ROOT / "ops" / "caddy" / "Caddyfile"
SECRETS = {
    "POSTGRES_PASSWORD",
    "REDIS_PASSWORD",
    "KAFKA_PASSWORD",
    "VLLM_API_KEY",
    "RTRL_USER_HASH_SECRET",
    "GRAFANA_ADMIN_PASSWORD",
}
ONE_SHOT = {"migrations"}
# Compose's interpolation: $$ is a dollar; ${NAME:?message} fails unless NAME is set and not
# empty, ${NAME:-default} falls back to the default, ${NAME} is NAME or nothing.
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::([?-])([^}]*))?\}")


class Unset(Exception):
    """Compose would refuse to start: a required variable is not set."""


def interpolate(node: Any, variables: Mapping[str, str]) -> Any:
    """The compose file as `docker compose` sees it with `variables` in its environment."""
    if isinstance(node, dict):
        return {key: interpolate(value, variables) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value, variables) for value in node]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, kind, rest = match.groups()
        value = variables.get(name, "")
        if kind == "?" and not value:
            raise Unset(name)
        return rest if kind == "-" and not value else value

    return VARIABLE.sub(substitute, node)


def strings(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [text for value in node.values() for text in strings(value)]
    if isinstance(node, list):
        return [text for value in node for text in strings(value)]
    return [node] if isinstance(node, str) else []


def credentials(service: dict[str, Any]) -> list[tuple[str, str]]:
    """Every password, key and secret a service is given: (where, value)."""
    found = [
        (f"environment {name}", str(value))
        for name, value in service.get("environment", {}).items()
        if re.search(r"PASSWORD|SECRET|API_KEY|_AUTH$", name)
    ]
    command = service.get("command", [])
    for index, argument in enumerate(command):
        if argument.startswith("--api-key="):
            found.append(("--api-key", argument.removeprefix("--api-key=")))
        if argument == "--requirepass":
            found.append(("--requirepass", command[index + 1]))
    for text in strings(service.get("environment", {})):
        found += [
            ("a URL's password", value) for value in re.findall(r"://[^:/@\s]*:([^@\s]+)@", text)
        ]
        found += [
            (f"JAAS {option}", value)
            for option, value in re.findall(r'\b(password|user_\w+)="([^"]*)"', text)
        ]
    return found


def sample_secrets() -> dict[str, str]:
    return {name: f"{name.lower().replace('_', '')}4c1d" for name in SECRETS} | {
        "GATEWAY_DOMAIN": "rtrl.example.com"
    }


def compose_settings(environment: Mapping[str, str]) -> Settings:
    """The settings an rtrl process reads from a compose service's environment."""
    fields = {
        name.removeprefix("RTRL_").lower(): value
        for name, value in environment.items()
        if name.startswith("RTRL_")
    }
    return Settings(**fields)


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
    assert entrypoint[0] == "torchrun" and entrypoint[-2:] == ["-m", "rtrl.cli"]
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


def test_compose_refuses_to_start_until_every_secret_is_set_and_holds_none_itself() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    required = {
        match.group(1)
        for text in strings(compose)
        for match in VARIABLE.finditer(text)
        if match.group(2) == "?"
    }
    assert required == SECRETS | {"GATEWAY_DOMAIN"}
    for name in required:
        with pytest.raises(Unset, match=name):
            interpolate(compose, {k: v for k, v in sample_secrets().items() if k != name})

    secrets = sample_secrets()
    services = interpolate(compose, secrets)["services"]
    for name, service in services.items():
        for where, value in credentials(service):
            assert value in secrets.values(), f"{name} has a literal secret in its {where}"
    # Each service that wants one has its own, from a variable: none is left open.
    given = {
        name: [where for where, _ in credentials(service)] for name, service in services.items()
    }
    for name in ("postgres", "redis", "kafka", "vllm", "gateway", "workers", "trainer", "grafana"):
        assert given[name], f"{name} takes no credential"


def test_every_rtrl_process_signs_in_with_what_each_service_requires() -> None:
    services = interpolate(yaml.safe_load(COMPOSE.read_text()), sample_secrets())["services"]
    for name in ("migrations", "gateway", "workers", "trainer"):
        settings = compose_settings(services[name]["environment"])
        refuse_development_secrets(settings)

        postgres = services["postgres"]["environment"]
        database = urlsplit(settings.database_url)
        assert (database.username, database.password, database.path) == (
            postgres["POSTGRES_USER"],
            postgres["POSTGRES_PASSWORD"],
            f"/{postgres['POSTGRES_DB']}",
        )

        redis_command = services["redis"]["command"]
        requirepass = redis_command[redis_command.index("--requirepass") + 1]
        assert urlsplit(settings.redis_url).password == requirepass

        kafka = services["kafka"]["environment"]
        options = kafka_security(settings)
        advertised = kafka["KAFKA_ADVERTISED_LISTENERS"]
        assert advertised == f"{options['security_protocol']}://{settings.kafka_bootstrap_servers}"
        assert options["sasl_mechanism"] in kafka["KAFKA_SASL_ENABLED_MECHANISMS"].split(",")
        jaas = kafka["KAFKA_LISTENER_NAME_SASL__PLAINTEXT_PLAIN_SASL_JAAS_CONFIG"]
        user = f'user_{options["sasl_plain_username"]}="{options["sasl_plain_password"]}"'
        assert user in jaas

        vllm = services["vllm"]["command"]
        assert f"--api-key={settings.vllm_api_key.get_secret_value()}" in vllm
        assert settings.vllm_urls == ["http://vllm:8000"] and "--port=8000" in vllm


def test_every_long_running_service_restarts() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service["restart"] == "no"
        else:
            assert service.get("restart") in ("unless-stopped", "on-failure", "always"), name


def test_only_the_tls_proxy_is_reachable_from_outside_this_host() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    for name in ("postgres", "redis", "kafka", "vllm", "gateway", "workers", "trainer"):
        assert "ports" not in services[name], f"{name} publishes a port"
    for name, service in services.items():
        if name != "proxy":
            for port in service.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} to all"
    assert services["proxy"]["ports"] == ["80:80", "443:443", "443:443/udp"]
    # vLLM shares a network with nothing but its two clients, and has no way out of it.
    assert services["vllm"]["networks"] == ["inference"]
    on_inference = {name for name, s in services.items() if "inference" in s.get("networks", [])}
    assert on_inference == {"vllm", "gateway", "trainer"}
    assert compose["networks"]["inference"]["internal"] is True


def test_the_gateway_is_reached_through_the_proxy_and_trusts_only_it() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    gateway, proxy = services["gateway"], services["proxy"]
    assert "edge" in gateway["networks"] and list(proxy["networks"]) == ["edge"]
    address = proxy["networks"]["edge"]["ipv4_address"]
    (edge,) = compose["networks"]["edge"]["ipam"]["config"]
    assert ipaddress.ip_address(address) in ipaddress.ip_network(edge["subnet"])
    assert ipaddress.ip_address(address) not in ipaddress.ip_network(edge["ip_range"])

    settings = compose_settings(interpolate(gateway["environment"], sample_secrets()))
    assert settings.trusted_proxies == address and settings.trust_proxy_headers

    assert "./ops/caddy/Caddyfile:/etc/caddy/Caddyfile:ro" in proxy["volumes"]
    caddyfile = CADDYFILE.read_text()
    (site,) = re.findall(r"^\{\$(\w+)\} \{$", caddyfile, re.MULTILINE)
    assert site in proxy["environment"]
    assert re.findall(r"^\s*reverse_proxy (\S+)$", caddyfile, re.MULTILINE) == [
        f"gateway:{gateway['command'][-1]}"
    ]
    assert re.search(r"^\s*respond /metrics 404$", caddyfile, re.MULTILINE)


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
        rtrl = [sys.executable, "-m", "rtrl.cli", *command[1:]]
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
