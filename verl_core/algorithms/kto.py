"""KTO (Ethayarajh et al. 2024, arXiv:2402.01306) on the shared engine.

Rows are unpaired ``{"prompt", "completion", "label"}`` (``label`` True = desirable);
preference rows ``{"prompt", "chosen", "rejected"}`` are split automatically into one
desirable and one undesirable row each.

The KL reference point ``z0`` is estimated from mismatched pairs: every example ``i``
is given, once, the completion of another example (``mismatched_indices`` applied to
a seeded shuffle of the dataset, so never its own; a converted pair's two rows share
a prompt, so the partner may rarely be the same prompt's other completion). A batch
is then ``B`` target rows ``prompt_i + completion_i`` and, under ``batch["kl"]``, ``B`` KL
rows ``prompt_i + completion_partner(i)``. z0 is detached (the paper backpropagates
through no part of it), so the KL rows are scored by the policy in a forward without
gradients: in the target rows' forward their activations would be kept for a backward
that gives them nothing (at SmolLM2's shape that was ~1/6 of KTO's peak memory). Fixing
the partner per example is what lets the reference side be precomputed like DPO's. With
several processes ``z0`` is averaged across them (``accelerator.reduce(..., "mean")``).

Label balance:

- a *dataset* with only one label is rejected with a :class:`DataError`: the
  reference point then has nothing to separate, and the SFT trainer is the right tool
  for only-desirable data;
- a *batch* with only one label is fine: the loss is defined per row. The class
  metrics (``rewards/chosen``, ``logps/chosen`` for desirable rows, ``*/rejected``
  for undesirable ones) are NaN for a class absent from the micro-batch ("not
  present"; metric callbacks skip non-finite values), ``rewards/margins`` likewise;
  ``count/desirable`` (the fraction of desirable rows) and ``kl`` are always finite.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from verl_core.algorithms.preference import REF_KEY, PreferenceConfig, PreferenceTrainer, attach_reference
from verl_core.data import DataError, collate_sequences, tokenize_unpaired
from verl_core.data.packing import collate_packed_kto
from verl_core.losses.preference import kto_loss, mismatched_indices, sequence_logps
from verl_core.modeling.packed_forward import model_token_logprobs
from verl_core.train.engine import LossOutput


class KTOConfig(PreferenceConfig):
    """KTO settings: β and the per-class weights λ_D, λ_U of the paper's eq. 8."""

    desirable_weight: float = Field(1.0, gt=0)
    undesirable_weight: float = Field(1.0, gt=0)


def assign_kl_completions(examples: list[dict], seed: int, max_length: int) -> list[dict]:
    """Give every example ``kl_completion_ids``: another example's completion, cut to fit ``max_length``."""
    if len(examples) < 2:
        raise DataError("KTO needs at least 2 rows to form mismatched (prompt, completion) pairs for its KL estimate")
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    shifted = mismatched_indices(len(examples)).tolist()
    for k, i in enumerate(order):
        partner = examples[order[shifted[k]]]
        examples[i]["kl_completion_ids"] = partner["completion_ids"][: max_length - len(examples[i]["prompt_ids"])]
    return examples


def _class_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return values[mask].mean().item() if bool(mask.any()) else math.nan


class KTOTrainer(PreferenceTrainer):
    """Kahneman–Tversky optimisation; see the module docstring for data and metrics.

    Per step the loss is the mean over the global batch of per-row losses
    ``w_D·(1-σ(β(r-z0)))`` (desirable) / ``w_U·(1-σ(β(z0-r)))`` (undesirable),
    ``r = log π(y|x) - log π_ref(y|x)``.
    """

    config_cls = KTOConfig
    config: KTOConfig

    def tokenize(self, rows) -> list[dict]:
        c = self.config
        examples = tokenize_unpaired(rows, self.tokenizer, c.max_length, c.max_prompt_length, c.on_long_prompt)
        # OfflineTrainer tokenizes the train set first: before that, train_examples does not exist yet.
        is_train = not hasattr(self, "train_examples")
        labels = {e["label"] for e in examples}
        if is_train and len(labels) < 2:
            which = "desirable (label=True)" if True in labels else "undesirable (label=False)"
            raise DataError(
                f"KTO train data has only {which} rows; KTO needs both labels to learn what to prefer "
                "(for only-desirable data use SFT, or add undesirable examples)"
            )
        return assign_kl_completions(examples, c.seed, c.max_length)

    def collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        """Target rows, their ``labels`` and the KL rows under ``"kl"`` (see the module docstring)."""
        c = self.config
        if c.packing:
            return attach_reference(
                collate_packed_kto(
                    examples,
                    self.tokenizer.pad_token_id,
                    c.share_prompt,
                    c.packing_row_tokens,
                    prune_last_layer=c.prune_last_layer,
                    fused_lm_head=c.fused_lm_head,
                ),
                examples,
            )
        prompts = [e["prompt_ids"] for e in examples]
        batch = collate_sequences(prompts, [e["completion_ids"] for e in examples], self.tokenizer.pad_token_id)
        batch["kl"] = collate_sequences(prompts, [e["kl_completion_ids"] for e in examples], self.tokenizer.pad_token_id)
        batch["labels"] = torch.tensor([e["label"] for e in examples], dtype=torch.bool)
        return attach_reference(batch, examples)

    def reference_logps(self, model, batch: dict) -> torch.Tensor:
        """``[2B]``: the target rows', then the KL rows' summed completion log-probs under the reference."""
        if REF_KEY in batch:
            return super().reference_logps(model, batch)
        return torch.cat([super().reference_logps(model, batch), super().reference_logps(model, batch["kl"])])

    def _reduce_kl(self):
        acc = self.engine.accelerator if self.engine is not None else None
        if acc is None or acc.num_processes == 1:
            return None
        return lambda z0: acc.reduce(z0, reduction="mean")

    def loss(self, model, batch: dict[str, torch.Tensor]) -> LossOutput:
        c = self.config
        logps = sequence_logps(model_token_logprobs(model, batch), batch["loss_mask"])
        with torch.no_grad():
            kl_logps = sequence_logps(model_token_logprobs(model, batch["kl"]), batch["kl"]["loss_mask"])
        ref = self.reference_logps(model, batch)
        labels = batch["labels"]
        n = labels.shape[0]
        out = kto_loss(
            logps,
            ref[:n],
            labels,
            kl_logps,
            ref[n:],
            c.beta,
            c.desirable_weight,
            c.undesirable_weight,
            reduce_kl=self._reduce_kl(),
        )
        chosen, rejected = _class_mean(out.rewards, labels), _class_mean(out.rewards, ~labels)
        metrics = {
            "kl": out.kl.item(),
            "count/desirable": labels.float().mean().item(),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "logps/chosen": _class_mean(logps.detach(), labels),
            "logps/rejected": _class_mean(logps.detach(), ~labels),
        }
        return LossOutput(loss_sum=out.losses.sum(), count=n, metrics=metrics)
