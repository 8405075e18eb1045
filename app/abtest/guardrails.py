"""Guardrails: roll back a canary that is significantly worse than control, checked at will
(`POST /admin/guardrails/check`) and, with `RTRL_GUARDRAIL_INTERVAL` set, by every worker.

A fixed-horizon test looked at again and again raises false alarms (peeking), so each
guardrail uses the mixture sequential probability ratio test (mSPRT) with a normal mixing
distribution N(0, tau^2) over the difference theta = canary - control. With the estimate
theta_hat and its variance V,

    Lambda = sqrt(V / (V + tau^2)) * exp(tau^2 * theta_hat^2 / (2 V (V + tau^2)))

is a nonnegative martingale under theta = 0, so by Ville's inequality P(Lambda ever reaches
1/alpha) <= alpha: rejecting when Lambda >= 1/alpha stays valid however often it is checked.
Inverting it gives the always-valid confidence sequence
theta_hat +- sqrt(V (V + tau^2) / tau^2 * (2 log(1/alpha) + log((V + tau^2) / V))).
Reference: Johari, Koomen, Pekelis & Walsh, "Always Valid Inference: Continuous Monitoring
of A/B Tests", Operations Research 70(3), 2022 (normal-mixture mSPRT, difference of means
under the CLT). The unit is the user, as in the results: each guardrail is a ratio metric
over users, and V is the delta-method variance of the difference (`app.abtest.stats`), not
a binomial variance over requests, which would treat one user's many requests as
independent and raise false alarms. No maintained Python library implements the mSPRT for
summary statistics, hence these few lines. A canary is rolled back when the sequence lies
wholly on the harmful side for any guardrail; alpha is split evenly across the guardrails
(Bonferroni).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from prometheus_client import Counter
from pydantic import BaseModel
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from app.abtest.repository import ArmSummary, arm_reads, arm_summaries_sync
from app.abtest.rollups import refresh_rollups
from app.abtest.stats import ratio_estimate
from app.models import Arm, Checkpoint, CheckpointStatus, Experiment, ExperimentStatus
from app.registry.audit import Actor
from app.registry.checkpoints import rollback_canary
from app.registry.routing import lock_routing, notify_routing_changed_sync

log = logging.getLogger(__name__)

GUARDRAILS_ACTOR = Actor("guardrails")
FAMILY_ALPHA = 0.05
CANARY_ROLLBACKS = Counter(
    "rtrl_guardrail_rollbacks_total", "Canaries the guardrails rolled back (once committed)."
)


@dataclass(frozen=True)
class Guardrail:
    """One metric, which way it is worse, and the effect size its test is tuned to."""

    metric: str
    tau: float
    """Standard deviation of the mixing distribution: the size of harm worth detecting."""
    lower_is_worse: bool = False
    """The edit rate: a policy that learns to stop proposing edits (to ask instead) games a
    reward for kept edits while the kept share of what it does propose looks fine."""
    min_observations: int = 100
    min_users: int = 20


GUARDRAILS = (
    Guardrail("dissatisfied_rate", tau=0.02),
    Guardrail("latency_mean_ms", tau=100.0),
    Guardrail("malformed_call_rate", tau=0.01),
    Guardrail("error_rate", tau=0.01),
    Guardrail("edit_rate", tau=0.05, lower_is_worse=True),
)


class GuardrailDecision(BaseModel):
    experiment_id: int
    arm: str
    checkpoint: str
    metric: str
    canary_value: float | None
    control_value: float | None
    canary_observations: int
    control_observations: int
    canary_users: int
    control_users: int
    difference: float | None
    ci_low: float | None
    """Always-valid confidence sequence of the difference at 1 - alpha."""
    ci_high: float | None
    alpha: float
    harmful: bool
    rolled_back: bool = False


@dataclass(frozen=True)
class Estimate:
    value: float | None
    variance: float | None
    """Variance of the estimate over users (not of the observations)."""
    observations: int
    users: int


def estimate(summary: ArmSummary, guardrail: Guardrail) -> Estimate:
    """A guardrail metric of one arm and the delta-method variance of its estimate."""
    numerator, denominator = summary.ratio(guardrail.metric)
    value = numerator / denominator if denominator else None
    ratio = ratio_estimate(summary.moments, guardrail.metric)
    variance = float(ratio.covariance[0, 0]) if ratio is not None else None
    return Estimate(value, variance, int(denominator), summary.users)


def confidence_sequence(
    difference: float, variance: float, tau: float, alpha: float
) -> tuple[float, float]:
    """The mSPRT's always-valid (1 - alpha) interval for the difference."""
    radius = math.sqrt(
        variance
        * (variance + tau**2)
        / tau**2
        * (2 * math.log(1 / alpha) + math.log((variance + tau**2) / variance))
    )
    return difference - radius, difference + radius


def decide(
    canary: ArmSummary, control: ArmSummary, guardrail: Guardrail, alpha: float
) -> tuple[Estimate, Estimate, float | None, tuple[float, float] | None, bool]:
    """(canary, control, difference, interval, harmful) for one guardrail."""
    treated, baseline = estimate(canary, guardrail), estimate(control, guardrail)
    if treated.value is None or baseline.value is None:
        return treated, baseline, None, None, False
    difference = treated.value - baseline.value
    enough = (
        min(treated.observations, baseline.observations) >= guardrail.min_observations
        and min(treated.users, baseline.users) >= guardrail.min_users
    )
    variance = (treated.variance or 0.0) + (baseline.variance or 0.0)
    if not enough or variance <= 0:
        return treated, baseline, difference, None, False
    interval = confidence_sequence(difference, variance, guardrail.tau, alpha)
    harmful = interval[1] < 0 if guardrail.lower_is_worse else interval[0] > 0
    return treated, baseline, difference, interval, harmful


def check_guardrails_in(session: Session, *, rollback: bool = False) -> list[GuardrailDecision]:
    """Test every running canary against its control; roll back the harmful ones if asked.

    Runs in the caller's transaction (the rollbacks and their audit entries included); the
    caller commits and announces the routing change. Rolling back takes the routing lock
    first, so checks by several workers and ops run one after another on fresh state.
    """
    if rollback:
        lock_routing(session)
    refresh_rollups(session.connection())
    alpha = FAMILY_ALPHA / len(GUARDRAILS)
    arms = session.execute(
        select(Experiment.id, Arm.name, Arm.is_control, Checkpoint.name, Checkpoint.status)
        .join(Arm, Arm.experiment_id == Experiment.id)
        .join(Checkpoint, Checkpoint.id == Arm.checkpoint_id)
        .where(Experiment.status == ExperimentStatus.running)
        .order_by(Experiment.id, Arm.id)
    ).all()
    decisions: list[GuardrailDecision] = []
    for experiment_id in sorted({row[0] for row in arms}):
        rows = [row for row in arms if row[0] == experiment_id]
        control_arm = next((row[1] for row in rows if row[2]), None)
        canaries = [
            (row[1], row[3]) for row in rows if not row[2] and row[4] == CheckpointStatus.canary
        ]
        if control_arm is None or not canaries:
            continue
        reads = arm_reads(experiment_id, None, None)
        summaries = {s.arm: s for s in arm_summaries_sync(session, reads)}
        control = summaries.get(control_arm)
        for arm, checkpoint in canaries:
            canary = summaries.get(arm)
            if canary is None or control is None:
                continue
            verdicts = [
                _decision(experiment_id, arm, checkpoint, guardrail, alpha, canary, control)
                for guardrail in GUARDRAILS
            ]
            harmful = [d.metric for d in verdicts if d.harmful]
            if rollback and harmful:
                rollback_canary(
                    session,
                    checkpoint,
                    GUARDRAILS_ACTOR,
                    reason=f"guardrails: {', '.join(harmful)} significantly worse than control",
                )
                log.warning("guardrails rolled back %s: %s", checkpoint, ", ".join(harmful))
                verdicts = [d.model_copy(update={"rolled_back": True}) for d in verdicts]
            decisions += verdicts
    return decisions


def _decision(
    experiment_id: int,
    arm: str,
    checkpoint: str,
    guardrail: Guardrail,
    alpha: float,
    canary: ArmSummary,
    control: ArmSummary,
) -> GuardrailDecision:
    treated, baseline, difference, interval, harmful = decide(canary, control, guardrail, alpha)
    return GuardrailDecision(
        experiment_id=experiment_id,
        arm=arm,
        checkpoint=checkpoint,
        metric=guardrail.metric,
        canary_value=treated.value,
        control_value=baseline.value,
        canary_observations=treated.observations,
        control_observations=baseline.observations,
        canary_users=treated.users,
        control_users=baseline.users,
        difference=difference,
        ci_low=interval[0] if interval else None,
        ci_high=interval[1] if interval else None,
        alpha=alpha,
        harmful=harmful,
    )


def check_guardrails(
    engine: Engine, *, rollback: bool = True, redis_url: str | None = None
) -> list[GuardrailDecision]:
    """Check every running canary; roll back the harmful ones (audited as "guardrails").

    The workers call it every `RTRL_GUARDRAIL_INTERVAL`. With `redis_url`, gateways are
    told at once; otherwise they pick the change up on their refresh timer.
    """
    with Session(engine, expire_on_commit=False) as session, session.begin():
        decisions = check_guardrails_in(session, rollback=rollback)
    CANARY_ROLLBACKS.inc(len({(d.experiment_id, d.arm) for d in decisions if d.rolled_back}))
    if redis_url and any(decision.rolled_back for decision in decisions):
        notify_routing_changed_sync(redis_url)
    return decisions
