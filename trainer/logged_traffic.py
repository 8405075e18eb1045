"""The evaluation gate on production's logged held-out traffic: for any model and any
deployment, with nothing to generate and no tests to run.

A slice of traffic (`withheld_percent` of samples, by id) is never trained on. From it, the
most recent completions whose edit was kept (kept share ≥ 0.5 at the horizon) and those
that were not (kept share 0: rejected, reverted, or no edit where one was asked for) are the
held-out cases. A policy scores each completion by its mean per-token logprob; it passes a
(kept, not kept) pair when it scores the kept one higher, and its pass rate is the share of
all such pairs it passes (the AUC of its scores). A candidate that came to prefer what users
threw away, relative to production, falls below production's rate and is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sqlalchemy import Engine, Float, cast, func, select
from transformers import PreTrainedTokenizerFast

from app.db import session_scope
from app.models import Reward, Sample
from app.serving.parity import CompletionBatch, completion_batch, completion_logprobs
from trainer.data import not_erased, withheld
from trainer.evaluate import HeldOutUnavailable, Reference

REFERENCE_TOKENS = 64
"""Completion tokens of each kept case the KL to production is measured on."""


@dataclass(frozen=True)
class LoggedCompletion:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    tools_declared: bool = False


def held_out_completions(
    engine: Engine, percent: int, limit: int, *, kept: bool
) -> list[LoggedCompletion]:
    """The most recent withheld completions with a known outcome: kept, or not kept."""
    kept_share = cast(Reward.components["kept"].astext, Float)
    with session_scope(engine) as session:
        rows = session.execute(
            select(Sample.prompt_token_ids, Sample.completion_token_ids, Sample.tools_declared)
            .join(Reward, Reward.sample_id == Sample.id)
            .where(
                withheld(percent),
                not_erased(),
                Sample.trainable.is_(True),
                Sample.privacy.is_(False),
                Sample.status == "ok",
                Reward.finalized_at.is_not(None),
                Reward.reward.is_not(None),
                kept_share >= 0.5 if kept else kept_share == 0,
                func.cardinality(Sample.completion_token_ids) > 0,
                func.cardinality(Sample.prompt_token_ids) > 0,
            )
            .order_by(Sample.served_at.desc())
            .limit(limit)
        ).all()
    return [LoggedCompletion(list(row[0] or []), list(row[1] or []), row[2]) for row in rows]


def reference_of(cases: list[LoggedCompletion]) -> CompletionBatch:
    """The cases' prompts and the first `REFERENCE_TOKENS` tokens of their completions."""
    return completion_batch(
        [case.prompt_token_ids for case in cases],
        [case.completion_token_ids[:REFERENCE_TOKENS] for case in cases],
    )


def pairs_passed(kept: torch.Tensor, rejected: torch.Tensor) -> float:
    """Share of (kept, rejected) pairs whose kept score is higher; ties count half."""
    difference = kept[:, None] - rejected[None, :]
    return float(((difference > 0).double() + 0.5 * (difference == 0).double()).mean())


@dataclass
class LoggedTrafficHeldOut:
    """Production's withheld traffic, kept against not kept (see the module's docstring)."""

    engine: Engine
    percent: int
    """Percent of traffic, by sample id, that is never trained on and is scored here."""
    cases: int
    """Most recent kept and not-kept completions each."""
    min_cases: int = 8
    """Fewer of either: the gate cannot judge, and the cycle is skipped."""
    max_batch_tokens: int = 8192
    """Padded tokens per forward pass when scoring."""

    def __post_init__(self) -> None:
        self._kept: list[LoggedCompletion] = []
        self._rejected: list[LoggedCompletion] = []

    @property
    def name(self) -> str:
        return "logged_traffic"

    @property
    def withheld_percent(self) -> int:
        return self.percent

    def reference(self, tokenizer: PreTrainedTokenizerFast) -> Reference:
        self._kept = held_out_completions(self.engine, self.percent, self.cases, kept=True)
        self._rejected = held_out_completions(self.engine, self.percent, self.cases, kept=False)
        if min(len(self._kept), len(self._rejected)) < self.min_cases:
            raise HeldOutUnavailable(
                f"logged-traffic gate: {len(self._kept)} kept and {len(self._rejected)} not kept "
                f"held-out completions (the {self.percent}% of traffic never trained on), "
                f"fewer than {self.min_cases} of each"
            )
        agent_turns = [case for case in self._kept if case.tools_declared]
        return Reference(
            answers=reference_of(self._kept),
            agent_turns=reference_of(agent_turns) if agent_turns else None,
        )

    def pass_rate(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> float:
        model.eval()
        return pairs_passed(self.scores(model, self._kept), self.scores(model, self._rejected))

    def scores(self, model: torch.nn.Module, cases: list[LoggedCompletion]) -> torch.Tensor:
        """Each completion's mean per-token logprob under `model`."""
        logprobs = completion_logprobs(
            model,
            [case.prompt_token_ids for case in cases],
            [case.completion_token_ids for case in cases],
            max_batch_tokens=self.max_batch_tokens,
        )
        return torch.tensor([sum(row) / len(row) for row in logprobs], dtype=torch.float64)
