"""The update: epochs of clipped policy-gradient steps over the on-policy batch.

The batch is fed as rows (`trainer.sequences`): each turn alone, or a run's turns merged
into one masked sequence. Each minibatch is one optimizer step over about `minibatch_size`
samples' rows. Its rows are split across ranks (DDP) and, on each rank, packed into
micro-batches under a padded-token budget; the loss is the token-level mean over the whole
minibatch however it is split, so the step does not depend on the number of ranks, the
budget or the layout of the rows (up to float rounding).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.config import TrainConfig
from trainer.data import TrainingSample
from trainer.distributed import SINGLE, World, gather_shards, shard, sum_over_ranks
from trainer.loss import LossStats, advantages, policy_gradient_loss
from trainer.policy import policy_dtype
from trainer.sequences import (
    RowBatch,
    RowLayout,
    TrainingRow,
    layout_rows,
    row_batch,
    row_logprobs,
)

CPU = torch.device("cpu")


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


def minibatches(order: Sequence[int], turns: Sequence[int], size: int) -> list[list[int]]:
    """Rows in `order` cut into minibatches of at most `size` samples (`turns[r]`: row r's);
    a row of more goes alone. With a sample per row, slices of `size` rows."""
    groups: list[list[int]] = []
    count = 0
    for row in order:
        if not groups or count + turns[row] > size:
            groups.append([])
            count = 0
        groups[-1].append(row)
        count += turns[row]
    return groups


@torch.inference_mode()
def sharded_logprobs(
    policy: torch.nn.Module,
    samples: Sequence[TrainingSample],
    config: TrainConfig,
    world: World = SINGLE,
    layout: RowLayout | None = None,
) -> list[list[float]]:
    """Every sample's completion logprobs under `policy`, at the temperature it was sampled
    at, computed on the rows the update feeds (`config.layout`, or `layout`); each rank
    computes its share of the rows."""
    rows = (layout or layout_rows(samples, config.layout)).rows
    device = next(policy.parameters()).device
    lengths = [len(row.token_ids) for row in rows]
    mine = shard(len(rows), world)
    found: dict[int, list[float]] = {}
    for group in micro_batches(mine, lengths, config.micro_batch_tokens):
        batch = row_batch([rows[r] for r in group], samples)
        found |= batch.split(row_logprobs(policy, batch.to(device)).cpu())
    per_turn = [[found.get(index, []) for index in rows[r].turns] for r in mine]
    every = gather_shards(per_turn, len(rows), world)
    logprobs: list[list[float]] = [[] for _ in samples]
    for row, found_turns in zip(rows, every, strict=True):
        for index, values in zip(row.turns, found_turns, strict=True):
            logprobs[index] = values
    return logprobs


def rows_loss(
    model: torch.nn.Module,
    batch: RowBatch,
    old_logprobs: Sequence[Sequence[float]],
    behaviour_logprobs: Sequence[Sequence[float]],
    advantage: torch.Tensor,
    config: TrainConfig,
    device: torch.device = CPU,
) -> tuple[torch.Tensor, LossStats]:
    """The clipped policy-gradient loss of a micro-batch of rows, the mean over its trained
    tokens: each token with its turn's advantage and its own old and behaviour logprobs."""
    return policy_gradient_loss(
        row_logprobs(model, batch.to(device)),
        batch.per_token(old_logprobs).to(device),
        batch.per_token(behaviour_logprobs).to(device),
        batch.per_turn(advantage).to(device),
        batch.trained.to(device),
        clip_epsilon=config.clip_epsilon,
        tis_cap=config.tis_cap,
        kl_coef=config.kl_coef,
    )


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
    """Epochs of clipped policy-gradient steps over the batch, fed in `config.layout`;
    returns the run's statistics.

    `old_logprobs` are the policy's own before the update: production's, the PPO ratio's
    denominator and the KL penalty's anchor. Each turn's tokens carry its own advantage and
    its own behaviour logprobs, whichever row it is in."""
    layout = layout_rows(samples, config.layout)
    feed = RowFeed.of(samples, old_logprobs, layout, config)
    learner = Learner.of(policy, config, device, world)
    generator = torch.Generator().manual_seed(config.seed)
    totals = [0.0] * (len(STAT_NAMES) + 1)  # token-weighted sums of each stat, then tokens
    steps, started, stopped_at_kl = 0, time.perf_counter(), None
    policy.train()
    epoch = 0
    for epoch in range(config.epochs):
        epoch_totals = [0.0] * len(totals)
        order = torch.randperm(len(feed.rows), generator=generator).tolist()
        for minibatch in minibatches(order, feed.turns, config.minibatch_size):
            kl = learner.step(feed, minibatch, config, device, world, epoch_totals)
            if kl is not None:
                stopped_at_kl = kl
                break
            steps += 1
        epoch_totals = sum_over_ranks(epoch_totals, world)
        totals = [a + b for a, b in zip(totals, epoch_totals, strict=True)]
        tokens = max(epoch_totals[-1], 1.0)
        progress(
            f"epoch {epoch + 1}/{config.epochs}: loss {epoch_totals[0] / tokens:+.4f}, "
            f"clip fraction {epoch_totals[2] / tokens:.3f}"
        )
        if stopped_at_kl is not None:
            progress(
                f"stopped after {steps} steps: KL to production {stopped_at_kl:.4f} per token"
                f" reached the target {config.target_kl}"
            )
            break
    elapsed = time.perf_counter() - started
    policy.eval()
    tokens = max(totals[-1], 1.0)
    return {
        **{name: totals[k] / tokens for k, name in enumerate(STAT_NAMES)},
        "optimizer_steps": steps,
        # Present when the update stopped at its KL target (`TrainConfig.target_kl`).
        **({"stopped_at_kl": stopped_at_kl} if stopped_at_kl is not None else {}),
        "rows": len(feed.rows),
        "merge_breaks": layout.breaks,
        # The layout's tokens once per epoch begun (an update stopped at its KL target fed
        # part of its last).
        "tokens_fed": layout.tokens_fed * (epoch + 1),
        "tokens": totals[-1],
        "tokens_per_s": totals[-1] / elapsed if elapsed > 0 else 0.0,
        "update_seconds": elapsed,
    }


@dataclass(frozen=True)
class RowFeed:
    """The batch as the update feeds it: its rows, and per row its padded length, its number
    of turns and its trained tokens; per sample its advantage and logprobs."""

    samples: list[TrainingSample]
    rows: list[TrainingRow]
    lengths: list[int]
    turns: list[int]
    trained: list[int]
    advantage: torch.Tensor
    old_logprobs: list[list[float]]
    behaviour: list[list[float]]

    @classmethod
    def of(
        cls,
        samples: list[TrainingSample],
        old_logprobs: list[list[float]],
        layout: RowLayout,
        config: TrainConfig,
    ) -> RowFeed:
        rows = layout.rows
        return cls(
            samples=samples,
            rows=rows,
            lengths=[len(row.token_ids) for row in rows],
            turns=[len(row.turns) for row in rows],
            trained=[sum(len(samples[i].completion_token_ids) for i in row.turns) for row in rows],
            advantage=advantages(samples, config.baseline),
            old_logprobs=old_logprobs,
            behaviour=[s.behaviour_logprobs for s in samples],
        )


@dataclass
class Learner:
    """What takes the optimizer steps: the model (wrapped in DDP across ranks), its trainable
    (LoRA) parameters, AdamW, and the loss scaler fp16 needs."""

    model: torch.nn.Module
    ddp: DistributedDataParallel | None
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler

    @classmethod
    def of(
        cls, policy: torch.nn.Module, config: TrainConfig, device: torch.device, world: World
    ) -> Learner:
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
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate)
        # fp16 activations underflow in the backward pass without loss scaling. A cycle takes few
        # steps: start at a scale that seldom overflows (2^16 skipped the first step of three).
        scaler = torch.amp.GradScaler(
            device.type, init_scale=2.0**10, enabled=policy_dtype(config, device) == "fp16"
        )
        return cls(ddp or policy, ddp, trainable, optimizer, scaler)

    def step(
        self,
        feed: RowFeed,
        minibatch: list[int],
        config: TrainConfig,
        device: torch.device,
        world: World,
        totals: list[float],
    ) -> float | None:
        """One optimizer step on a minibatch of rows, this rank's share in micro-batches;
        adds each statistic's token-weighted sum, then the tokens, to `totals`. Returns the
        minibatch's per-token KL to production instead of stepping when it has reached
        `config.target_kl` (every rank decides alike), else None."""
        minibatch_tokens = sum(feed.trained[r] for r in minibatch)
        mine = minibatch[world.rank :: world.size]
        # A rank with no sample in a small last minibatch still joins the gradient
        # all-reduce, with a sample whose loss counts zero.
        weight = world.size / max(minibatch_tokens, 1) if mine else 0.0
        groups = micro_batches(mine or minibatch[:1], feed.lengths, config.micro_batch_tokens)
        self.optimizer.zero_grad()
        kl_sum, kl_tokens = 0.0, 0.0
        for number, group in enumerate(groups):
            batch = row_batch([feed.rows[r] for r in group], feed.samples)
            # Gradients are all-reduced once per step, on its last micro-batch.
            last = number == len(groups) - 1
            ddp = self.ddp
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                loss, stats = rows_loss(
                    self.model,
                    batch,
                    feed.old_logprobs,
                    feed.behaviour,
                    feed.advantage,
                    config,
                    device,
                )
                micro_tokens = int(batch.trained.sum())
                self.scaler.scale(loss * micro_tokens * weight).backward()
            if weight:
                values = [getattr(stats, name) for name in STAT_NAMES]
                for k, value in enumerate(values):
                    totals[k] += value * micro_tokens
                totals[-1] += micro_tokens
                kl_sum += stats.kl_to_production * micro_tokens
                kl_tokens += micro_tokens
        if config.target_kl is not None:
            kl_sum, kl_tokens = sum_over_ranks([kl_sum, kl_tokens], world)
            kl = kl_sum / max(kl_tokens, 1.0)
            if kl >= config.target_kl:
                self.optimizer.zero_grad()
                return kl
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.trainable, config.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return None
