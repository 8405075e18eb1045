"""Streamed exports never starve the gateway's other requests of database connections.

A real gateway (uvicorn) on the analytics database: the samples table is locked so that every
export stalls holding whatever connection it has, as a slow download does, while an analyst
with a key the gateway has not seen yet (a database lookup) lists the experiments.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pandas as pd
import psycopg
import pytest

from app.config import Settings
from app.models import Role
from tests.analytics import app_fixtures
from tests.analytics.conftest import Behaviour, SeededArm
from tests.gateway.conftest import GatewayServer

STREAMS = 2
EXPORTS = 25
"""More exports at once than the gateway's own pool has connections (10 + 10 overflow)."""


@pytest.fixture
def exporting_gateway(app_settings: Settings) -> Iterator[GatewayServer]:
    server = GatewayServer(app_settings.model_copy(update={"export_streams": STREAMS})).start()
    yield server
    server.stop()


@pytest.fixture
def seeded(seeder: Callable[..., tuple[int, pd.DataFrame]]) -> tuple[int, pd.DataFrame]:
    return seeder(
        [
            SeededArm("control", "base-ex", 5_000, Behaviour(30), is_control=True),
            SeededArm("treatment", "ckpt-ex", 5_000, Behaviour(30)),
        ],
        seed=7,
    )


def test_exports_past_their_pool_are_refused_at_once_and_serving_keeps_its_connections(
    exporting_gateway: GatewayServer,
    seeded: tuple[int, pd.DataFrame],
    app_database: str,
    make_key: Callable[..., str],
) -> None:
    experiment_id, rows = seeded
    url = f"{exporting_gateway.url}/analytics/experiments/{experiment_id}/samples.csv"
    exporter = app_fixtures.bearer(make_key(Role.analyst))

    def export() -> tuple[int, dict[str, Any], str]:
        response = httpx.get(url, headers=exporter, timeout=120)
        return response.status_code, dict(response.headers), response.text

    lock = psycopg.connect(app_database.replace("postgresql+psycopg", "postgresql"))
    lock.execute("LOCK TABLE samples IN ACCESS EXCLUSIVE MODE")
    try:
        with ThreadPoolExecutor(EXPORTS) as pool:
            exports = [pool.submit(export) for _ in range(EXPORTS)]
            _answered(exports, EXPORTS - STREAMS)
            time.sleep(1.0)  # and no more: the others stall on the lock
            refused = [f.result() for f in exports if f.done()]
            # Every export past the pool's size is answered now, while the rest stall.
            assert len(refused) == EXPORTS - STREAMS
            assert {status for status, _, _ in refused} == {429}
            _, headers, body = refused[0]
            assert headers["retry-after"] == "5" and "too_many_exports" in body

            # A newcomer's request needs a connection for its key, and gets one.
            newcomer = app_fixtures.bearer(make_key(Role.analyst))
            listed = httpx.get(
                f"{exporting_gateway.url}/analytics/experiments", headers=newcomer, timeout=20
            )
            assert listed.status_code == 200
            assert experiment_id in {experiment["id"] for experiment in listed.json()}
            lock.rollback()  # the downloads go on

            finished = [f.result() for f in exports if f.result()[0] == 200]
    finally:
        lock.close()
    assert len(finished) == STREAMS
    for _, _, text in finished:
        assert len(list(csv.DictReader(io.StringIO(text)))) == len(rows)
    # The places are given back: the next export streams.
    assert export()[0] == 200


def _answered(futures: list[Future[Any]], count: int, timeout_s: float = 20.0) -> None:
    """Wait until `count` of the requests are answered (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while sum(f.done() for f in futures) < count and time.monotonic() < deadline:
        time.sleep(0.05)
