"""The main queries on partitioned history: every partition they read, they read by an index,
and a query bounded by time reads only the partitions of that time.

Each query is captured as the code runs it (trainer, workers, sweep, rollups, erasure) and
explained with sequential scans disabled: a sequential scan left in the plan is one no
index can replace.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, event, text

from app.abtest.rollups import refresh_rollups
from app.db import session_scope
from app.history.erasure import erase_in_database, user_history
from app.history.partitions import create_partitions
from app.models import Checkpoint, CheckpointStatus
from tests.history.conftest import served, store
from tests.workers.conftest import Events
from trainer.data import select_on_policy_batch
from workers.config import WorkerConfig
from workers.sweep import finalize_due_rewards

DAY = datetime(2026, 5, 10, 12, tzinfo=UTC)
DAYS = [DAY + timedelta(days=n) for n in range(-3, 2)]
HISTORY = re.compile(r"\b(samples|rewards|feedback_events)\b")
PARTITION = re.compile(r"^(samples|rewards|feedback_events)(_p\d{8}|_default)$")


@pytest.fixture
def history(history_engine: Engine, events: Events) -> Engine:
    """Five days of partitions, two completions each, statistics gathered."""
    with history_engine.begin() as conn:
        create_partitions(conn, [day.date() for day in DAYS])
    for n, day in enumerate(DAYS):
        store(history_engine, *served(events, 2 * n, "user-a", day, checkpoint="ckpt-1"), now=day)
        late = served(events, 2 * n + 1, "user-b", day + timedelta(hours=1), checkpoint="ckpt-1")
        store(history_engine, *late[:2], now=day)  # left open, for the sweep
    with history_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("ANALYZE samples, rewards, feedback_events")
        )
    return history_engine


class Captured:
    """The statements an engine ran that read or write the history tables."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []

    def __call__(self, conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if HISTORY.search(statement) and not statement.lstrip().upper().startswith(
            ("EXPLAIN", "ANALYZE", "SELECT PG_", "TRUNCATE")
        ):
            if isinstance(parameters, list):
                parameters = parameters[0] if parameters else None
            self.statements.append((statement, parameters))


@pytest.fixture
def captured(history: Engine) -> Iterator[Captured]:
    capture = Captured()
    event.listen(history, "before_cursor_execute", capture)
    yield capture
    event.remove(history, "before_cursor_execute", capture)


def plan_nodes(engine: Engine, statement: str, parameters: Any) -> list[dict[str, Any]]:
    """Every node of the statement's plan, sequential scans disabled."""
    raw = engine.raw_connection()
    try:
        with raw.cursor() as cursor:
            cursor.execute("SET enable_seqscan = off")
            # The table of touched samples a rollup refresh reads lives only in its transaction.
            cursor.execute(
                "CREATE TEMP TABLE IF NOT EXISTS rollup_touched (sample_id bigint PRIMARY KEY)"
            )
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
            (plan,) = cursor.fetchone()[0]
        raw.rollback()
    finally:
        raw.close()
    nodes, stack = [], [plan["Plan"]]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.get("Plans", []))
    return nodes


def scanned(nodes: list[dict[str, Any]]) -> set[str]:
    return {node["Relation Name"] for node in nodes if "Relation Name" in node}


def sequential(nodes: list[dict[str, Any]]) -> set[str]:
    return {
        node["Relation Name"]
        for node in nodes
        if node["Node Type"] == "Seq Scan" and PARTITION.match(node.get("Relation Name", ""))
    }


def test_the_trainers_selection_reads_only_the_days_since_its_checkpoint_by_index(
    history: Engine, captured: Captured
) -> None:
    with session_scope(history) as session:
        production = Checkpoint(
            name="ckpt-1",
            status=CheckpointStatus.production,
            base_model="tiny",
            published_at=DAY - timedelta(days=1),
        )
        session.add(production)
        session.flush()
        batch = select_on_policy_batch(session, production, max_samples=100)
    # Each day has a final sample and, an hour later, an open one: the cohort whose rewards
    # are all final ends at the first open one since the checkpoint's publication.
    assert [sample.served_at for sample in batch.samples] == [DAY - timedelta(days=1)]

    since_publication = {"p20260509", "p20260510", "p20260511", "default"}
    (cohort, cohort_parameters), (selection, parameters), *_ = captured.statements
    for statement, arguments in ((cohort, cohort_parameters), (selection, parameters)):
        nodes = plan_nodes(history, statement, arguments)
        assert sequential(nodes) == set()
        for table in ("samples", "rewards"):
            read = {name for name in scanned(nodes) if name.startswith(table)}
            assert read <= {f"{table}_{day}" for day in since_publication}, read
    # The selection stops at the cohort's end: the later days are not read at all.
    read = {name for name in scanned(plan_nodes(history, selection, parameters))}
    assert {name for name in read if name.startswith("samples")} == {"samples_p20260509"}


def test_the_workers_sweep_rollups_and_erasure_read_every_partition_by_index(
    history: Engine, events: Events, captured: Captured
) -> None:
    store(history, *served(events, 100, "user-c", DAY, checkpoint="ckpt-1"), now=DAY)
    finalize_due_rewards(history, WorkerConfig(), now=DAY + timedelta(days=3))
    refresh_rollups(history)
    refresh_rollups(history)
    with history.begin() as conn:
        erase_in_database(conn, "user-a", user_history(conn, "user-a"), now=DAY)

    assert len(captured.statements) > 15
    for statement, parameters in captured.statements:
        nodes = plan_nodes(history, statement, parameters)
        assert sequential(nodes) == set(), statement
