"""The update: epochs of clipped policy-gradient steps over the on-policy batch.

Each minibatch is one optimizer step. Its samples are split across ranks (DDP) and, on each
rank, packed into micro-batches under a padded-token budget; the loss is the token-level
mean over the whole minibatch however it is split, so the step does not depend on the
number of ranks or the budget (up to float rounding).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from app.serving.parity import batch_logprobs, completion_batch, completion_logprobs
from trainer.config import TrainConfig
from trainer.data import TrainingSample
from trainer.distributed import SINGLE, World, gather_shards, shard, sum_over_ranks
from trainer.loss import advantages, policy_gradient_loss
from trainer.policy import policy_dtype


def right_aligned(rows: list[list[float]], width: int) -> torch.Tensor:
    """Per-token values placed at the end of a [len(rows), width] tensor, as batches are."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        if row:
            out[i, width - len(row) :] = torch.tensor(row)
    return out


def micro_batches(indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """`indices` grouped longest first so that rows × the longest sequence stays within
    `budget` padded tokens (a longer sequence goes alone)."""
    order = sorted(indices, key=lambda i: lengths[i], reverse=True)
    groups: list[list[int]] = []
    for index in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def sharded_logprobs(
    policy: torch.nn.Module,
    samples: Sequence[TrainingSample],
    config: TrainConfig,
    world: World = SINGLE,
) -> list[list[float]]:
    """Every sample's completion logprobs under `policy`, at the temperature it was sampled
    at; each rank computes its share."""
    mine = [samples[i] for i in shard(len(samples), world)]
    logprobs = completion_logprobs(
        policy,
        [s.prompt_token_ids for s in mine],
        [s.completion_token_ids for s in mine],
        temperatures=[s.temperature for s in mine],
        max_batch_tokens=config.micro_batch_tokens,
    )
    return gather_shards(logprobs, len(samples), world)


STAT_NAMES = ("loss", "mean_ratio", "clip_fraction", "mean_tis_weight", "kl_to_production")


def update_policy(
    policy: torch.nn.Module,
    samples: list[TrainingSample],
    old_logprobs: list[list[float]],
    config: TrainConfig,
    device: torch.device,
    progress: Callable[[str], None],
    world: World = SINGLE,
) -> dict[str, float]:
    """Epochs of clipped policy-gradient steps over the batch; returns the run's statistics.

    `old_logprobs` are the policy's own before the update: production's, the PPO ratio's
    denominator and the KL penalty's anchor."""
    prompts = [s.prompt_token_ids for s in samples]
    completions = [s.completion_token_ids for s in samples]
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    advantage = advantages(samples, config.baseline)

    trainable = [p for p in policy.parameters() if p.requires_grad]
    ddp = None
    if world.distributed:
        # Every rank loaded the same weights; only the LoRA must be identical to start, and
        # buffers (rotary tables) are never broadcast, so ranks may run unequal micro-batches.
        for parameter in trainable:
            dist.broadcast(parameter.data, src=0)
        ddp = DistributedDataParallel(
            policy,
            device_ids=[device.index] if device.type == "cuda" else None,
            init_sync=False,
            forward_sync_buffers=False,
        )
    model = ddp or policy
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate)
    # fp16 activations underflow in the backward pass without loss scaling. A cycle takes few
    # steps: start at a scale that seldom overflows (2^16 skipped the first step of three).
    scaler = torch.amp.GradScaler(
        device.type, init_scale=2.0**10, enabled=policy_dtype(config, device) == "fp16"
    )
    generator = torch.Generator().manual_seed(config.seed)
    totals = [0.0] * (len(STAT_NAMES) + 1)  # token-weighted sums of each stat, then tokens
    steps, started = 0, time.perf_counter()
    policy.train()
    for epoch in range(config.epochs):
        epoch_totals = [0.0] * len(totals)
        order = torch.randperm(len(samples), generator=generator).tolist()
        for start in range(0, len(order), config.minibatch_size):
            minibatch = order[start : start + config.minibatch_size]
            minibatch_tokens = sum(len(completions[i]) for i in minibatch)
            mine = minibatch[world.rank :: world.size]
            # A rank with no sample in a small last minibatch still joins the gradient
            # all-reduce, with a sample whose loss counts zero.
            weight = world.size / max(minibatch_tokens, 1) if mine else 0.0
            groups = micro_batches(mine or minibatch[:1], lengths, config.micro_batch_tokens)
            optimizer.zero_grad()
            for number, group in enumerate(groups):
                batch = completion_batch(
                    [prompts[i] for i in group],
                    [completions[i] for i in group],
                    [samples[i].temperature for i in group],
                )
                width = batch.width
                # Gradients are all-reduced once per step, on its last micro-batch.
                last = number == len(groups) - 1
                with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                    loss, stats = policy_gradient_loss(
                        batch_logprobs(model, batch.to(device)),
                        right_aligned([old_logprobs[i] for i in group], width).to(device),
                        right_aligned([samples[i].behaviour_logprobs for i in group], width).to(
                            device
                        ),
                        advantage[group].to(device),
                        batch.completion_mask.to(device),
                        clip_epsilon=config.clip_epsilon,
                        tis_cap=config.tis_cap,
                        kl_coef=config.kl_coef,
                    )
                    micro_tokens = int(batch.completion_mask.sum())
                    scaler.scale(loss * micro_tokens * weight).backward()
                if weight:
                    values = [getattr(stats, name) for name in STAT_NAMES]
                    for k, value in enumerate(values):
                        epoch_totals[k] += value * micro_tokens
                    epoch_totals[-1] += micro_tokens
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            steps += 1
        epoch_totals = sum_over_ranks(epoch_totals, world)
        totals = [a + b for a, b in zip(totals, epoch_totals, strict=True)]
        tokens = max(epoch_totals[-1], 1.0)
        progress(
            f"epoch {epoch + 1}/{config.epochs}: loss {epoch_totals[0] / tokens:+.4f}, "
            f"clip fraction {epoch_totals[2] / tokens:.3f}"
        )
    elapsed = time.perf_counter() - started
    policy.eval()
    tokens = max(totals[-1], 1.0)
    return {
        **{name: totals[k] / tokens for k, name in enumerate(STAT_NAMES)},
        "optimizer_steps": steps,
        "tokens": totals[-1],
        "tokens_per_s": totals[-1] / elapsed if elapsed > 0 else 0.0,
        "update_seconds": elapsed,
    }
