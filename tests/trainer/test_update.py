"""The update on the tiny model: how a minibatch is split never changes the step."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from trainer.config import TrainConfig
from trainer.data import TrainingSample
from trainer.policy import load_trainable_policy
from trainer.update import micro_batches, sharded_logprobs, update_policy

CONFIG = TrainConfig(
    epochs=1,
    minibatch_size=16,
    learning_rate=1e-3,
    lora_rank=4,
    seed=3,
    device="cpu",
    target_kl=None,
)


def synthetic_samples(model_dir: Path, count: int = 48) -> list[TrainingSample]:
    """Random prompts and completions of random lengths, rewarded at random, with the
    behaviour logprobs the untrained policy gives them (as vLLM would have logged)."""
    rng = random.Random(0)
    rows = [
        (
            [rng.randrange(3, 200) for _ in range(rng.randrange(4, 20))],
            [rng.randrange(3, 200) for _ in range(rng.randrange(1, 24))],
        )
        for _ in range(count)
    ]
    torch.manual_seed(CONFIG.seed)
    policy = load_trainable_policy(model_dir, None, CONFIG, torch.device("cpu"))
    drafts = [
        TrainingSample(i, p, c, [], float(rng.random() < 0.5), datetime.now(UTC))
        for i, (p, c) in enumerate(rows)
    ]
    logged = sharded_logprobs(policy, drafts, CONFIG)
    return [
        dataclasses.replace(s, behaviour_logprobs=lp) for s, lp in zip(drafts, logged, strict=True)
    ]


def trained_lora(
    model_dir: Path, samples: list[TrainingSample], config: TrainConfig
) -> dict[str, torch.Tensor]:
    torch.manual_seed(config.seed)
    device = torch.device("cpu")
    policy = load_trainable_policy(model_dir, None, config, device)
    old = sharded_logprobs(policy, samples, config)
    stats = update_policy(policy, samples, old, config, device, lambda line: None)
    assert stats["optimizer_steps"] == 3
    return {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[TrainingSample]:
    return synthetic_samples(tiny_model_dir)


def test_micro_batches_stay_within_the_token_budget() -> None:
    lengths = [5, 30, 12, 12, 7, 100]
    groups = micro_batches(range(6), lengths, budget=40)
    assert sorted(i for group in groups for i in group) == list(range(6))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) == 1 or len(group) * longest <= 40
    assert [5] in groups  # longer than the budget: alone


def test_the_token_budget_and_gradient_checkpointing_leave_the_update_unchanged(
    tiny_model_dir: Path, samples: list[TrainingSample]
) -> None:
    whole = trained_lora(
        tiny_model_dir, samples, CONFIG.model_copy(update={"micro_batch_tokens": 1 << 20})
    )
    split = trained_lora(
        tiny_model_dir, samples, CONFIG.model_copy(update={"micro_batch_tokens": 64})
    )
    checkpointed = trained_lora(
        tiny_model_dir,
        samples,
        CONFIG.model_copy(update={"micro_batch_tokens": 64, "gradient_checkpointing": True}),
    )
    moved = max(float(t.abs().max()) for n, t in whole.items() if "lora_B" in n)
    assert moved > 1e-4  # B starts at zero: the step did something
    # Sums in another order: Adam moves a weight by up to the learning rate per step, and
    # reordered sums move it by under 1% of that (measured 8e-6 of 1e-3); splitting a
    # minibatch's loss wrongly would move it by a whole step.
    for name, tensor in whole.items():
        torch.testing.assert_close(split[name], tensor, rtol=0, atol=0.02 * CONFIG.learning_rate)
        torch.testing.assert_close(checkpointed[name], split[name], rtol=1e-5, atol=1e-7)


def test_bf16_keeps_the_lora_and_its_steps_in_fp32(
    tiny_model_dir: Path, samples: list[TrainingSample]
) -> None:
    config = CONFIG.model_copy(update={"dtype": "bf16"})
    policy = load_trainable_policy(tiny_model_dir, None, config, torch.device("cpu"))
    dtypes = {p.dtype for p in policy.parameters() if p.requires_grad}
    frozen = {p.dtype for p in policy.parameters() if not p.requires_grad}
    assert (dtypes, frozen) == ({torch.float32}, {torch.bfloat16})
    lora = trained_lora(tiny_model_dir, samples, config)
    assert max(float(t.abs().max()) for n, t in lora.items() if "lora_B" in n) > 1e-4


def test_fp16_with_loss_scaling_takes_the_fp32_steps(
    tiny_model_dir: Path, samples: list[TrainingSample]
) -> None:
    """No step lost to a loss-scale overflow: B (zero at the start) moved as fp32's did, up to
    the few elements whose near-zero gradient Adam turns into a step of either sign."""
    fp32 = trained_lora(tiny_model_dir, samples, CONFIG)
    fp16 = trained_lora(tiny_model_dir, samples, CONFIG.model_copy(update={"dtype": "fp16"}))
    b = [name for name in fp32 if "lora_B" in name]
    difference = sum(float((fp16[n] - fp32[n]).norm() ** 2) for n in b) ** 0.5
    moved = sum(float(fp32[n].norm() ** 2) for n in b) ** 0.5
    print(f"fp16 vs fp32 LoRA B: relative difference {difference / moved:.3f}")
    assert difference < 0.15 * moved  # measured 0.07; 0.29 when the first step overflowed


def test_the_kl_penalty_holds_the_update_nearer_production_and_is_recorded(
    tiny_model_dir: Path, samples: list[TrainingSample]
) -> None:
    device = torch.device("cpu")
    moved = {}
    for kl_coef in (0.0, 1.0):
        config = CONFIG.model_copy(update={"epochs": 4, "kl_coef": kl_coef})
        torch.manual_seed(config.seed)
        policy = load_trainable_policy(tiny_model_dir, None, config, device)
        production = sharded_logprobs(policy, samples, config)
        stats = update_policy(policy, samples, production, config, device, lambda line: None)
        after = sharded_logprobs(policy, samples, config)
        # How far the update moved the sampled tokens: mean |Δ logprob| against production.
        shifts = [
            abs(new - old)
            for row, before in zip(after, production, strict=True)
            for new, old in zip(row, before, strict=True)
        ]
        moved[kl_coef] = sum(shifts) / len(shifts)
        assert stats["kl_to_production"] > 0
    print(f"mean |Δ logprob| from production: {moved}")
    assert moved[1.0] < moved[0.0]


def test_the_update_stops_once_its_kl_to_production_reaches_the_target(
    tiny_model_dir: Path, samples: list[TrainingSample]
) -> None:
    device = torch.device("cpu")
    shift, steps = {}, {}
    for target in (None, 0.01):
        # An update that would run far: 8 epochs of 3 steps.
        config = CONFIG.model_copy(update={"epochs": 8, "learning_rate": 1e-3, "target_kl": target})
        torch.manual_seed(config.seed)
        policy = load_trainable_policy(tiny_model_dir, None, config, device)
        production = sharded_logprobs(policy, samples, config)
        stats = update_policy(policy, samples, production, config, device, lambda line: None)
        after = sharded_logprobs(policy, samples, config)
        moved = [
            abs(new - old)
            for row, before in zip(after, production, strict=True)
            for new, old in zip(row, before, strict=True)
        ]
        shift[target], steps[target] = sum(moved) / len(moved), stats["optimizer_steps"]
        if target is not None:
            assert stats["stopped_at_kl"] >= target
        else:
            assert "stopped_at_kl" not in stats
    print(f"steps {steps}, mean |d logprob| {shift}")
    assert steps[None] == 24 and 1 <= steps[0.01] < 24
    assert shift[0.01] < shift[None] / 2
