"""The trainer's knobs, declared once: each field of `TrainConfig` with its bounds and the
docstring under it, set from `RTRL_TRAIN_<FIELD>` by `TrainSettings`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.config import SettingsError

Dtype = Literal["auto", "bf16", "fp16", "fp32"]
EvalGate = Literal["auto", "task_family", "logged_traffic", "agent_tasks"]
Baseline = Literal["state", "batch"]
Layout = Literal["merged", "stepwise"]


class TrainConfig(BaseModel):
    """One training cycle's knobs; copy with `config.model_copy(update={...})`."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    seed: int = 0
    """Seeds torch and the minibatch order."""
    min_samples: int = Field(default=64, ge=1)
    """Fewer finalized, trainable production samples than this: skip the cycle."""
    min_new_samples: int = Field(default=64, ge=0)
    """Fewer of them served after the window of the last run that trained from the same
    production checkpoint: skip the cycle, it would publish a near-duplicate of that run."""
    max_samples: int = Field(default=4096, ge=1)
    """Train on at most this many of the most recent samples."""
    max_source_share: float = Field(default=0.25, gt=0, le=1)
    """Most of `max_samples` that one API key, or one user, may fill: a key or user gives a
    batch only its newest `max_source_share × max_samples` samples; 1: no cap."""
    epochs: int = Field(default=2, ge=1)
    """Passes over the on-policy batch."""
    minibatch_size: int = Field(default=64, ge=1)
    """Samples per optimizer step, across every rank (split into micro-batches)."""
    micro_batch_tokens: int = Field(default=8192, ge=1)
    """Padded tokens (rows × longest prompt+completion) per forward/backward pass; gradients
    accumulate over a minibatch's micro-batches, so this bounds memory, not the update."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory for long sequences, ~30% slower."""
    dtype: Dtype = "auto"
    """Precision of the policy's weights and forward pass: bf16, fp16 or fp32; auto is bf16 on
    CUDA and fp32 on CPU, as vLLM serves. LoRA weights and the optimizer stay in fp32."""
    learning_rate: float = Field(default=5e-4, gt=0)
    """AdamW learning rate for the LoRA; conservative, since a large step undoes a good policy."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping."""
    clip_epsilon: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip range for the ratio of the new policy to the pre-update policy."""
    tis_cap: float = Field(default=2.0, gt=1)
    """Truncation of the importance weight from vLLM's behaviour policy to ours (TIS)."""
    baseline: Baseline = "state"
    """What a sample's reward is measured against: "state", the mean reward of other runs'
    samples of its prompt, else of its state (agent or chat, turn, edit asked for), else of the
    batch (`trainer.loss.state_baselines`); "batch", the former one, its prompt's mean, else
    the batch mean."""
    kl_coef: float = Field(default=0.05, ge=0)
    """Weight of the per-token KL penalty to production (the policy before this update) on the
    tokens trained on; 0 disables it. It holds back tokens that drift with whatever the
    sample's advantage was (an answer's end, a tool's name). 0.05 kept the demo's gain and cut
    the update's KL by a sixth (`docs/results/trainer-defaults.md`)."""
    target_kl: float | None = Field(default=0.015, gt=0)
    """The update stops once the policy's per-token KL to production, measured on the next
    minibatch before its step, reaches this (that step is not taken): the update's size is
    set by what it does to the policy, not by lr × steps. None (`none` in the environment):
    every step of every epoch."""
    layout: Layout = "merged"
    """How a run's turns are fed (`trainer.sequences`): "merged", consecutive turns whose token
    ids are an exact prefix of the next turn's prompt as one sequence with loss on the model's
    tokens only (O(T) tokens for T turns); "stepwise", each turn a row of its own carrying the
    whole history again (O(T^2)). The same tokens get the same logprobs, loss and gradient
    either way (up to float rounding); a minibatch holds about `minibatch_size` samples' rows."""
    lora_rank: int = Field(default=16, ge=1)
    """LoRA rank (vLLM is started with --max-lora-rank 16)."""
    lora_alpha: int = Field(default=32, ge=1)
    """LoRA scaling numerator."""
    lora_target_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        min_length=1,
    )
    """Linear layers that get adapters (["all-linear"]: every linear layer but the head)."""
    drift_max_abs: float | None = Field(default=None, ge=0)
    """Refuse when any token's |logged − recomputed| logprob exceeds this; None: the dtype's
    default (see trainer/drift.py), inf: no limit."""
    drift_mean_abs: float | None = Field(default=None, ge=0)
    """Refuse when the mean |logged − recomputed| logprob over the batch exceeds this."""
    drift_kl: float | None = Field(default=None, ge=0)
    """Refuse when the mean per-token KL(vLLM ‖ trainer) estimate (k3) exceeds this."""
    drift_capped_share: float | None = Field(default=None, ge=0, le=1)
    """Refuse when more than this share of tokens have their importance weight capped at
    `tis_cap`."""
    eval_gate: EvalGate = "auto"
    """What the evaluation gate scores candidates on: the toy task family's held-out tasks,
    production's logged held-out traffic (kept against rejected completions), or held-out
    agent tasks run offline with the workspace's tools (solved without a malformed call);
    auto: the task family on a base the sandbox ships, logged traffic on any other."""
    eval_tasks: int = Field(default=128, ge=1)
    """Held-out tasks (task_family, agent_tasks) or most recent kept and rejected
    completions each (logged_traffic) in the evaluation gate."""
    eval_max_new_tokens: int = Field(default=48, ge=1)
    """Generation length in the task-family gate."""
    eval_max_regression: float = Field(default=0.05, ge=0)
    """Held-out pass rate may drop at most this much against production."""
    eval_max_kl: float = Field(default=0.5, ge=0)
    """Mean per-token KL(new ‖ production) on held-out prompts above this: reject."""
    eval_traffic_percent: int = Field(default=10, ge=1, le=50)
    """With the logged_traffic gate: this percent of production traffic (by sample id) is
    never trained on and is what the gate scores."""
    prediction_percent: int = Field(default=10, ge=0, le=50)
    """This percent of production traffic (by sample id) is never trained on: the candidate's
    A/B is predicted on it before its canary (`trainer.prediction`); 0: no prediction."""
    prediction_samples: int = Field(default=1024, ge=1)
    """Most logged completions of that slice a prediction scores (the newest)."""
    prediction_gate_margin: float | None = Field(default=None, ge=0)
    """Hold a candidate whose mean reward is predicted, reliably, below production's by more
    than this (its whole interval); None: predictions are recorded, never acted on."""
    canary_bps: int = Field(default=1000, ge=1, le=9999)
    """Share of users routed to the new checkpoint, in basis points (10%)."""
    threads: int = Field(default=0, ge=0)
    """Torch CPU threads for the cycle; 0 keeps torch's default. Beside a local vLLM on a
    2-core machine, 1 is several times faster than 2 (the threads wait on each other)."""
    device: str = ""
    """"" picks CUDA when available (the local rank's device under torchrun), else CPU."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_aliases(cls, value: object) -> object:
        aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}
        return aliases.get(str(value).lower(), str(value).lower()) if value else value

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator(
        "drift_max_abs",
        "drift_mean_abs",
        "drift_kl",
        "drift_capped_share",
        "prediction_gate_margin",
        mode="before",
    )
    @classmethod
    def _unset_is_default(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        kind, _, index = value.partition(":")
        if value and (kind not in ("cpu", "cuda") or (index and not index.isdigit())):
            raise ValueError("must be empty, cpu, cuda or cuda:N")
        return value


class TrainSettings(TrainConfig, BaseSettings):
    """`TrainConfig` read from `RTRL_TRAIN_<FIELD>` for each of its fields."""

    model_config = SettingsConfigDict(
        env_prefix="RTRL_TRAIN_", extra="ignore", env_parse_none_str="none"
    )

    def train_config(self, **overrides: Any) -> TrainConfig:
        """The TrainConfig these settings describe, with `overrides` (None: not overridden)."""
        values = self.model_dump()
        values.update({name: value for name, value in overrides.items() if value is not None})
        return TrainConfig(**values)

    def explicit(self) -> dict[str, Any]:
        """Only the fields set in the environment: for callers with defaults of their own."""
        return {name: getattr(self, name) for name in self.model_fields_set}


def load_train_settings() -> TrainSettings:
    """Read the trainer's settings from the environment, or fail naming the bad variable."""
    try:
        return TrainSettings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else "?"
            problems.append(f"RTRL_TRAIN_{name.upper()}: {error['msg']}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None


def train_config_from_env(**overrides: Any) -> TrainConfig:
    """TrainConfig from `RTRL_TRAIN_*`, with command-line `overrides` (None: not given)."""
    return load_train_settings().train_config(**overrides)


def with_explicit_settings(config: TrainConfig) -> TrainConfig:
    """`config` (a caller's own defaults, e.g. the demo's) with whatever `RTRL_TRAIN_*` sets."""
    return config.model_copy(update=load_train_settings().explicit())
