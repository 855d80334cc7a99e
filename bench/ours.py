"""Our side of the benchmark: verl_core's trainers through their public API, speed features on.

Features used (each switchable in :class:`harness.BenchSpec`): bf16 autocast (the engine's
``mixed_precision``), padding-free packing with a shared prompt per pair (``verl_core.modeling.packed_forward``),
precomputed reference log-probs with the reference freed (``precompute_ref_logps``), chunked
per-token log-probs (always), and the KV-cached rollout with early stop (GRPO, always).
"""
from __future__ import annotations

from typing import Any

from harness import BenchSpec, StepClock, model_path, rows_for

from verl_core.train.callbacks import Callback


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


def _packing_overrides(spec: BenchSpec, pairs: bool) -> dict[str, Any]:
    if not spec.packing:
        return {}
    out: dict[str, Any] = {"packing": True, "packing_row_tokens": spec.resolved_row_capacity(),
                           "prune_last_layer": spec.prune_last_layer}
    if pairs:
        out["share_prompt"] = spec.share_prompt
    return out


def _fp32_attention(spec: BenchSpec, model) -> str | None:
    """SDPA in fp32 under CPU autocast (a no-op where the engine already does it, or on GPU)."""
    if not (spec.fp32_cpu_attention and spec.dtype == "bf16" and spec.resolved_device() == "cpu"):
        return None
    from fp32_attention import FP32_CPU_SDPA, use_fp32_cpu_attention

    from verl_core.modeling.forward import attn_implementation

    if attn_implementation(model) == FP32_CPU_SDPA:
        return "fp32 SDPA on CPU"
    return "fp32 SDPA on CPU (fp32_attention.use_fp32_cpu_attention)" if use_fp32_cpu_attention(model) else None


def run(algo: str, spec: BenchSpec, clock: StepClock) -> dict[str, Any]:
    path = str(model_path(spec))
    rows = rows_for(algo, spec)
    callbacks = [_Clock(clock)]
    common = _common(spec)
    if algo == "grpo":
        from verl_core.algorithms.grpo import GRPOConfig, GRPOTrainer

        cfg = GRPOConfig(**common, packing=spec.packing, prune_last_layer=spec.prune_last_layer, num_generations=spec.num_generations,
                         max_new_tokens=spec.max_completion_length, temperature=spec.temperature,
                         max_prompt_length=spec.max_prompt_length)
        trainer = GRPOTrainer(policy=path, config=cfg, prompts=rows, callbacks=callbacks)
        attention = _fp32_attention(spec, trainer.policy.model)
        clock.mark("setup_done")
        trainer.train()
        shared = ("shared-prompt update (packing=True: one prompt per group"
                  + (", last layer only at response positions)" if spec.prune_last_layer else ")") if spec.packing else None)
        return {"features": ", ".join(filter(None, ["bf16 autocast" if spec.dtype == "bf16" else "fp32", attention,
                                                    "KV-cached batched rollout with early stop",
                                                    "logits only at response positions", shared]))}

    from verl_core.algorithms.dpo import DPOTrainer
    from verl_core.algorithms.kto import KTOTrainer
    from verl_core.algorithms.reward_model import RewardTrainer
    from verl_core.algorithms.sft import SFTTrainer

    lengths = {"max_length": spec.max_length, "max_prompt_length": spec.max_prompt_length}
    if algo == "sft":
        trainer = SFTTrainer(path, train_dataset=rows, callbacks=callbacks, **common, **lengths, **_packing_overrides(spec, False))
    elif algo == "rm":
        trainer = RewardTrainer(path, train_dataset=rows, callbacks=callbacks, **common, **lengths, **_packing_overrides(spec, True))
    elif algo in ("dpo", "kto"):
        cls = DPOTrainer if algo == "dpo" else KTOTrainer
        trainer = cls(path, train_dataset=rows, callbacks=callbacks, **common, **lengths, beta=spec.beta,
                      precompute_ref_logps=spec.precompute_ref, **_packing_overrides(spec, True))
    else:
        raise ValueError(algo)
    attention = _fp32_attention(spec, trainer.model)
    clock.mark("setup_done")
    trainer.train()
    features = ["bf16 autocast" if spec.dtype == "bf16" else "fp32", "chunked log-probs"] + ([attention] if attention else [])
    if spec.packing:
        features.append(f"packing=True (row capacity {spec.resolved_row_capacity()}"
                        + (", shared prompt" if algo != "sft" and spec.share_prompt else "")
                        + (", last layer only where read" if spec.prune_last_layer else "") + ")")
    if algo in ("dpo", "kto") and spec.precompute_ref:
        features.append("precomputed reference, freed")
    return {"features": ", ".join(features)}
