"""Our side of the benchmark: verl_core's trainers through their public API, speed features on.

Features used (each switchable in :class:`harness.BenchSpec`): bf16 autocast (the engine's
``mixed_precision``), padding-free packing with a shared prompt per pair (``verl_core.packing``),
precomputed reference log-probs with the reference freed (``precompute_ref_logps``), chunked
per-token log-probs (always), and the KV-cached rollout with early stop (GRPO, always).
"""
from __future__ import annotations

import contextlib
from typing import Any

from harness import BenchSpec, StepClock, model_path, rows_for

from verl_core.callbacks import Callback


class _Clock(Callback):
    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_train_begin(self, params: dict[str, Any]) -> None:
        self.clock.mark("train_begin")

    def on_step_end(self, step: int) -> None:
        self.clock.tick()


def _common(spec: BenchSpec) -> dict[str, Any]:
    return {"batch_size": spec.batch_size, "max_steps": spec.total_steps, "learning_rate": spec.learning_rate,
            "mixed_precision": "bf16" if spec.dtype == "bf16" else "no", "seed": spec.seed, "progress": False,
            "logging_steps": spec.total_steps, "lr_scheduler": "constant"}


def packing_wired() -> bool:
    """True once the trainers' configs have the ``packing`` switch (see bench/README.md)."""
    from verl_core.algorithms.sft import SFTConfig

    return "packing" in SFTConfig.model_fields


def _packing_overrides(spec: BenchSpec, config_cls, pairs: bool) -> dict[str, Any]:
    if not spec.packing:
        return {}
    out: dict[str, Any] = {"packing": True}
    fields = config_cls.model_fields
    if "packing_row_tokens" in fields:
        out["packing_row_tokens"] = spec.resolved_row_capacity()
    if pairs and "share_prompt" in fields:
        out["share_prompt"] = spec.share_prompt
    return out


@contextlib.contextmanager
def _unwired_packing(spec: BenchSpec):
    """Until the trainers have ``packing=``: the same dispatch installed for this process only.

    The trainers' modules import ``model_token_logprobs`` / ``pair_rewards`` by name; here they
    are swapped for the packed-aware versions from ``verl_core.packing`` (identical on padded
    batches), and the trainer subclasses in :func:`_trainer_classes` collate packed batches.
    """
    import verl_core.algorithms.dpo as dpo
    import verl_core.algorithms.kto as kto
    import verl_core.algorithms.preference as preference
    import verl_core.algorithms.reward_model as reward_model
    import verl_core.algorithms.sft as sft
    from verl_core import packing

    original_pair_rewards = reward_model.pair_rewards

    def pair_rewards(model, batch):
        return packing.packed_pair_rewards(model, batch) if packing.is_packed(batch) else original_pair_rewards(model, batch)

    saved = [(m, "model_token_logprobs", m.model_token_logprobs) for m in (sft, dpo, kto, preference)]
    saved.append((reward_model, "pair_rewards", original_pair_rewards))
    for m, name, _ in saved[:-1]:
        setattr(m, name, packing.token_logprobs_any)
    reward_model.pair_rewards = pair_rewards
    try:
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


def _trainer_classes(spec: BenchSpec, wired: bool):
    from verl_core.algorithms.dpo import DPOTrainer
    from verl_core.algorithms.kto import KTOTrainer
    from verl_core.algorithms.reward_model import RewardTrainer
    from verl_core.algorithms.sft import SFTTrainer

    if wired or not spec.packing:
        return SFTTrainer, RewardTrainer, DPOTrainer, KTOTrainer
    import torch

    from verl_core import packing
    from verl_core.algorithms.preference import attach_reference

    cap, share = spec.resolved_row_capacity(), spec.share_prompt

    class PackedSFT(SFTTrainer):
        def collate(self, examples):
            return packing.collate_packed_sft(examples, self.tokenizer.pad_token_id, row_capacity=cap)

    class PackedRM(RewardTrainer):
        def collate(self, examples):
            batch = packing.collate_packed_pairs(examples, self.tokenizer.pad_token_id, share, cap)
            if self.config.margin is not None:
                batch["margin"] = torch.full((len(examples),), float(self.config.margin))
            return batch

    class PackedDPO(DPOTrainer):
        def collate(self, examples):
            return attach_reference(packing.collate_packed_pairs(examples, self.tokenizer.pad_token_id, share, cap), examples)

    class PackedKTO(KTOTrainer):
        def collate(self, examples):
            return attach_reference(packing.collate_packed_kto(examples, self.tokenizer.pad_token_id, share, cap), examples)

    return PackedSFT, PackedRM, PackedDPO, PackedKTO


def _fp32_attention(spec: BenchSpec, model) -> str | None:
    """SDPA in fp32 under CPU autocast (a no-op where the engine already does it, or on GPU)."""
    if not (spec.fp32_cpu_attention and spec.dtype == "bf16" and spec.resolved_device() == "cpu"):
        return None
    from verl_core import packing

    if packing.attn_implementation(model) == packing.FP32_CPU_SDPA:
        return "fp32 SDPA on CPU"
    return "fp32 SDPA on CPU [bench-local wiring]" if packing.use_fp32_cpu_attention(model) else None


def run(algo: str, spec: BenchSpec, clock: StepClock) -> dict[str, Any]:
    path = str(model_path(spec))
    rows = rows_for(algo, spec)
    callbacks = [_Clock(clock)]
    common = _common(spec)
    if algo == "grpo":
        from verl_core.algorithms.grpo import GRPOConfig, GRPOTrainer

        wired = "packing" in GRPOConfig.model_fields
        extra = {"packing": True} if wired and spec.packing else {}
        cfg = GRPOConfig(**common, **extra, num_generations=spec.num_generations, max_new_tokens=spec.max_completion_length,
                         temperature=spec.temperature, max_prompt_length=spec.max_prompt_length)
        cls = GRPOTrainer
        if spec.packing and not wired:
            from verl_core import packing

            class SharedPromptGRPO(GRPOTrainer):  # until OnlineTrainer.forward has the packing switch
                def forward(self, model, batch):
                    return packing.packed_response_logits(model, batch, self.policy.tokenizer.pad_token_id), None

            cls = SharedPromptGRPO
        trainer = cls(policy=path, config=cfg, prompts=rows, callbacks=callbacks)
        attention = _fp32_attention(spec, trainer.policy.model)
        clock.mark("setup_done")
        trainer.train()
        shared = ("shared-prompt update (one prompt per group)" + ("" if wired else " [bench-local wiring]")
                  if spec.packing else None)
        return {"features": ", ".join(filter(None, ["bf16 autocast" if spec.dtype == "bf16" else "fp32", attention,
                                                    "KV-cached batched rollout with early stop",
                                                    "logits only at response positions", shared]))}

    wired = packing_wired()
    sft_cls, rm_cls, dpo_cls, kto_cls = _trainer_classes(spec, wired)
    lengths = {"max_length": spec.max_length, "max_prompt_length": spec.max_prompt_length}
    if algo == "sft":
        trainer = sft_cls(path, train_dataset=rows, callbacks=callbacks, **common, **lengths,
                          **(_packing_overrides(spec, sft_cls.config_cls, False) if wired else {}))
    elif algo == "rm":
        trainer = rm_cls(path, train_dataset=rows, callbacks=callbacks, **common, **lengths,
                         **(_packing_overrides(spec, rm_cls.config_cls, True) if wired else {}))
    elif algo in ("dpo", "kto"):
        cls = dpo_cls if algo == "dpo" else kto_cls
        trainer = cls(path, train_dataset=rows, callbacks=callbacks, **common, **lengths, beta=spec.beta,
                      precompute_ref_logps=spec.precompute_ref,
                      **(_packing_overrides(spec, cls.config_cls, True) if wired else {}))
    else:
        raise ValueError(algo)
    attention = _fp32_attention(spec, trainer.model)
    clock.mark("setup_done")
    ctx = _unwired_packing(spec) if spec.packing and not wired else contextlib.nullcontext()
    with ctx:
        trainer.train()
    features = ["bf16 autocast" if spec.dtype == "bf16" else "fp32", "chunked log-probs"] + ([attention] if attention else [])
    if spec.packing:
        features.append(f"packing (row capacity {spec.resolved_row_capacity()}"
                        + (", shared prompt" if algo != "sft" and spec.share_prompt else "") + ")"
                        + ("" if wired else " [bench-local wiring]"))
    if algo in ("dpo", "kto") and spec.precompute_ref:
        features.append("precomputed reference, freed")
    return {"features": ", ".join(features)}
