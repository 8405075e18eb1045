"""Start, find and stop detached service processes by pid file."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil


class ServiceError(RuntimeError):
    """A service could not be started or stopped; the message says why."""


def port_is_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def running_pid(pid_file: Path) -> int | None:
    """The pid recorded in `pid_file` if that process is still alive."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return pid


def start_detached(
    command: Sequence[str],
    *,
    pid_file: Path,
    log_file: Path,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `command` in its own session, output to `log_file`, pid to `pid_file`."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    pid_file.write_text(f"{process.pid}\n")
    return process


def wait_for_port(
    host: str,
    port: int,
    *,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    log_file: Path | None = None,
    name: str = "service",
) -> None:
    """Block until host:port accepts connections; fail early if `process` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_is_open(host, port):
            return
        if process is not None and process.poll() is not None:
            raise ServiceError(
                f"{name} exited with code {process.returncode} before listening on "
                f"{host}:{port}{log_tail(log_file)}"
            )
        time.sleep(0.05)
    raise ServiceError(f"{name} did not listen on {host}:{port} within {timeout:.0f} s")


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants; empty when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def stop_pid(pid: int, *, timeout: float = 10.0) -> None:
    """SIGTERM the process group of `pid`, then SIGKILL whatever is left."""
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return
    members = process_tree(pid)
    with contextlib.suppress(ProcessLookupError, psutil.Error):
        os.killpg(group, signal.SIGTERM)
    _, alive = psutil.wait_procs(members, timeout=timeout)
    for process in alive:
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def log_tail(log_file: Path | None, lines: int = 20) -> str:
    """The last lines of a log file, formatted to append to an error message."""
    if log_file is None or not log_file.exists():
        return ""
    tail = log_file.read_text(errors="replace").splitlines()[-lines:]
    return f"\n--- last lines of {log_file} ---\n" + "\n".join(tail)
