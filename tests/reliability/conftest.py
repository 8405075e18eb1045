"""The loop as real processes under faults: the session's Postgres, Kafka, Redis and vLLM,
a gateway and workers started as `rtrl` subprocesses, simulator traffic, and its books
(`sandbox.simulator.books`) at the end."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from app.auth.service import new_api_key
from app.config import Settings, settings_environment
from app.db import session_scope
from app.models import Role
from app.processes import free_port
from app.serving.publish import ensure_base_checkpoint
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from rtrl.launcher import RtrlProcess
from sandbox.simulator.books import Books, read_books
from sandbox.simulator.report import SimulationReport
from sandbox.simulator.run import compressed_time_settings, simulate
from tests.conftest import external_settings, start_group_at_end


class Traffic:
    """Simulator traffic in a background thread; `result()` waits for its report."""

    def __init__(self, run: Callable[[], SimulationReport]) -> None:
        self._report: SimulationReport | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], SimulationReport]) -> None:
        try:
            self._report = run()
        except BaseException as exc:  # surfaced by result()
            self._error = exc

    def result(self, timeout: float = 300.0) -> SimulationReport:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"simulator traffic still running after {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report


TIME_SCALE = 0.005
"""The loops' developers live this much faster: the 15-minute survival report comes in 4.5 s."""


@dataclass
class Loop:
    """A gateway and workers as subprocesses over the session's services and vLLM."""

    settings: Settings
    engine: Engine
    stack: EmbeddedStack
    ide_key: str
    root: Path
    gateway: RtrlProcess = field(init=False)
    workers: list[RtrlProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        # A consumer group of this loop's own, starting where the topics end now: earlier
        # tests' events stay theirs, and their killed members cannot stall this group's
        # rebalances (the embedded broker was seen to keep a group rebalancing for minutes
        # after a member died without leaving).
        self.group_id = f"rtrl-workers-{uuid.uuid4().hex[:8]}"
        start_group_at_end(self.settings.kafka_bootstrap_servers, self.group_id)
        self.gateway = self._process("gateway", f"{self.url}/readyz")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.gateway_port}"

    def _process(self, name: str, ready_url: str | None = None) -> RtrlProcess:
        arguments = ["gateway"] if name == "gateway" else ["worker", "--group-id", self.group_id]
        environment = settings_environment(self.settings)
        return RtrlProcess(
            name, arguments, self.root / "run", self.root / "logs", environment, ready_url
        )

    def another_gateway(self, name: str, **environment: str) -> RtrlProcess:
        """A gateway beside this loop's, on the same data directory (so the same spool root),
        on a port of its own; `environment` overrides its `RTRL_*` settings."""
        port = free_port()
        environment = settings_environment(self.settings) | environment
        environment["RTRL_GATEWAY_PORT"] = str(port)
        ready = f"http://127.0.0.1:{port}/readyz"
        return RtrlProcess(
            name, ["gateway"], self.root / "run", self.root / "logs", environment, ready
        )

    def start_worker(self) -> RtrlProcess:
        worker = self._process(f"worker-{len(self.workers) + 1}")
        worker.start()
        self.workers.append(worker)
        return worker

    def traffic(
        self, *, users: int = 6, seed: int = 1, gateway: RtrlProcess | None = None, **workload: Any
    ) -> Traffic:
        """Developers working through the gateway (this loop's by default), in the background."""
        options: dict[str, Any] = {
            "sessions_per_user": 2,
            "tasks_per_session": 4,
            "time_scale": TIME_SCALE,
            "concurrency": 6,
            "privacy_share": 0.0,
        } | workload
        url = gateway.url.removesuffix("/readyz") if gateway is not None else self.url
        return Traffic(lambda: simulate(url, self.ide_key, users=users, seed=seed, **options))

    def ready(self, gateway: RtrlProcess | None = None) -> dict[str, Any]:
        url = gateway.url if gateway is not None else f"{self.url}/readyz"
        body: dict[str, Any] = httpx.get(url, timeout=5).json()
        return body

    def wait_for_books(self, reports: list[SimulationReport], timeout: float = 120.0) -> Books:
        """The books once they balance, or as they stand when the timeout runs out."""
        deadline = time.monotonic() + timeout
        books = read_books(self.engine, reports)
        while not books.balanced and time.monotonic() < deadline:
            time.sleep(1.0)
            books = read_books(self.engine, reports)
        return books

    def stop(self) -> None:
        for process in [*self.workers, self.gateway]:
            process.stop()


def make_key(engine: Engine, role: Role, **fields: Any) -> str:
    """A new API key's secret; a whole simulated population may share it."""
    fields.setdefault("rate_limit_per_minute", 100_000)
    with session_scope(engine) as session:
        row, secret = new_api_key(name=f"reliability-{uuid.uuid4().hex[:8]}", role=role, **fields)
        session.add(row)
    return secret


def kill(process: RtrlProcess) -> None:
    """SIGKILL, as the OOM killer or a lost node would."""
    pid = process.pid()
    assert pid is not None, f"{process.name} is not running"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while process.pid() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.pid_file.unlink(missing_ok=True)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.2)


def open_loop(
    engine: Engine,
    stack: EmbeddedStack,
    vllm: VllmServer,
    model_dir: Path,
    root: Path,
    **overrides: Any,
) -> Loop:
    """A gateway and one worker over the session's services, with an IDE key to drive them
    (`overrides`: settings by field name)."""
    settings = compressed_time_settings(
        external_settings(stack, vllm, model_dir, root), TIME_SCALE
    ).model_copy(update=overrides)
    with session_scope(engine) as session:
        ensure_base_checkpoint(session, str(model_dir))
    loop = Loop(settings, engine, stack, make_key(engine, Role.ide), root)
    loop.gateway.start()
    loop.start_worker()
    return loop


@pytest.fixture
def loop(
    clean_registry: Engine,
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> Iterator[Loop]:
    """A clean registry, a running gateway and one worker; all stopped after the test."""
    loop = open_loop(clean_registry, stack, vllm_server, tiny_model_dir, tmp_path)
    try:
        yield loop
    finally:
        loop.stop()
        # Whatever a test stopped comes back for the rest of the session.
        stack.kafka.start()
        stack.postgres.start()
