"""TRL's side of the benchmark: TRL's own trainers, called as a baseline (TRL is a bench-only
dependency: ``pip install -e '.[bench]'``). TRL's defaults are kept except what must match ours:
model, rows, batch size, max lengths, dtype (bf16 autocast over fp32 weights), steps, learning
rate, seed, and no gradient checkpointing (TRL turns it on by default; ours is off)."""
from __future__ import annotations

import tempfile
from typing import Any

from harness import BenchSpec, StepClock, model_path, rows_for


def _clock_callback(clock: StepClock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.mark("train_begin")

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    return Clock()


def _args(spec: BenchSpec, out: str) -> dict[str, Any]:
    cpu = spec.resolved_device() == "cpu"
    return {"output_dir": out, "per_device_train_batch_size": spec.batch_size, "gradient_accumulation_steps": 1,
            "max_steps": spec.total_steps, "learning_rate": spec.learning_rate, "lr_scheduler_type": "constant",
            "bf16": spec.dtype == "bf16", "use_cpu": cpu, "gradient_checkpointing": False, "seed": spec.seed,
            "logging_steps": spec.total_steps, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
            "dataloader_num_workers": 0, "max_grad_norm": 1.0}


def run(algo: str, spec: BenchSpec, clock: StepClock) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    path = str(model_path(spec))
    tok = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_list(rows_for(algo, spec))
    callbacks = [_clock_callback(clock)]
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        args = _args(spec, out)
        if algo == "sft":
            trainer = trl.SFTTrainer(model=path, args=trl.SFTConfig(**args, max_length=spec.max_length),
                                     train_dataset=data, processing_class=tok, callbacks=callbacks)
        elif algo == "rm":
            trainer = trl.RewardTrainer(model=path, args=trl.RewardConfig(**args, max_length=spec.max_length),
                                        train_dataset=data, processing_class=tok, callbacks=callbacks)
        elif algo == "dpo":
            cfg = trl.DPOConfig(**args, max_length=spec.max_length, beta=spec.beta,
                                precompute_ref_log_probs=spec.trl_precompute_ref)
            trainer = trl.DPOTrainer(model=path, args=cfg, train_dataset=data, processing_class=tok, callbacks=callbacks)
        elif algo == "kto":
            cfg = trl.KTOConfig(**args, max_length=spec.max_length, beta=spec.beta,
                                precompute_ref_log_probs=spec.trl_precompute_ref)
            trainer = trl.KTOTrainer(model=path, args=cfg, train_dataset=data, processing_class=tok, callbacks=callbacks)
        elif algo == "grpo":
            from verl_core.rewards.rules import exact_match  # the same rule our GRPO uses by default

            def exact_match_reward(prompts, completions, ground_truth, **_):
                return exact_match(completions, ground_truth)

            cfg = trl.GRPOConfig(**args, num_generations=spec.num_generations,
                                 max_completion_length=spec.max_completion_length, temperature=spec.temperature,
                                 beta=0.0)
            trainer = trl.GRPOTrainer(model=path, reward_funcs=[exact_match_reward], args=cfg, train_dataset=data,
                                      processing_class=tok, callbacks=callbacks)
        else:
            raise ValueError(algo)
        clock.mark("setup_done")
        trainer.train()
    return {"features": f"trl {trl.__version__} defaults"
            + (", precompute_ref_log_probs" if spec.trl_precompute_ref and algo in ("dpo", "kto") else "")}
