"""Which rows each optimizer step reads, and moving a batch to the device.

Data order is a pure function of (seed, step), so a checkpoint needs no data-loader state.
"""

from __future__ import annotations

import math

import torch

from verl_core.errors import TrainingError
from verl_core.train.config import TrainConfig


def micro_batch_indices(n_rows: int, step: int, batch_size: int, seed: int, rank: int, world: int, accum: int) -> list[list[int]]:
    """Row indices of this process's micro-batches for optimizer step ``step`` (0-based)."""
    per_epoch = n_rows // batch_size
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n_rows, generator=gen)[k * batch_size : (k + 1) * batch_size].tolist()
    per_rank = batch_size // world
    mine = order[rank * per_rank : (rank + 1) * per_rank]
    micro = per_rank // accum
    return [mine[i * micro : (i + 1) * micro] for i in range(accum)]


def steps_for(config: TrainConfig, n_rows: int) -> int:
    if config.max_steps is not None:
        return config.max_steps
    per_epoch = n_rows // config.batch_size
    if per_epoch == 0:
        raise TrainingError(f"dataset has {n_rows} rows, fewer than batch_size {config.batch_size}")
    return max(1, math.ceil(per_epoch * config.num_epochs))


def to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
