"""The global rollout batch of online RL when several processes train together.

Each process samples and scores its share of the step's prompts (whole groups: all
``num_generations`` samples of a prompt are drawn by one process). Then every process gathers
the experience of all of them (:func:`gather_experience`), so advantages that need a whole group
or the whole batch (group baselines, batch whitening) and the step's statistics are computed on
the global batch, and each optimizer step's mini-batch is the same set of rows whatever the
number of processes (:func:`minibatch_share`). With one process both are the identity, so a
one-process run is unchanged; with N processes the update equals the one-process update given
the same samples. ``seed_per_prompt`` makes the samples themselves independent of N.
"""

from __future__ import annotations

import torch

# exp keys laid out over [prompt | response] (left- and right-padded); the others cover the response only
_FULL_WIDTH = ("input_ids", "attention_mask", "position_ids")


def check_split(config, mini_batch_size: int, processes: int) -> None:
    """Whole groups per process: the step's prompts and each mini-batch must divide over the processes."""
    from verl_core.errors import TrainingError

    prompts = config.batch_size // config.num_generations
    if prompts % processes or mini_batch_size % (processes * config.gradient_accumulation_steps):
        raise TrainingError(
            f"prompts per step ({prompts}) must split over {processes} processes and "
            f"mini_batch_size ({mini_batch_size}) over processes × gradient_accumulation_steps"
        )


def prompt_seeds(seed: int, step: int, first: int, count: int) -> list[int]:
    """Seeds of the prompts at places ``first .. first+count-1`` of step ``step``'s global batch."""
    return [(seed * 1_000_003 + step) * 100_003 + first + i for i in range(count)]


def gather_rows(tensor: torch.Tensor, accelerator) -> torch.Tensor:
    """Rows of every process, in rank order (each process holds the same number of rows)."""
    return tensor if accelerator.num_processes == 1 else accelerator.gather(tensor.contiguous())


def gather_experience(exp: dict[str, torch.Tensor], accelerator, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Every process's experience rows, in rank order (= the order of the step's prompts), in the
    layout one process would have made: prompts left-padded to the longest prompt of the batch,
    responses right-padded to the longest response."""
    if accelerator.num_processes == 1:
        return exp
    from verl_core.rollout.contract import position_ids_from_mask

    r = exp["response_ids"].shape[1]
    p = exp["input_ids"].shape[1] - r
    p_max, r_max = _max_over_ranks(p, accelerator), _max_over_ranks(r, accelerator)
    out = {}
    for key, t in exp.items():
        pad_value = pad_token_id if key in ("input_ids", "response_ids") else 0
        if key in _FULL_WIDTH:
            prompt = torch.nn.functional.pad(t[:, :p], (p_max - p, 0), value=pad_value)
            t = torch.cat([prompt, torch.nn.functional.pad(t[:, p:], (0, r_max - r), value=pad_value)], 1)
        elif t.dim() == 2:
            t = torch.nn.functional.pad(t, (0, r_max - r), value=pad_value)
        out[key] = gather_rows(t, accelerator)
    if "position_ids" in out:  # cumsum(mask) - 1 over the new layout: what one process computes
        out["position_ids"] = position_ids_from_mask(out["attention_mask"])
    return out


def _max_over_ranks(value: int, accelerator) -> int:
    t = torch.tensor([value], device=accelerator.device)
    return int(accelerator.gather(t).max())


def minibatch_share(order: torch.Tensor, k: int, mini_batch_size: int, accelerator) -> torch.Tensor:
    """This process's rows of mini-batch ``k``: its slice of ``order[k*M : (k+1)*M]`` (``order`` is
    the same permutation of the global batch on every process)."""
    rows = order[k * mini_batch_size : (k + 1) * mini_batch_size]
    local = mini_batch_size // accelerator.num_processes
    return rows[accelerator.process_index * local : (accelerator.process_index + 1) * local]


def mean_over_ranks(metrics: dict[str, float], accelerator) -> dict[str, float]:
    """Each metric's mean over the processes (exact for means over equal shares of the batch)."""
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=accelerator.device)
    values = accelerator.reduce(values, reduction="mean")
    return {k: float(v) for k, v in zip(keys, values.tolist())}
