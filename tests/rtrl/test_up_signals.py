"""A foreground `rtrl up` stopped by a process manager (SIGTERM) or a closed terminal (SIGHUP)
stops what it started, as Ctrl-C does, instead of leaving its processes running."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.config import settings_environment
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from tests.conftest import external_settings
from tests.rtrl.embedded.test_stack import alive


def lines_of(process: subprocess.Popen[str]) -> tuple[queue.Queue[str], threading.Thread]:
    """The process's output, a line at a time, read beside the test until it closes."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


def output_until(lines: queue.Queue[str], marker: str, timeout: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not any(marker in line for line in seen):
        try:
            seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
        except queue.Empty:
            pytest.fail(f"no {marker!r} in {timeout:.0f} s; output:\n{''.join(seen)}")
    return seen


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_a_foreground_up_sent_a_stop_signal_stops_every_process_it_started(
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path: Path,
    stop: signal.Signals,
) -> None:
    # The session's services and vLLM addressed as external ones: `up` starts the gateway
    # and a worker, and must stop exactly those.
    settings = external_settings(stack, vllm_server, tiny_model_dir, tmp_path / "data")
    process = subprocess.Popen(
        [sys.executable, "-m", "rtrl.cli", "up", "--no-trainer"],
        env={**os.environ, **settings_environment(settings)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, reader = lines_of(process)
    try:
        table = output_until(lines, "Ctrl-C stops everything", timeout=180)
        started = {
            row.split()[0]: int(row.split()[2])
            for row in table
            if row.split()[:1] in (["gateway"], ["worker-1"]) and " running " in row
        }
        assert set(started) == {"gateway", "worker-1"}, "".join(table)
        assert all(alive(pid) for pid in started.values())

        process.send_signal(stop)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=10)
    said = "".join(table) + "".join(lines.queue)
    left = [name for name, pid in started.items() if alive(pid)]
    for name in left:  # not to outlive the test that found them
        os.kill(started[name], signal.SIGKILL)
    assert left == [], f"{left} still running after {stop.name} (exit {code}):\n{said}"
    assert "stopping ..." in said, said
    assert code == 0, said
