"""The embedded stack: Postgres, Kafka and Redis under one data dir, as one unit."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from app.config import Settings
from app.db import upgrade_schema
from app.kafka.admin import DEFAULT_TOPICS, ensure_topics
from app.kafka.clients import kafka_security
from rtrl.embedded.kafka import EmbeddedKafka
from rtrl.embedded.postgres import EmbeddedPostgres
from rtrl.embedded.redis import EmbeddedRedis


class EmbeddedService(Protocol):
    name: str

    @property
    def url(self) -> str: ...

    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def healthy(self) -> bool: ...


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    url: str
    embedded: bool
    running: bool
    pid: int | None


@dataclass
class EmbeddedStack:
    """The three backing services; `external` names those that a URL points elsewhere."""

    postgres: EmbeddedPostgres
    kafka: EmbeddedKafka
    redis: EmbeddedRedis
    external_urls: dict[str, str]
    kafka_security: dict[str, Any] = field(default_factory=dict)
    """How to reach an external Kafka (`kafka_security`); the embedded broker is PLAINTEXT."""

    @classmethod
    def at(
        cls,
        data_dir: Path,
        *,
        postgres_port: int,
        kafka_port: int,
        redis_port: int,
    ) -> EmbeddedStack:
        root = data_dir.resolve() / "services"
        return cls(
            postgres=EmbeddedPostgres(root / "postgres", postgres_port),
            kafka=EmbeddedKafka(root / "kafka", kafka_port),
            redis=EmbeddedRedis(root / "redis", redis_port),
            external_urls={},
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> EmbeddedStack:
        """Embedded services for every URL left at its embedded default."""
        stack = cls.at(
            settings.data_dir,
            postgres_port=settings.embedded_postgres_port,
            kafka_port=settings.embedded_kafka_port,
            redis_port=settings.embedded_redis_port,
        )
        configured = {
            "postgres": settings.database_url,
            "kafka": settings.kafka_bootstrap_servers,
            "redis": settings.redis_url,
        }
        for service in stack.all():
            if configured[service.name] != service.url:
                stack.external_urls[service.name] = configured[service.name]
        if "kafka" in stack.external_urls:
            stack.kafka_security = kafka_security(settings)
        return stack

    def all(self) -> list[EmbeddedService]:
        return [self.postgres, self.kafka, self.redis]

    def embedded(self) -> list[EmbeddedService]:
        return [service for service in self.all() if service.name not in self.external_urls]

    def url(self, name: str) -> str:
        return self.external_urls.get(name) or next(s.url for s in self.all() if s.name == name)

    def up(self) -> list[ServiceStatus]:
        """Start what is embedded (idempotently), then create topics and migrate."""
        for service in self.embedded():
            service.start()
        if "kafka" in self.external_urls:
            ensure_topics(self.url("kafka"), DEFAULT_TOPICS, security=self.kafka_security)
        upgrade_schema(self.url("postgres"))
        return self.status()

    def down(self) -> list[ServiceStatus]:
        for service in reversed(self.embedded()):
            service.stop()
        return self.status()

    def status(self) -> list[ServiceStatus]:
        statuses = []
        for service in self.all():
            embedded = service.name not in self.external_urls
            pid = service.pid() if embedded else None
            statuses.append(
                ServiceStatus(
                    name=service.name,
                    url=self.url(service.name),
                    embedded=embedded,
                    running=(pid is not None and service.healthy()) if embedded else False,
                    pid=pid,
                )
            )
        return statuses

    def environment(self) -> dict[str, str]:
        """The `RTRL_*` variables that point other processes at this stack."""
        return {
            "RTRL_DATABASE_URL": self.url("postgres"),
            "RTRL_KAFKA_BOOTSTRAP_SERVERS": self.url("kafka"),
            "RTRL_REDIS_URL": self.url("redis"),
        }
