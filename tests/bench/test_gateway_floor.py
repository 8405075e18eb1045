"""bench.gateway_floor answers every request it times and prints a figure for each floor."""

from __future__ import annotations

import re
import subprocess
import sys

from bench.gateway_floor import framework_apps


def test_it_prints_a_figure_per_client_and_framework() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.gateway_floor", "--requests", "50"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    figures = dict(re.findall(r"^  (\S.*?)\s+(\d+)$", done.stdout, re.MULTILINE))
    expected = [
        f"{client}: {command}"
        for client in ("redis-py", "redis-py, no socket timeout", "bare stream")
        for command in ("SET NX", "MGET of 4", "pipeline of 3 SETs")
    ]
    assert set(figures) == {*expected, *framework_apps()}, done.stdout
    assert all(int(value) > 0 for label, value in figures.items() if label != "bare ASGI")
