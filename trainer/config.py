"""The trainer's knobs, one typed dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainConfig:
    seed: int = 0
    """Seeds torch and the minibatch order."""
    min_samples: int = 64
    """Fewer finalized, trainable production samples than this: skip the cycle."""
    min_new_samples: int = 64
    """Fewer of them served after the window of the last run that trained from the same
    production checkpoint: skip the cycle, it would publish a near-duplicate of that run."""
    max_samples: int = 4096
    """Train on at most this many of the most recent samples."""
    epochs: int = 2
    """Passes over the on-policy batch."""
    minibatch_size: int = 64
    """Samples per optimizer step (split into micro-batches for gradient accumulation)."""
    micro_batch_size: int = 16
    """Samples per forward/backward pass; gradients accumulate up to `minibatch_size`."""
    learning_rate: float = 5e-4
    """AdamW learning rate for the LoRA; conservative, since a large step undoes a good policy."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    clip_epsilon: float = 0.2
    """PPO clip range for the ratio of the new policy to the pre-update policy."""
    tis_cap: float = 2.0
    """Truncation of the importance weight from vLLM's behaviour policy to ours (TIS)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the base model (0 disables it)."""
    lora_rank: int = 16
    """LoRA rank (vLLM is started with --max-lora-rank 16)."""
    lora_alpha: int = 32
    """LoRA scaling numerator."""
    lora_target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Linear layers that get adapters."""
    drift_tolerance: float = 1e-3
    """Max |logged − recomputed| logprob on the probe before training is refused."""
    drift_probe_size: int = 32
    """Samples recomputed to check serving/training drift."""
    eval_tasks: int = 128
    """Held-out tasks in the evaluation gate."""
    eval_max_new_tokens: int = 48
    """Generation length in the evaluation gate."""
    eval_max_regression: float = 0.05
    """Held-out pass rate may drop at most this much against production."""
    eval_max_kl: float = 0.5
    """Mean per-token KL(new ‖ production) on held-out prompts above this: reject."""
    canary_bps: int = 1000
    """Share of users routed to the new checkpoint, in basis points (10%)."""
    threads: int = 0
    """Torch CPU threads for the cycle; 0 keeps torch's default. Beside a local vLLM on a
    2-core machine, 1 is several times faster than 2 (the threads wait on each other)."""
    device: str = ""
    """"" picks CUDA when available, else CPU."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
