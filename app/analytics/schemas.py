"""What analysts read: per-arm results with comparisons to control, trends, alerts, lineage."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, model_validator

from app.abtest.repository import Bucket

MetricKind = Literal["proportion", "mean", "percentile"]
CHECKPOINT_NAME = r"^[A-Za-z0-9._-]{1,64}$"
ARM_NAME = r"^[A-Za-z0-9._-]{1,64}$"


class Window(BaseModel):
    """A half-open time range [since, until); either end may be open."""

    model_config = ConfigDict(frozen=True)

    since: AwareDatetime | None = None
    until: AwareDatetime | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Window:
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError("since must be before until")
        return self


class VsControl(BaseModel):
    """Treatment minus control over users: the difference and the relative lift, each with
    its 95% interval; the p-value tests both against no difference."""

    difference: float
    relative_difference: float | None
    ci_low: float | None
    ci_high: float | None
    relative_ci_low: float | None = None
    relative_ci_high: float | None = None
    p_value: float | None
    significant: bool
    """The interval excludes 0 (p < 0.05)."""
    variance_reduction: float | None = None
    """CUPED only: the share of the unadjusted difference's variance the adjustment removed."""


class Metric(BaseModel):
    value: float | None
    observations: int
    """How many samples the value is computed over (e.g. only those that got a follow-up)."""
    vs_control: VsControl | None = None
    cuped: VsControl | None = None
    """With `?cuped=true`: the comparison adjusted for each user's pre-experiment value."""


class ArmResult(BaseModel):
    arm: str
    checkpoint: str | None
    is_control: bool
    weight_bps: int | None
    users: int
    """Users first exposed to this arm and seen in no other: the unit of analysis."""
    switched_users: int
    """Users first exposed to this arm and later seen in another: left out of the metrics."""
    requests: int
    fallback_requests: int
    """Requests of the arm that production answered because the arm's checkpoint was down."""
    metrics: dict[str, Metric]


class SampleRatioCheck(BaseModel):
    """Users per arm at first exposure against the weights then in force (chi-square over
    the ramp periods); a mismatch voids the results."""

    chi_square: float | None
    p_value: float
    mismatch: bool
    threshold: float
    expected_share: dict[str, float]
    """The current weights' shares."""
    observed_users: dict[str, int]
    """Users by their first-exposure arm, switched users included."""
    ramp_periods: int


class ArmBrief(BaseModel):
    name: str
    checkpoint: str
    weight_bps: int
    is_control: bool


class ExperimentBrief(BaseModel):
    id: int
    name: str
    route: str
    status: str
    started_at: datetime | None
    stopped_at: datetime | None
    arms: list[ArmBrief]


class ExperimentResults(BaseModel):
    experiment: ExperimentBrief
    since: datetime | None
    until: datetime | None
    confidence_level: float
    unit: Literal["user"] = "user"
    """Intervals and p-values treat users, the unit of randomization, as independent."""
    cuped: bool = False
    control_arm: str | None
    arms: list[ArmResult]
    sample_ratio: SampleRatioCheck | None
    metric_kinds: dict[str, MetricKind]


class TimeBucket(BaseModel):
    start: datetime
    requests: int
    kept: float | None
    kept_observations: int
    mean_reward: float | None
    reward_observations: int
    dissatisfied_rate: float | None
    dissatisfied_observations: int
    censored_edit_rate: float | None = None
    """Of the final rewards of answers that proposed an edit, the share whose fate was never
    seen (censored): rising, the checkpoint ends before its edits are shown their verdict."""
    edit_observations: int = 0
    """Final rewards of answers that proposed an edit: the rate's denominator."""


class CheckpointSeries(BaseModel):
    checkpoint: str
    buckets: list[TimeBucket]


class TimeSeries(BaseModel):
    bucket: Bucket
    since: datetime | None
    until: datetime | None
    series: list[CheckpointSeries]


class AlertOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    checkpoint: str
    control_checkpoint: str
    metric: str
    canary_value: float
    control_value: float
    threshold: float
    window_start: datetime
    window_end: datetime
    created_at: datetime


class LineageNode(BaseModel):
    name: str
    parent: str | None
    status: str
    published_at: datetime | None
    promoted_at: datetime | None
    retired_at: datetime | None
    superseded_by: str | None
    """The newer candidate of the same parent whose canary replaced this one."""


class TrainingRunBrief(BaseModel):
    """A training cycle: its outcome, and how far vLLM's logged logprobs were from the
    trainer's on its batch (see docs/ml-engineers/gpus.md)."""

    id: int
    run_name: str | None
    status: str
    trigger: str | None
    reason: str | None
    sample_count: int
    started_at: datetime
    finished_at: datetime | None
    base_checkpoint: str | None
    checkpoint: str | None
    """The checkpoint it published, if any."""
    dtype: str | None
    ranks: int | None
    drift_tokens: int | None
    drift_mean_abs: float | None
    """Mean |logged − recomputed| logprob per token."""
    drift_max_abs: float | None
    drift_kl: float | None
    """Mean per-token KL(vLLM ‖ trainer), k3 estimator."""
    drift_capped_share: float | None
    """Share of tokens whose truncated importance weight hit its cap."""


class PredictedMetric(BaseModel):
    """One metric of a candidate: predicted before its canary, and what its canary realized.
    Both are treatment (candidate) minus control (production), in the A/B's units."""

    metric: str
    predicted: float
    predicted_ci_low: float | None
    predicted_ci_high: float | None
    reliable: bool
    unreliable: list[str]
    """Why the prediction is not to be acted on (empty when it is)."""
    effective_samples: float
    pareto_k: float | None
    realized: float | None
    """None until the canary has users on both arms with this metric."""
    realized_ci_low: float | None
    realized_ci_high: float | None
    sign_agrees: bool | None
    realized_in_interval: bool | None
    """The realized difference fell inside the predicted interval."""
    consistent: bool | None
    """|predicted − realized| within 1.96 × the combined standard error of both (the A/B's
    own noise counted, which `realized_in_interval` ignores)."""
    error: float | None
    """Predicted minus realized."""


class PredictionRecord(BaseModel):
    training_run_id: int
    checkpoint: str | None
    """The candidate (None when the run published nothing: rejected or held)."""
    status: str
    experiment_id: int | None
    """Its canary experiment, once it has one."""
    predicted_at: datetime | None
    samples: int
    """Logged completions of production the prediction was made on."""
    identity_passed: bool
    """Re-scoring production gave log-ratios near 0 against the logged logprobs."""
    metrics: list[PredictedMetric]
    """Over all traffic; per traffic kind in `GET /admin/training-runs`' prediction."""


class PredictionScore(BaseModel):
    """How well predictions of one metric agreed with their canaries so far."""

    metric: str
    compared: int
    """Reliable predictions with a realized difference."""
    unreliable_share: float | None
    """Of the predictions with a realized difference, the share flagged unreliable."""
    sign_agreement: float | None
    realized_in_interval: float | None
    consistent: float | None
    mean_abs_error: float | None


class PredictionScoreboard(BaseModel):
    records: list[PredictionRecord]
    scores: list[PredictionScore]
