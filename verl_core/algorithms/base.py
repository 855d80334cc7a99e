"""What every offline algorithm shares: config merge, model loading, tokenization, the
engine run, and an atomic save of the final model. An algorithm overrides four small
methods: ``load_model``, ``tokenize``, ``collate`` and ``loss``."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field

from verl_core.algorithms.speed import describe, resolve_speed
from verl_core.config import ConfigError, StrictConfig
from verl_core.errors import TrainingError
from verl_core.modeling.loading import check_fits_context, load_causal_lm, load_tokenizer, save_pretrained_atomic
from verl_core.train.batches import steps_for
from verl_core.train.callbacks import Callback
from verl_core.train.config import TrainConfig
from verl_core.train.engine import Engine, LossOutput, TrainResult

FINAL_MODEL_DIR = "model"
log = logging.getLogger("verl_core")


class PackingSettings(StrictConfig):
    """Padding-free batches (:mod:`verl_core.modeling.packed_forward`): sequences laid end to end with their own
    position ids and a block-diagonal causal mask, so no pad token is computed. Losses equal
    the padded layout's (tests/test_packing.py)."""

    packing: bool = Field(
        True,
        description="padding-free packed batches (the default fast path); False: padded rows. "
        "A model whose attention takes no packed mask falls back to padded rows",
    )
    packing_row_tokens: Annotated[int, Field(ge=1)] | Literal["longest"] | None = Field(
        "longest",
        description="tokens per packed row: 'longest' = the batch's longest sequence (no row attends over "
        "more than padding would), a number, or null for one row",
    )
    prune_last_layer: bool = Field(
        True,
        description="with packing: the last decoder layer runs o_proj and its MLP only "
        "where the loss reads a logit or score (verl_core.modeling.forward.PRUNABLE_LAYERS; "
        "other models run it in full)",
    )


class LMHeadSettings(StrictConfig):
    """How token log-probs are computed from the policy's last hidden states."""

    fused_lm_head: bool = Field(
        True,
        description="log-probs straight from the last hidden states, the LM head and the log-softmax fused per chunk of "
        "rows (verl_core.modeling.lm_head; models of verl_core.modeling.forward.FUSED_HEAD_MODELS, others use their logits)",
    )


class PairPackingSettings(PackingSettings):
    """:class:`PackingSettings` for batches of two completions per prompt (pairs, KTO's KL rows)."""

    share_prompt: bool = Field(
        True,
        description="with packing: each prompt computed once, both completions branch "
        "from it (prefix sharing; sdpa or eager attention, else it falls back)",
    )


def resolve_config(config_cls: type[TrainConfig], config: TrainConfig | dict | None, overrides: dict[str, Any]) -> TrainConfig:
    """A typed config from an object, a dict, and/or keyword overrides (unknown keys rejected)."""
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, dict):
        base = dict(config)
    elif isinstance(config, config_cls):
        base = config.model_dump(exclude_unset=True)
    else:
        raise ConfigError(f"config must be a {config_cls.__name__} or a dict, got {type(config).__name__}")
    return config_cls.from_dict({**base, **overrides}, source=f"{config_cls.__name__} arguments")


class OfflineTrainer:
    """Trains on a fixed dataset with the shared :class:`Engine`."""

    config_cls: ClassVar[type[TrainConfig]] = TrainConfig
    needs_score_head: ClassVar[bool] = False  # a reward model: packing reads its per-token score head

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        config: TrainConfig | dict | None = None,
        callbacks: Sequence[Callback] = (),
        **overrides: Any,
    ):
        self.config = resolve_config(self.config_cls, config, overrides)
        if train_dataset is None:
            raise ConfigError(f"{type(self).__name__} needs a train_dataset")
        self.model_source = str(model) if isinstance(model, (str, os.PathLike)) else None
        if tokenizer is None:
            if self.model_source is None:
                raise ConfigError("pass a tokenizer when the model is an object, not a path")
            tokenizer = load_tokenizer(self.model_source)
        self.tokenizer = tokenizer
        # Validate and tokenize before any model is built, so bad data fails fast.
        self.train_examples = self.tokenize(train_dataset)
        self.eval_examples = self.tokenize(eval_dataset) if eval_dataset is not None else None
        self._fit_batch_to_data()
        torch.manual_seed(self.config.seed)
        self.model = self.load_model(self.model_source) if self.model_source else model
        check_fits_context(self.model, self.train_examples, name=self.model_source)
        self.config, self.speed_features = resolve_speed(self.model, self.config, type(self).__name__, self.needs_score_head)
        self.callbacks = list(callbacks)
        self.engine: Engine | None = None

    def _fit_batch_to_data(self) -> None:
        """Fewer rows than ``batch_size``: an error naming both, or with ``shrink_batch_to_data`` batches of what there is."""
        c, n = self.config, len(self.train_examples)
        if n >= c.batch_size:
            return
        if not c.shrink_batch_to_data:
            raise TrainingError(
                f"the dataset has {n} rows, fewer than batch_size {c.batch_size}: give more rows, a smaller batch_size, "
                "or shrink_batch_to_data: true to train on batches of what there is"
            )
        from accelerate import PartialState

        world = PartialState().num_processes
        accum = c.gradient_accumulation_steps if n >= world * c.gradient_accumulation_steps else 1
        size = n - n % (world * accum)
        if size == 0:
            raise TrainingError(f"the dataset has {n} rows, too few to give each of {world} processes one")
        log.warning(
            "%s: the dataset has %d rows, fewer than batch_size %d; training on batches of %d",
            type(self).__name__,
            n,
            c.batch_size,
            size,
        )
        self.config = c.model_copy(update={"batch_size": size, "gradient_accumulation_steps": accum})

    # -- what an algorithm provides --------------------------------------------------------
    def load_model(self, path: str):
        return load_causal_lm(path, gradient_checkpointing=self.config.gradient_checkpointing)

    def tokenize(self, rows: Any) -> list[dict]:
        raise NotImplementedError

    def collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def loss(self, model, batch: dict[str, torch.Tensor]) -> LossOutput:
        raise NotImplementedError

    def evaluate(self, model) -> dict[str, float]:
        """Eval metrics on ``eval_examples`` (default: the mean loss, no gradients)."""
        if not self.eval_examples:
            return {}
        was_training = model.training
        model.eval()
        totals: dict[str, float] = {}
        count = 0.0
        bs = max(1, self.config.batch_size // self.config.gradient_accumulation_steps)
        with torch.no_grad():
            for start in range(0, len(self.eval_examples), bs):
                batch = self.collate(self.eval_examples[start : start + bs])
                out = self.loss(model, batch)
                c = float(out.count)
                count += c
                totals["loss"] = totals.get("loss", 0.0) + float(out.loss_sum)
                for k, v in out.metrics.items():
                    totals[k] = totals.get(k, 0.0) + float(v) * c
        model.train(was_training)
        return {f"eval/{k}": v / count for k, v in totals.items()}

    def before_training(self, engine: Engine) -> None:
        """Hook run after the engine exists and before the first step (e.g. precompute references)."""

    # -- the run -----------------------------------------------------------------------------
    def train(self) -> TrainResult:
        total = steps_for(self.config, len(self.train_examples))
        self.engine = Engine(self.model, self.config, self.callbacks, total_steps=total)
        if self.engine.is_main:  # before the hook: a reference pass can take minutes
            log.info("%s: %s", type(self).__name__, describe(self.speed_features))
        self.before_training(self.engine)
        speed = {f"speed/{k}": v for k, v in self.speed_features.items() if k != "fallbacks"}
        result = self.engine.fit(
            self.train_examples,
            self.collate,
            self.loss,
            eval_fn=self.evaluate if self.eval_examples else None,
            params={"algorithm": type(self).__name__, **speed},
            desc=type(self).__name__,
        )
        if self.config.output_dir and self.engine.is_main:
            final = save_pretrained_atomic(self.engine.unwrapped, self.tokenizer, Path(self.config.output_dir) / FINAL_MODEL_DIR)
            result.output_dir = str(final)
        self.engine.accelerator.wait_for_everyone()
        return result

    def save_model(self, path: str | os.PathLike) -> Path:
        model = self.engine.unwrapped if self.engine else self.model
        return save_pretrained_atomic(model, self.tokenizer, path)
