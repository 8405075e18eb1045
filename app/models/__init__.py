"""Every ORM model, on one `Base`."""

from app.models.api_key import ApiKey, Role
from app.models.audit import Alert, AuditEntry, ControlFlag
from app.models.base import Base
from app.models.checkpoint import LIVE_STATUSES, Checkpoint, CheckpointStatus
from app.models.erasure import ErasedSession, ErasedUser
from app.models.experiment import Arm, Experiment, ExperimentStatus
from app.models.feedback import FeedbackEventRow, FeedbackKind
from app.models.reward import Reward
from app.models.rollup import (
    ExperimentLatency,
    ExperimentLatencyGroup,
    ExperimentUser,
    ExperimentUserDay,
    HourlyRollup,
    RolledUpReward,
    RollupState,
    UserDay,
)
from app.models.sample import Sample
from app.models.training_run import (
    CycleTrigger,
    TrainingRun,
    TrainingRunStatus,
    TrainingSchedule,
)

__all__ = [
    "LIVE_STATUSES",
    "Alert",
    "ApiKey",
    "Arm",
    "AuditEntry",
    "Base",
    "Checkpoint",
    "CheckpointStatus",
    "ControlFlag",
    "CycleTrigger",
    "ErasedSession",
    "ErasedUser",
    "Experiment",
    "ExperimentLatency",
    "ExperimentLatencyGroup",
    "ExperimentStatus",
    "ExperimentUser",
    "ExperimentUserDay",
    "FeedbackEventRow",
    "FeedbackKind",
    "HourlyRollup",
    "Reward",
    "Role",
    "RolledUpReward",
    "RollupState",
    "Sample",
    "TrainingRun",
    "TrainingRunStatus",
    "TrainingSchedule",
    "UserDay",
]
