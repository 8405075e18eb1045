"""Data selection: the production checkpoint's own finalized, trainable samples."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    DateTime,
    Row,
    Select,
    and_,
    bindparam,
    exists,
    func,
    or_,
    select,
    text,
    true,
)
from sqlalchemy.orm import Session, aliased

from app.models import Checkpoint, ErasedUser, Reward, Sample
from app.signals.rewards import REWARD_OPEN_LIMIT
from trainer.config import TrainConfig

MAX_SOURCE_SHARE: float = TrainConfig.model_fields["max_source_share"].default


@dataclass(frozen=True)
class TrainingSample:
    sample_id: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    served_at: datetime
    temperature: float = 1.0
    """vLLM sampled at this temperature and logged the logprobs of that distribution."""
    tools_declared: bool = False
    """The request declared tools: agent traffic, not one-turn chat."""
    turn_index: int = 0
    """The turn of its run (0: the run's first request)."""
    edit_requested: bool = False
    """The run asked for an edit (its first turn decides)."""
    trajectory_id: str | None = None
    """The run it belongs to; None: a request alone."""


@dataclass(frozen=True)
class OnPolicyBatch:
    checkpoint: str
    samples: list[TrainingSample]
    window_start: datetime | None
    window_end: datetime | None

    def served_after(self, moment: datetime) -> int:
        """How many of the samples were served after `moment`."""
        return sum(sample.served_at > moment for sample in self.samples)


def withheld(percent: int) -> ColumnElement[bool]:
    """The slice of traffic an evaluation gate keeps for itself: `percent` of samples by id."""
    return Sample.id % 100 < percent


def not_erased() -> ColumnElement[bool]:
    """Not served to a user before their erasure. Erasure deletes those rows; this also
    covers one a racing writer stored."""
    return ~exists().where(
        ErasedUser.user_hash == Sample.user_hash, Sample.served_at <= ErasedUser.erased_at
    )


_STILL_STORED = text(
    "SELECT count(*) FROM unnest(:ids, :served) AS b(id, served_at) "
    "WHERE EXISTS (SELECT FROM samples s WHERE s.id = b.id AND s.served_at = b.served_at)"
).bindparams(
    bindparam("ids", type_=ARRAY(BigInteger)),
    bindparam("served", type_=ARRAY(DateTime(timezone=True))),
)


def erased_since_selected(session: Session, samples: list[TrainingSample]) -> int:
    """How many of a batch's samples were erased (deleted) since the batch was selected."""
    if not samples:
        return 0
    stored = session.execute(
        _STILL_STORED,
        {"ids": [s.sample_id for s in samples], "served": [s.served_at for s in samples]},
    ).scalar_one()
    return len(samples) - int(stored)


def cohort_end(
    session: Session,
    checkpoint: str,
    since: datetime,
    *,
    open_limit: timedelta = REWARD_OPEN_LIMIT,
) -> datetime | None:
    """Where the cohort of `checkpoint`'s runs whose every reward is final ends: the serve
    time of the first turn of the earliest run with a reward still open (None: none is open).

    Rewards are final at different times by outcome (a rejection at the session's end, a
    kept edit only at the survival horizon), and a run's earlier turns are credited again
    when its edit's fate is known: the newest finalized samples are mostly rejections and
    interim credit. Samples served before this moment are a cohort chosen by serve time alone.

    A reward due later than `open_limit` after its completion (`reward_open_limit`: no
    worker sets such a due time, and the sweep finalizes it at that bound) does not hold the
    cohort back: one acceptance dated decades ahead would otherwise end every cohort there.
    """
    opened = (
        select(Sample.served_at, Sample.trajectory_id)
        .join(Reward, Reward.sample_id == Sample.id)
        .where(
            Sample.checkpoint == checkpoint,
            Sample.served_at >= since,
            Reward.served_at >= since,  # the same day partitions as the samples
            Reward.finalized_at.is_(None),
            Reward.due_at <= Reward.served_at + open_limit,
        )
        .subquery()
    )
    turns = aliased(Sample)
    run_start = (
        select(func.min(turns.served_at))
        .where(
            turns.trajectory_id == opened.c.trajectory_id,
            turns.checkpoint == checkpoint,
            turns.served_at >= since,
        )
        .scalar_subquery()
    )
    return session.scalar(
        select(func.min(func.coalesce(run_start, opened.c.served_at))).select_from(opened)
    )


def production_samples(
    production: Checkpoint, since: datetime, end: datetime | None
) -> ColumnElement[bool]:
    """Which samples a cycle may learn from, for a query that joins each to its reward: those
    `production` served in its cohort (from `since` to `end`, `cohort_end`) with a final
    reward, trainable, not in privacy mode, served to the end (`ok`), with logged tokens,
    and of no erased user."""
    return and_(
        Sample.checkpoint == production.name,
        Sample.served_at >= since,
        true() if end is None else Sample.served_at < end,
        Sample.trainable.is_(True),
        Sample.privacy.is_(False),
        Sample.status == "ok",
        Reward.served_at >= since,  # the same day partitions as the samples
        Reward.finalized_at.is_not(None),
        func.cardinality(Sample.completion_token_ids) > 0,
        func.cardinality(Sample.prompt_token_ids) > 0,
        not_erased(),
    )


def source_cap(max_samples: int, max_share: float) -> int | None:
    """Most samples one API key, or one user, may give a batch of `max_samples`; None: no cap."""
    if max_share >= 1:
        return None
    return max(1, math.floor(max_share * max_samples))


_BATCH_COLUMNS = (
    Sample.id,
    Sample.prompt_token_ids,
    Sample.completion_token_ids,
    Sample.behaviour_logprobs,
    Reward.reward,
    Sample.served_at,
    Sample.temperature,
    Sample.tools_declared,
    Sample.turn_index,
    Sample.edit_requested,
    Sample.trajectory_id,
)
_NEWEST_FIRST = (Sample.served_at.desc(), Sample.id.desc())  # one order: a seed repeats a run


def _newest_within_source_caps(
    eligible: Select[*tuple[Any, ...]], max_samples: int, cap: int | None
) -> Select[*tuple[Any, ...]]:
    """The newest `max_samples` of `eligible`, each among its key's and its user's newest
    `cap` (none with no cap)."""
    if cap is None:
        return eligible.order_by(*_NEWEST_FIRST).limit(max_samples)
    ranked = eligible.add_columns(
        Sample.api_key_id,
        func.row_number()
        .over(partition_by=Sample.api_key_id, order_by=_NEWEST_FIRST)
        .label("nth_of_key"),
        func.row_number()
        .over(partition_by=Sample.user_hash, order_by=_NEWEST_FIRST)
        .label("nth_of_user"),
    ).subquery()
    return (
        select(*(ranked.c[column.key] for column in _BATCH_COLUMNS))
        .where(
            # Samples logged before keys were recorded share no key.
            or_(ranked.c.api_key_id.is_(None), ranked.c.nth_of_key <= cap),
            ranked.c.nth_of_user <= cap,
        )
        .order_by(ranked.c.served_at.desc(), ranked.c.id.desc())
        .limit(max_samples)
    )


def _training_sample(row: Row[*tuple[Any, ...]]) -> TrainingSample:
    return TrainingSample(
        sample_id=row.id,
        prompt_token_ids=list(row.prompt_token_ids),
        completion_token_ids=list(row.completion_token_ids),
        behaviour_logprobs=list(row.behaviour_logprobs),
        reward=float(row.reward),
        served_at=row.served_at,
        temperature=row.temperature,
        tools_declared=row.tools_declared,
        turn_index=row.turn_index,
        edit_requested=row.edit_requested,
        trajectory_id=row.trajectory_id,
    )


def select_on_policy_batch(
    session: Session,
    production: Checkpoint,
    *,
    max_samples: int,
    withheld_percent: int = 0,
    max_share: float = MAX_SOURCE_SHARE,
    open_limit: timedelta = REWARD_OPEN_LIMIT,
) -> OnPolicyBatch:
    """The newest samples of the cohort the production checkpoint served whose rewards are
    all final (`cohort_end`): chosen by serve time, never by when their outcome was known.

    Only samples that checkpoint generated are on-policy for it; privacy-mode and
    untrainable samples, those without logged tokens, the slice the evaluation gate holds
    out (`withheld_percent`) and erased users' samples are never trained on. No API key and
    no user gives more than `max_share` of `max_samples` (`source_cap`): a sample is taken
    only while it is among its key's newest and its user's newest that many, so one key
    sending at its rate limit before a cycle cannot make the cycle its own.
    """
    since = production.published_at or production.created_at
    end = cohort_end(session, production.name, since, open_limit=open_limit)
    eligible = (
        select(*_BATCH_COLUMNS)
        .join(Reward, Reward.sample_id == Sample.id)
        .where(
            production_samples(production, since, end),
            Reward.reward.is_not(None),
            ~withheld(withheld_percent),
        )
    )
    query = _newest_within_source_caps(eligible, max_samples, source_cap(max_samples, max_share))
    rows = session.execute(query).all()
    samples = [
        _training_sample(row)
        for row in rows
        if len(row.completion_token_ids) == len(row.behaviour_logprobs)
    ]
    served = [row.served_at for row in rows]
    return OnPolicyBatch(
        checkpoint=production.name,
        samples=samples,
        window_start=min(served) if served else None,
        window_end=max(served) if served else None,
    )
