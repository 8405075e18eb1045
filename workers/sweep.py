"""Finalizing rewards whose time is up, and replaying a reward formula over stored components."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    DateTime,
    Engine,
    Float,
    Integer,
    Select,
    and_,
    bindparam,
    cast,
    func,
    or_,
    select,
    text,
)

from app.signals.rewards import (
    REWARD_OPEN_LIMIT,
    RewardComponents,
    compute_reward,
    reward_open_limit,
    reward_weights,
)
from workers.config import WorkerConfig
from workers.repository import load_open_samples, lock_partitions, rewards, samples
from workers.store import credit_runs, max_accept_delay_s, refresh_rewards

SWEEP_CHUNK = 500
RECOMPUTE_CHUNK = 5000

_SET_REWARDS = text(
    "UPDATE rewards SET reward = v.reward, reward_version = :version, updated_at = now() "
    "FROM unnest(:sample_ids, :rewards) AS v(sample_id, reward) "
    "WHERE rewards.sample_id = v.sample_id"
).bindparams(
    bindparam("sample_ids", type_=ARRAY(BigInteger)),
    bindparam("rewards", type_=ARRAY(Float)),
)


def finalize_due(
    conn: Connection,
    config: WorkerConfig,
    *,
    now: datetime,
    watermarks: Mapping[int, datetime] | None = None,
    limit: int = SWEEP_CHUNK,
) -> int:
    """Finalize up to `limit` open rewards that are due; rows another sweeper holds are skipped.

    With `watermarks` (partition number -> how far that partition's stream has been read, in
    event time) only those partitions' rewards are swept, each due by its own watermark and
    under its partition lock, so a worker never times out a reward whose feedback it (or a
    lagging peer) has not read yet. Without, every partition is due by `now` (ops' sweeps).
    Each is distilled once more from all its feedback first, so the final record is complete.

    A reward stored with a due time past its bound (`reward_open_limit` after its completion,
    as no worker sets now) is swept too once that bound has passed: distilled again, it is
    due at its bound and finalized.
    """
    open_limit = reward_open_limit(
        horizon_s=config.horizon_s,
        grace_s=config.grace_s,
        max_accept_delay_s=max_accept_delay_s(config),
    )
    due_query = _open_rewards(limit).order_by(rewards.c.due_at)
    # Far past any due time a worker sets now: due_at > now + open_limit > served_at + open_limit.
    stuck_query = _open_rewards(limit).where(rewards.c.due_at > now + open_limit)
    if watermarks is None:
        due_query = due_query.where(rewards.c.due_at <= now)
        stuck_query = stuck_query.where(rewards.c.served_at <= now - open_limit)
    else:
        if not watermarks:
            return 0
        lock_partitions(conn, watermarks)
        marks = (
            func.unnest(
                cast(list(watermarks), ARRAY(Integer)),
                cast(list(watermarks.values()), ARRAY(DateTime(timezone=True))),
            )
            .table_valued("partition", "mark")
            .render_derived()
        )
        due_query = (
            due_query.join(samples, samples.c.id == rewards.c.sample_id)
            .outerjoin(marks, marks.c.partition == samples.c.kafka_partition)
            .where(
                or_(
                    rewards.c.due_at <= marks.c.mark,
                    # Stored before samples recorded their partition: due by the clock.
                    and_(samples.c.kafka_partition.is_(None), rewards.c.due_at <= now),
                )
            )
        )
        stuck_query = (
            stuck_query.join(samples, samples.c.id == rewards.c.sample_id)
            .outerjoin(marks, marks.c.partition == samples.c.kafka_partition)
            .where(
                or_(
                    rewards.c.served_at + open_limit <= marks.c.mark,
                    and_(
                        samples.c.kafka_partition.is_(None),
                        rewards.c.served_at <= now - open_limit,
                    ),
                )
            )
        )
    due = [*conn.execute(due_query).scalars()]
    due += [sample_id for sample_id in conn.execute(stuck_query).scalars() if sample_id not in due]
    if not due:
        return 0
    swept = load_open_samples(conn, sample_ids=due)
    refresh_rewards(conn, swept, config, now=now, sweeping=True)
    credit_runs(conn, {s.trajectory_id for s in swept if s.trajectory_id}, config.reward_version)
    return len(due)


def _open_rewards(limit: int) -> Select[tuple[int]]:
    """Up to `limit` open rewards' sample ids, locked; rows another sweeper holds are skipped."""
    return (
        select(rewards.c.sample_id)
        .where(rewards.c.finalized_at.is_(None))
        .limit(limit)
        .with_for_update(of=rewards, skip_locked=True)
    )


def finalize_due_rewards(
    bind: Engine | Connection,
    config: WorkerConfig,
    *,
    now: datetime | None = None,
    watermarks: Mapping[int, datetime] | None = None,
) -> int:
    """Finalize every open reward that is due (see `finalize_due`); several workers may run
    it at once. With an engine each chunk commits on its own; with a connection, all in its
    transaction.
    """
    total = 0
    while True:
        with _transaction(bind) as conn:
            swept = finalize_due(conn, config, now=now or datetime.now(UTC), watermarks=watermarks)
        total += swept
        if swept < SWEEP_CHUNK:
            return total


def recompute_rewards(bind: Engine | Connection, version: int) -> int:
    """Replay formula `version` over the stored components of every finalized reward.

    All or nothing, in one transaction; an unknown version fails before anything changes.
    """
    reward_weights(version)
    recomputed = 0
    last_id = -1
    with _transaction(bind) as conn:
        while True:
            chunk = conn.execute(
                select(rewards.c.sample_id, rewards.c.components)
                .where(rewards.c.finalized_at.is_not(None), rewards.c.sample_id > last_id)
                .order_by(rewards.c.sample_id)
                .limit(RECOMPUTE_CHUNK)
                .with_for_update()
            ).all()
            if not chunk:
                return recomputed
            values = [
                compute_reward(RewardComponents.model_validate(row.components), version)
                for row in chunk
            ]
            conn.execute(
                _SET_REWARDS,
                {"version": version, "sample_ids": [r.sample_id for r in chunk], "rewards": values},
            )
            recomputed += len(chunk)
            last_id = chunk[-1].sample_id
            credit_runs(conn, _runs_of(conn, [r.sample_id for r in chunk]), version)


def _runs_of(conn: Connection, sample_ids: list[int]) -> set[str]:
    """The agent runs these samples belong to."""
    found = conn.execute(
        select(samples.c.trajectory_id).where(
            samples.c.id.in_(sample_ids), samples.c.trajectory_id.is_not(None)
        )
    ).scalars()
    return set(found)


@contextmanager
def _transaction(bind: Engine | Connection) -> Iterator[Connection]:
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            yield conn
    else:
        with bind.begin_nested():
            yield bind


def overdue_seconds(
    engine: Engine, now: datetime, *, open_limit: timedelta = REWARD_OPEN_LIMIT
) -> float:
    """How long past its due time the oldest open reward is; 0 when none is overdue.

    A reward is due by `open_limit` after its completion was served, whatever its `due_at`
    says: workers set none later, and one stored with a due time in the far future (beyond
    `now + open_limit`) counts by its age, so it cannot hide from the alert.
    """
    with engine.connect() as conn:
        earliest_due = conn.scalar(
            select(func.min(rewards.c.due_at)).where(rewards.c.finalized_at.is_(None))
        )
        stuck_since = conn.scalar(
            select(func.min(rewards.c.served_at)).where(
                rewards.c.finalized_at.is_(None), rewards.c.due_at > now + open_limit
            )
        )
    due = [moment for moment in (earliest_due, stuck_since and stuck_since + open_limit) if moment]
    return max(0.0, (now - min(due)).total_seconds()) if due else 0.0
