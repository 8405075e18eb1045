"""`rtrl up`: the whole embedded stack — services, base model, vLLM, gateway, workers,
trainer — started in order, reported in one table, stopped in reverse."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from app.config import Settings, embedded_vllm_url, settings_environment
from app.db import make_engine, session_scope
from app.processes import (
    ServiceError,
    log_tail,
    running_pid,
    start_detached,
    stop_pid,
)
from app.serving.publish import ensure_base_checkpoint, reconcile
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from sandbox.bases import (
    DEFAULT_BASE,
    BaseIdentity,
    install_base,
    shipped_base_dir,
    verify_base,
)


@dataclass
class RtrlProcess:
    """One rtrl role (`gateway`, `worker`, `trainer`) as a detached `rtrl` subprocess."""

    name: str
    arguments: list[str]
    root: Path
    logs_dir: Path
    environment: dict[str, str]
    ready_url: str | None = None

    @property
    def pid_file(self) -> Path:
        return self.root / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.logs_dir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return self.ready_url or "-"

    def pid(self) -> int | None:
        return running_pid(self.pid_file)

    def start(self, *, timeout: float = 120.0) -> None:
        if self.pid() is not None:
            return
        process = start_detached(
            [sys.executable, "-m", "rtrl.cli", *self.arguments],
            pid_file=self.pid_file,
            log_file=self.log_file,
            env=self.environment,
        )
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if process.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with code {process.returncode}{log_tail(self.log_file)}"
                )
            if time.monotonic() > deadline:
                raise ServiceError(f"{self.name} was not ready within {timeout:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            stop_pid(pid, timeout=30)
        self.pid_file.unlink(missing_ok=True)

    def healthy(self) -> bool:
        if self.pid() is None:
            return False
        if self.ready_url is None:
            return True
        try:
            return httpx.get(self.ready_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class StackRow:
    name: str
    state: str
    pid: int | None
    url: str


@dataclass
class FullStack:
    settings: Settings
    services: EmbeddedStack
    vllm: VllmServer | None
    gateway: RtrlProcess
    workers: list[RtrlProcess]
    trainer: RtrlProcess | None
    progress: Callable[[str], None] = field(default=print)
    started: list[str] = field(default_factory=list)
    """What `up` found stopped and started; `down(started_only=True)` stops just those."""
    bootstrap: bool = False
    """Train the base model when the data dir has none, instead of installing the shipped one."""

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        workers: int = 1,
        trainer: bool = True,
        progress: Callable[[str], None] = print,
        bootstrap: bool = False,
    ) -> FullStack:
        root = settings.data_dir.resolve() / "run"
        logs = settings.logs_dir.resolve()
        embedded_vllm = settings.vllm_urls == [embedded_vllm_url(settings.embedded_vllm_port)]
        gateway_url = f"http://{settings.gateway_host}:{settings.gateway_port}"
        env = settings_environment(settings)
        return cls(
            settings=settings,
            services=EmbeddedStack.from_settings(settings),
            vllm=VllmServer.from_settings(settings) if embedded_vllm else None,
            gateway=RtrlProcess("gateway", ["gateway"], root, logs, env, f"{gateway_url}/readyz"),
            workers=[
                RtrlProcess(f"worker-{i}", ["worker"], root, logs, env)
                for i in range(1, workers + 1)
            ],
            trainer=RtrlProcess("trainer", ["trainer"], root, logs, env) if trainer else None,
            progress=progress,
            bootstrap=bootstrap,
        )

    @property
    def gateway_url(self) -> str:
        return f"http://{self.settings.gateway_host}:{self.settings.gateway_port}"

    def up(self) -> list[StackRow]:
        """Start everything that is not running yet, in dependency order."""
        self.progress("services: Postgres, Kafka, Redis ...")
        self.started += [s.name for s in self.services.embedded() if s.pid() is None]
        self.services.up()
        self.ensure_base_model()
        if self.vllm is not None and self.vllm.pid() is None:
            self.started.append(self.vllm.name)
            self.progress("vLLM: starting (about a minute on 2 cores) ...")
            started = time.monotonic()
            self.vllm.start()
            self.progress(f"vLLM: healthy after {time.monotonic() - started:.0f} s")
        engine = make_engine(self.settings.database_url)
        try:
            with session_scope(engine) as session:
                ensure_base_checkpoint(session, str(self.settings.base_model_path))
            report = reconcile(
                engine,
                self.settings.vllm_urls,
                api_key=self.settings.vllm_api_key.get_secret_value(),
            )
        finally:
            engine.dispose()
        if report.errors:
            raise ServiceError("; ".join(report.errors))
        for process in self.roles():
            if process.pid() is None:
                self.started.append(process.name)
                self.progress(f"{process.name}: starting ...")
            process.start()
        return self.status()

    def roles(self) -> list[RtrlProcess]:
        return [self.gateway, *self.workers, *([self.trainer] if self.trainer else [])]

    def others_running(self) -> list[RtrlProcess]:
        """Roles an earlier `up` started that this one was not asked for (more workers, or a
        trainer), found by their pid files, so `down` stops whatever `up` started."""
        known = {process.name for process in self.roles()}
        root, logs, env = self.gateway.root, self.gateway.logs_dir, self.gateway.environment
        found = []
        for pid_file in sorted(root.glob("*.pid")):
            name = pid_file.stem
            if name in known or not (name.startswith("worker-") or name == "trainer"):
                continue
            arguments = ["trainer"] if name == "trainer" else ["worker"]
            found.append(RtrlProcess(name, arguments, root, logs, env))
        return found

    def ensure_base_model(self) -> None:
        """The configured base, checked against its checksums; under the data dir, the shipped
        base is installed when none is there (`bootstrap` trains one instead)."""
        model_dir = self.settings.base_model_path
        if self.settings.base_model is None:
            ensure_base(model_dir, DEFAULT_BASE, bootstrap=self.bootstrap, progress=self.progress)
        else:
            self.progress(f"base model: {verify_base(model_dir).describe()}")

    def down(self, *, started_only: bool = False) -> list[StackRow]:
        """Stop the stack in reverse order (only what `up` started, if asked)."""

        def wanted(name: str) -> bool:
            return not started_only or name in self.started

        for process in reversed(self.roles() + self.others_running()):
            if wanted(process.name):
                process.stop()
        if self.vllm is not None and wanted(self.vllm.name):
            self.vllm.stop()
        for service in reversed(self.services.embedded()):
            if wanted(service.name):
                service.stop()
        return self.status()

    def status(self) -> list[StackRow]:
        rows = [
            StackRow(s.name, stack_state(s.embedded, s.running), s.pid, s.url)
            for s in self.services.status()
        ]
        if self.vllm is not None:
            rows.append(
                StackRow(
                    "vllm", stack_state(True, self.vllm.healthy()), self.vllm.pid(), self.vllm.url
                )
            )
        for process in self.roles():
            url = self.gateway_url if process is self.gateway else "-"
            rows.append(
                StackRow(process.name, stack_state(True, process.healthy()), process.pid(), url)
            )
        return rows


def ensure_base(
    model_dir: Path, name: str, *, bootstrap: bool, progress: Callable[[str], None]
) -> BaseIdentity:
    """The base at `model_dir`, verified; when there is none, the shipped base `name` copied
    there, or (`bootstrap`) one trained there by its recipe. Prints the base's identity."""
    if (model_dir / "config.json").is_file():
        if bootstrap:
            progress(f"base model: {model_dir} already holds one; remove it to bootstrap again")
        identity = verify_base(model_dir)
        if identity.checksum == verify_base(shipped_base_dir(name), name).checksum:
            identity = replace(identity, name=name)
        how = "found"
    elif bootstrap:
        from sandbox.bootstrap import RECIPES, bootstrap_model

        progress(f"base model: bootstrapping {name}'s recipe at {model_dir} (minutes) ...")
        report = bootstrap_model(model_dir, RECIPES[name], progress_bar=True)
        progress(f"base model: {report.summary()}")
        identity, how = verify_base(model_dir), "bootstrapped"
    else:
        identity, how = install_base(name, model_dir), "shipped, installed"
    progress(f"base model: {identity.describe()}; {how} at {model_dir}")
    if identity.checksum:
        progress(f"base model: sha256 {identity.checksum}")
    return identity


def stack_state(embedded: bool, running: bool) -> str:
    if not embedded:
        return "external"
    return "running" if running else "stopped"
