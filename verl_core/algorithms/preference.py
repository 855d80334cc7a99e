"""What the preference trainers (DPO family, KTO) share: the reference model.

Every example has two rows, a *first* and a *second* (DPO: chosen | rejected, one
collated batch of ``2B`` rows, so one forward pass scores both; KTO: target | KL pair,
the KL rows in a batch of their own under ``batch["kl"]``). The reference log-probs are
``[2B]``, first halves then second halves; each comes from, in this order:

1. ``batch["ref_logps"]`` when it was precomputed (``precompute_ref_logps``; "auto", the default,
   precomputes whenever the run reads every example at least once):
   before the first step, every example gets ``ref_logps = (first, second)``, the
   summed completion log-probs of its two rows under the reference, computed once,
   batched, without gradients; the reference model is then freed (``del`` + ``gc``).
2. an explicit ``ref_model`` (a model object or a folder), frozen;
3. with a peft (LoRA) policy: the policy itself inside ``disable_adapter()``, so no
   second copy of the weights ever exists;
4. otherwise a frozen copy of the starting policy: loaded again from the same folder
   when ``model`` is a path, else ``copy.deepcopy(model)`` in eval mode with
   ``requires_grad=False``. With precomputation and no explicit reference no copy
   is made at all: the policy *is* the reference before its first update, so the
   reference log-probs are taken from it (in eval mode) before training starts.

Reference forwards run under the engine's autocast, so a bf16 run scores policy and
reference at the same precision.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from verl_core.algorithms.base import LMHeadSettings, OfflineTrainer, PairPackingSettings
from verl_core.config import ConfigError
from verl_core.data.formats import LongPromptPolicy
from verl_core.losses.preference import sequence_logps
from verl_core.modeling.loading import LoraSettings, is_peft, load_causal_lm
from verl_core.modeling.packed_forward import model_token_logprobs
from verl_core.train.batches import steps_for, to_device
from verl_core.train.config import TrainConfig
from verl_core.train.engine import Engine
from verl_core.train.precision import allow_precision_change
from verl_core.train.progress import progress_bar

REF_KEY = "ref_logps"


class PreferenceConfig(TrainConfig, PairPackingSettings, LMHeadSettings):
    """Settings shared by the DPO family and KTO."""

    learning_rate: float = Field(5e-6, gt=0)
    beta: float = Field(0.1, gt=0, description="strength of the implicit KL to the reference (DPO β, KTO β, SimPO β)")
    max_length: int = Field(512, ge=2)
    max_prompt_length: int | None = None
    on_long_prompt: LongPromptPolicy = "error"
    precompute_ref_logps: bool | Literal["auto"] = Field(
        "auto",
        description="score every example under the reference once before training, then free it. 'auto': "
        "when the run reads every example at least once (steps x batch_size >= rows), where it "
        "costs no extra forward pass and frees the reference's memory; else on the fly",
    )
    lora: LoraSettings | None = Field(
        None, description="train LoRA adapters (model given as a path); the reference is the adapter-disabled base"
    )


def attach_reference(batch: dict[str, torch.Tensor], examples: list[dict]) -> dict[str, torch.Tensor]:
    """Add ``batch["ref_logps"]`` ``[2B]`` (first halves, then second halves) when every example has them."""
    if examples and all(REF_KEY in e for e in examples):
        batch[REF_KEY] = torch.tensor([e[REF_KEY][0] for e in examples] + [e[REF_KEY][1] for e in examples], dtype=torch.float32)
    return batch


def pair_metrics(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor
) -> dict[str, float]:
    """Per-pair means of the implicit rewards and summed completion log-probs."""
    return {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "logps/chosen": chosen_logps.detach().mean().item(),
        "logps/rejected": rejected_logps.detach().mean().item(),
    }


class PreferenceTrainer(OfflineTrainer):
    """An :class:`OfflineTrainer` with a reference model (see the module docstring).

    Subclasses provide ``tokenize`` / ``collate`` (two rows per example, the batch
    passed through :func:`attach_reference`) and ``loss``, which calls
    :meth:`reference_logps` for the reference side.
    """

    config_cls: ClassVar[type[TrainConfig]] = PreferenceConfig
    config: PreferenceConfig

    def __init__(self, model: Any, *args: Any, ref_model: Any = None, **kwargs: Any):
        """:class:`OfflineTrainer`'s arguments, plus ``ref_model``: the frozen reference (a model, a path, or
        None for the one :meth:`_resolve_reference` picks)."""
        super().__init__(model, *args, **kwargs)
        if self.model_source is None and self.config.lora is not None and not is_peft(self.model):
            raise ConfigError("lora= applies when the model is given as a path; wrap a model object with peft yourself")
        self._precomputing = False
        self.precompute = self._should_precompute()
        if self.uses_reference:
            self.speed_features["precompute_ref_logps"] = self.precompute
        self.ref_model = self._resolve_reference(ref_model)

    def train(self):
        allow_precision_change(self.config.mixed_precision)
        return super().train()

    def _should_precompute(self) -> bool:
        """Resolve ``precompute_ref_logps``. Precomputing costs one reference forward per example up
        front; scoring on the fly costs one per example *read*. So it pays (and frees the reference's
        memory) once the run reads at least as many examples as there are; a run over part of a large
        dataset scores only what it reads."""
        c = self.config
        if c.precompute_ref_logps != "auto":
            return bool(c.precompute_ref_logps)
        return steps_for(c, len(self.train_examples)) * c.batch_size >= len(self.train_examples)

    # -- which reference ---------------------------------------------------------------------
    @property
    def uses_reference(self) -> bool:
        """False for reference-free losses (SimPO, ORPO): no reference is loaded at all."""
        return True

    def load_model(self, path: str):
        return load_causal_lm(path, gradient_checkpointing=self.config.gradient_checkpointing, lora=self.config.lora)

    def _resolve_reference(self, ref_model: Any) -> torch.nn.Module | None:
        """The separate frozen reference model, or None when none is needed (see module docstring)."""
        if not self.uses_reference:
            if ref_model is not None:
                raise ConfigError(f"{type(self).__name__} with this loss is reference-free; do not pass ref_model")
            return None
        if isinstance(ref_model, (str, os.PathLike)):
            return load_causal_lm(str(ref_model), trainable=False)
        if ref_model is not None:
            return ref_model.eval().requires_grad_(False)
        if is_peft(self.model) or self.precompute:
            return None
        if self.model_source is not None:
            return load_causal_lm(self.model_source, trainable=False)
        return copy.deepcopy(self.model).eval().requires_grad_(False)

    # -- reference log-probs -----------------------------------------------------------------
    def _autocast(self):
        return self.engine.accelerator.autocast() if self.engine is not None else contextlib.nullcontext()

    def _unwrap(self, model):
        return self.engine.accelerator.unwrap_model(model) if self.engine is not None else model

    @torch.no_grad()
    def reference_logps(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed completion log-probs ``[2B]`` of every row of ``batch`` under the reference."""
        if REF_KEY in batch:
            return batch[REF_KEY].to(batch["input_ids"].device)
        with self._autocast():
            if self.ref_model is not None:
                token_lps = model_token_logprobs(self.ref_model, batch)
            elif is_peft(self._unwrap(model)):
                policy = self._unwrap(model)
                with policy.disable_adapter():
                    token_lps = model_token_logprobs(policy, batch)
            elif self._precomputing:
                token_lps = model_token_logprobs(self._unwrap(model), batch)  # the untouched starting policy
            else:
                raise RuntimeError("no reference model: it was freed after precomputing, yet a batch lacks ref_logps")
        return sequence_logps(token_lps.float(), batch["loss_mask"])

    def before_training(self, engine: Engine) -> None:
        """Move the reference to the device; with ``precompute_ref_logps``, score every example and free it."""
        if not self.uses_reference:
            return
        if self.ref_model is not None:
            self.ref_model.to(engine.accelerator.device)
        if self.precompute:
            self.precompute_reference(engine.model, self.train_examples)
            if self.eval_examples:
                self.precompute_reference(engine.model, self.eval_examples)
            self.free_reference()

    def precompute_reference(self, model, examples: list[dict]) -> None:
        """Store ``ref_logps = (first, second)`` on every example, one micro-batch at a time."""
        policy = self._unwrap(model)
        was_training = policy.training
        policy.eval()
        self._precomputing = True
        device = next(policy.parameters()).device
        # one training micro-batch at a time: the same chunks (so the same packed layouts, the same float
        # results) whether the micro-batches of a step run in one process or are spread over several
        processes = self.engine.accelerator.num_processes if self.engine is not None else 1
        size = max(1, self.config.batch_size // (self.config.gradient_accumulation_steps * processes))
        # minutes on a real model before the first step: a user sees it move
        show = self.engine is None or (self.engine.config.progress and self.engine.is_main)
        bar = progress_bar(len(examples), desc="reference log-probs", unit="example", disable=not show)
        try:
            for start in range(0, len(examples), size):
                chunk = [{k: v for k, v in e.items() if k != REF_KEY} for e in examples[start : start + size]]
                batch = to_device(self.collate(chunk), device)
                logps = self.reference_logps(model, batch).cpu().tolist()
                for i, example in enumerate(examples[start : start + size]):
                    example[REF_KEY] = (logps[i], logps[len(chunk) + i])
                bar.update(len(chunk))
        finally:
            bar.close()
            self._precomputing = False
            policy.train(was_training)

    def free_reference(self) -> None:
        """Drop the separate reference model and return its memory."""
        if self.ref_model is None:
            return
        self.ref_model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
