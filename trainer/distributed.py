"""torch.distributed for the trainer: one process per device under `torchrun`.

Rank 0 alone talks to Postgres and vLLM: it selects the batch and shares it, evaluates,
saves and publishes. Every rank computes logprobs for its share of the samples and trains on
its share of each minibatch; DistributedDataParallel averages the LoRA's gradients, so every
rank takes the same optimizer step. Without `torchrun` the world is this one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

COLLECTIVE_TIMEOUT = timedelta(hours=2)
"""How long a rank waits for the others: rank 0 evaluates and publishes alone meanwhile."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


SINGLE = World()


def join_world() -> World:
    """The `torchrun` world this process belongs to, its process group started; or SINGLE."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return SINGLE
    world = World(
        rank=int(os.environ["RANK"]),
        size=size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(world.local_rank)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    return world


def leave_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def share(value: T, world: World) -> T:
    """Rank 0's `value` on every rank; what the other ranks pass is ignored."""
    if not world.distributed:
        return value
    box: list[Any] = [value if world.is_main else None]
    dist.broadcast_object_list(box, src=0, device=collective_device())
    return box[0]


def shard(count: int, world: World) -> list[int]:
    """This rank's indices of `count` items: every size-th one from its rank."""
    return list(range(world.rank, count, world.size))


def gather_shards(mine: list[T], count: int, world: World) -> list[T]:
    """Every rank's results for its `shard` of `count` items, in the items' order."""
    if not world.distributed:
        return mine
    every: list[Any] = [None] * world.size
    dist.all_gather_object(every, mine)
    merged: list[Any] = [None] * count
    for rank, results in enumerate(every):
        for index, result in zip(range(rank, count, world.size), results, strict=True):
            merged[index] = result
    return merged


def sum_over_ranks(values: list[float], world: World) -> list[float]:
    """Element-wise sums of `values` over every rank."""
    if not world.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor)
    return [float(value) for value in tensor.cpu()]


def collective_device() -> torch.device:
    """Where collectives stage tensors: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
