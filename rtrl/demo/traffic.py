"""The demo's traffic: simulated developers on the gateway, and the wait for the rewards the
workers make of what they did."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

from sqlalchemy import Engine, func, select
from tqdm import tqdm

from app.db import session_scope
from app.models import Reward, Sample
from rtrl.demo.clients import DemoKeys
from rtrl.demo.config import DemoConfig, Progress
from rtrl.demo.tables import served_line
from sandbox.simulator.report import SimulationReport
from sandbox.simulator.run import simulate


@contextmanager
def phase_bar(label: str, total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar for one phase; yields a function that sets how much is done."""
    bar = tqdm(total=total, desc=f"  {label}", unit="", leave=False, disable=not enabled)
    try:
        yield lambda done: bar.update(max(0, done - bar.n))
    finally:
        bar.close()


def run_traffic(
    gateway: str,
    key: str,
    config: DemoConfig,
    *,
    label: str,
    users: int,
    sessions: int,
    seed: int,
    split: Literal["train", "heldout"],
    concurrency: int,
) -> SimulationReport:
    """Simulated developers on the gateway, with a progress bar of their sessions."""
    with phase_bar(label, users * sessions, config.progress_bars) as advance:
        return simulate(
            gateway,
            key,
            users=users,
            sessions_per_user=sessions,
            tasks_per_session=config.tasks_per_session,
            time_scale=config.time_scale,
            seed=seed,
            split=split,
            concurrency=concurrency,
            agent=config.agent,
            client=config.client,
            progress=lambda report: advance(report.sessions_ended),
        )


def wait_for_rewards(
    engine: Engine,
    request_ids: list[str],
    progress: Progress,
    timeout: float = 180.0,
    bars: bool = False,
) -> int:
    """Block until every served request has a finalized reward (or the timeout)."""
    started = time.monotonic()
    with phase_bar("rewards finalized", len(request_ids), bars) as advance:
        finalized = _wait_for_rewards(engine, request_ids, timeout, advance)
    progress(
        f"  rewards: {finalized}/{len(request_ids)} finalized"
        f" {time.monotonic() - started:.0f} s after the traffic"
    )
    return finalized


def _wait_for_rewards(
    engine: Engine, request_ids: list[str], timeout: float, advance: Callable[[int], None]
) -> int:
    deadline = time.monotonic() + timeout
    finalized = 0
    while time.monotonic() < deadline:
        with session_scope(engine) as session:
            finalized = (
                session.scalar(
                    select(func.count())
                    .select_from(Reward)
                    .join(Sample, Sample.id == Reward.sample_id)
                    .where(Sample.request_id.in_(request_ids), Reward.finalized_at.is_not(None))
                )
                or 0
            )
        advance(finalized)
        if finalized >= len(request_ids):
            break
        time.sleep(1.0)
    return finalized


def rewarded_traffic(
    engine: Engine,
    gateway: str,
    key: str,
    config: DemoConfig,
    progress: Progress,
    *,
    label: str,
    users: int,
    sessions: int,
    seed: int,
    split: Literal["train", "heldout"],
    concurrency: int,
) -> SimulationReport:
    """`run_traffic`, its served line, then the wait until its rewards are final."""
    report = run_traffic(
        gateway,
        key,
        config,
        label=label,
        users=users,
        sessions=sessions,
        seed=seed,
        split=split,
        concurrency=concurrency,
    )
    progress(served_line(report))
    wait_for_rewards(
        engine, [r.request_id for r in report.served], progress, bars=config.progress_bars
    )
    return report


def held_out_evaluation(
    engine: Engine,
    gateway: str,
    keys: DemoKeys,
    config: DemoConfig,
    progress: Progress,
    *,
    label: str,
    users: int,
    seed: int,
) -> SimulationReport:
    """Privacy-mode developers, one session each, on held-out tasks, rewards awaited."""
    return rewarded_traffic(
        engine,
        gateway,
        keys.evaluator,
        config,
        progress,
        label=label,
        users=users,
        sessions=1,
        seed=seed,
        split="heldout",
        concurrency=config.eval_concurrency,
    )
