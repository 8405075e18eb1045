"""A candidate's A/B predicted before its canary, from production's logged samples.

The slice: production's samples of the `percent` of traffic (by sample id) that no cycle
trains on, served since production was published, in the cohort whose rewards are all final
(`trainer.data.cohort_end`: chosen by serve time, never by when the outcome was known), with
the tokens and the temperature they were sampled at. The trainer re-scores each completion with
production first: the log-ratios against the logprobs vLLM logged must be near 0 (the identity
check), or no estimate is trusted. The candidate is then scored at the same temperature, and
each metric's candidate-minus-production difference is estimated by `trainer.ope`, per
traffic kind (one-turn chat, agent turn) and over all, in the A/B's own units.

What this cannot see: a turn is weighted as if it were a one-step choice, so a candidate that
changes what later turns of a run would have been is credited with the logged later turns; and
nothing about users' reaction to answers production never gave is observed. It is a screen in
front of the canary, never a replacement for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import torch
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from app.db import session_scope
from app.models import Checkpoint, Reward, Sample
from app.serving.parity import completion_logprobs
from trainer.config import TrainConfig
from trainer.data import cohort_end, production_samples, withheld
from trainer.ope import normalized_weights, predict_ratio, sequence_log_weights

PREDICTED_METRICS = ("mean_reward", "kept", "malformed_call_rate", "dissatisfied_rate")
"""The A/B's metrics (`app.abtest.repository.RATIOS`) a prediction estimates, same names."""
IDENTITY_TOLERANCE = 0.05
"""Mean |Σ log π_production − log π_logged| per completion above which the logs and the
trainer disagree about what was sampled: every estimate is then unreliable."""


@dataclass(frozen=True)
class LoggedOutcome:
    """One completion of the slice: what was sampled, and what each metric counted of it."""

    sample_id: int
    user_hash: str
    agent_turn: bool
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behaviour_logprobs: list[float]
    temperature: float
    values: dict[str, tuple[float, float]]
    """Per metric, this completion's (numerator, denominator): (0, 0) where it does not count."""


def metric_values(
    reward: float | None, components: dict[str, Any], tool_calls: int, malformed: int
) -> dict[str, tuple[float, float]]:
    """One completion's share of each ratio metric, as the A/B's rollups count it."""
    kept = components.get("kept")
    dissatisfied = components.get("dissatisfied")
    return {
        "mean_reward": (reward, 1.0) if reward is not None else (0.0, 0.0),
        "kept": (float(kept), 1.0) if kept is not None else (0.0, 0.0),
        "malformed_call_rate": (float(malformed > 0), 1.0) if tool_calls > 0 else (0.0, 0.0),
        "dissatisfied_rate": (
            (float(bool(dissatisfied)), 1.0) if dissatisfied is not None else (0.0, 0.0)
        ),
    }


def prediction_slice(
    session: Session, production: Checkpoint, *, percent: int, limit: int
) -> list[LoggedOutcome]:
    """The newest completions of the slice no cycle trains on (see the module's docstring)."""
    since = production.published_at or production.created_at
    end = cohort_end(session, production.name, since)
    rows = session.execute(
        select(
            Sample.id,
            Sample.user_hash,
            Sample.tools_declared,
            Sample.turn_index,
            Sample.prompt_token_ids,
            Sample.completion_token_ids,
            Sample.behaviour_logprobs,
            Sample.temperature,
            Sample.tool_calls,
            Sample.malformed_tool_calls,
            Reward.reward,
            Reward.components,
        )
        .join(Reward, Reward.sample_id == Sample.id)
        .where(
            production_samples(production, since, end),
            Sample.temperature > 0,  # a greedy answer has no probability to weigh
            withheld(percent),
        )
        .order_by(Sample.served_at.desc(), Sample.id.desc())
        .limit(limit)
    ).all()
    return [
        LoggedOutcome(
            sample_id=row.id,
            user_hash=row.user_hash,
            agent_turn=bool(row.tools_declared) or row.turn_index > 0,
            prompt_token_ids=list(row.prompt_token_ids),
            completion_token_ids=list(row.completion_token_ids),
            behaviour_logprobs=list(row.behaviour_logprobs),
            temperature=row.temperature,
            values=metric_values(
                row.reward, row.components or {}, row.tool_calls, row.malformed_tool_calls
            ),
        )
        for row in rows
        if len(row.completion_token_ids) == len(row.behaviour_logprobs)
    ]


def score(
    model: torch.nn.Module, outcomes: Sequence[LoggedOutcome], max_batch_tokens: int
) -> list[list[float]]:
    """`model`'s logprobs of every logged completion, at the temperature it was sampled at."""
    model.eval()
    return completion_logprobs(
        model,
        [o.prompt_token_ids for o in outcomes],
        [o.completion_token_ids for o in outcomes],
        temperatures=[o.temperature for o in outcomes],
        max_batch_tokens=max_batch_tokens,
    )


def predict(
    outcomes: Sequence[LoggedOutcome],
    production_logprobs: Sequence[Sequence[float]],
    candidate_logprobs: Sequence[Sequence[float]],
    *,
    window: tuple[datetime | None, datetime | None] = (None, None),
    seed: int = 0,
) -> dict[str, Any]:
    """Each metric's predicted difference per traffic kind, with its diagnostics (JSON).

    The weight's denominator is production as the trainer scores it, so both sides of the
    ratio come from one engine; the identity check first bounds how far that is from what
    vLLM logged."""
    behaviour = [o.behaviour_logprobs for o in outcomes]
    identity = np.abs(sequence_log_weights(production_logprobs, behaviour))
    mean_identity = float(identity.mean()) if identity.size else 0.0
    unreliable = []
    if mean_identity > IDENTITY_TOLERANCE:
        unreliable.append(
            f"re-scoring production gives mean |log-ratio| {mean_identity:.3f} per completion "
            f"against the logged logprobs (> {IDENTITY_TOLERANCE}): the logs do not say what "
            "was sampled"
        )
    log_weights = sequence_log_weights(candidate_logprobs, production_logprobs)
    kinds: dict[str, Callable[[LoggedOutcome], bool]] = {
        "all": lambda o: True,
        "one_turn": lambda o: not o.agent_turn,
        "agent_turn": lambda o: o.agent_turn,
    }
    estimates: dict[str, dict[str, Any]] = {}
    for kind, member in kinds.items():
        chosen = [i for i, o in enumerate(outcomes) if member(o)]
        if not chosen:
            continue
        weights = normalized_weights(log_weights[chosen])
        users = [outcomes[i].user_hash for i in chosen]
        estimates[kind] = {}
        for metric in PREDICTED_METRICS:
            values = np.array([outcomes[i].values[metric] for i in chosen], dtype=np.float64)
            estimate = predict_ratio(values[:, 0], values[:, 1], weights, users, seed=seed)
            if estimate is None:
                continue
            entry = estimate.as_dict()
            entry["diagnostics"]["unreliable"] = unreliable + entry["diagnostics"]["unreliable"]
            entry["reliable"] = not entry["diagnostics"]["unreliable"]
            estimates[kind][metric] = entry
    return finite(
        {
            "method": "snips, users resampled",
            "samples": len(outcomes),
            "users": len({o.user_hash for o in outcomes}),
            "window": [moment.isoformat() if moment else None for moment in window],
            "identity": {
                "mean_abs_log_ratio": mean_identity,
                "max_abs_log_ratio": float(identity.max()) if identity.size else 0.0,
                "passed": not unreliable,
            },
            "mean_abs_log_weight": float(np.abs(log_weights).mean()) if log_weights.size else 0.0,
            "kinds": estimates,
        }
    )


def finite(value: Any) -> Any:
    """JSON as Postgres stores it: a NaN or an infinity (nothing to measure) becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return value


def hold_reason(prediction: dict[str, Any], margin: float) -> str | None:
    """Why a candidate is held before its canary: its mean reward predicted, reliably, below
    production's by more than `margin` (the whole interval below −margin); None otherwise."""
    estimate = prediction.get("kinds", {}).get("all", {}).get("mean_reward")
    if not estimate or not estimate.get("reliable") or estimate.get("ci_high") is None:
        return None
    if estimate["ci_high"] >= -margin:
        return None
    return (
        f"predicted mean reward {estimate['difference']:+.3f} "
        f"[{estimate['ci_low']:+.3f}, {estimate['ci_high']:+.3f}] below production by more "
        f"than {margin} on {estimate['observations']} logged completions of "
        f"{estimate['users']} users (effective {estimate['diagnostics']['effective_samples']:.0f})"
    )


@dataclass
class LoggedSlice:
    """Production's logged completions a prediction is made on, and production's scores of
    them, taken before the update changes the policy (rank 0 only)."""

    outcomes: list[LoggedOutcome]
    production_logprobs: list[list[float]] = field(default_factory=list)

    @classmethod
    def select(cls, engine: Engine, config: TrainConfig, production_id: int) -> LoggedSlice:
        if not config.prediction_percent:
            return cls([])
        with session_scope(engine) as session:
            production = session.get_one(Checkpoint, production_id)
            return cls(
                prediction_slice(
                    session,
                    production,
                    percent=config.prediction_percent,
                    limit=config.prediction_samples,
                )
            )

    def score_production(self, policy: torch.nn.Module, config: TrainConfig) -> None:
        self.production_logprobs = score(policy, self.outcomes, config.micro_batch_tokens)

    def predict(
        self,
        policy: torch.nn.Module,
        config: TrainConfig,
        window: tuple[datetime | None, datetime | None],
    ) -> dict[str, Any] | None:
        """The candidate's predicted A/B; None with nothing logged to predict it on."""
        if not self.outcomes:
            return None
        candidate = score(policy, self.outcomes, config.micro_batch_tokens)
        return predict(
            self.outcomes, self.production_logprobs, candidate, window=window, seed=config.seed
        )


def prediction_summary(prediction: dict[str, Any]) -> str:
    """One line: the predicted mean-reward difference over all traffic and how far to trust it."""
    estimate = prediction["kinds"].get("all", {}).get("mean_reward")
    if estimate is None:
        return f"predicted A/B: no final rewards among {prediction['samples']} logged completions"
    interval = (
        f" [{estimate['ci_low']:+.3f}, {estimate['ci_high']:+.3f}]"
        if estimate["ci_low"] is not None
        else ""
    )
    trust = (
        "reliable"
        if estimate["reliable"]
        else "unreliable: " + "; ".join(estimate["diagnostics"]["unreliable"])
    )
    return (
        f"predicted mean reward vs production {estimate['difference']:+.3f}{interval} on "
        f"{estimate['observations']} logged completions ({trust})"
    )
