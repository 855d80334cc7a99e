"""The three sides of the realistic bench, each called in its own child process by ``bench/child.py``.

- ``run_ours``: verl_core's trainers with their DEFAULT arguments: only what defines the work is
  passed (batch, steps, lengths, learning rate, β, seed, dtype, GRPO's group shape and reward),
  never a speed switch (packing, share_prompt, precompute_ref_logps, prune_last_layer, row
  capacity). The settings the trainer resolved are recorded, so the table says what ran.
- ``run_trl`` with ``spec.trl_best`` False: TRL's defaults, except what must match ours (batch,
  steps, lengths, learning rate, seed, dtype, no gradient checkpointing: TRL turns it on by
  default, ours is off, as in the toy bench).
- ``run_trl`` with ``spec.trl_best`` True: the fastest settings TRL 1.16 offers on one CPU/GPU
  process: SFT ``padding_free=True`` (its collator flattens the batch into one row with position
  ids; TRL then requires ``max_length=None``: the rows are pre-filtered to fit 512 tokens, so
  nothing would be truncated anyway); DPO and KTO ``precompute_ref_log_probs=True`` (DPO's
  ``padding_free`` exists but TRL 1.16 disables it with a warning); GRPO
  ``use_transformers_paged=True`` (transformers' continuous-batching generation; vLLM is GPU-only:
  at shape a it took a step from 36 to 19 s with 2 threads on 2 busy cores, but from 11 to 16 s
  with 1 thread); the reward model has no such option and runs as the defaults. Since TRL's
  defaults are among its settings, the table's "TRL best" is the faster of the two runs.

Timing (``harness.StepClock``): ``setup_done`` is marked after the trainer is built, just before
``train()``; then one tick per optimizer step. ``epoch_s`` runs from ``train()`` to the last step
(our reference precompute happens inside ``train()``) plus TRL's reference precompute, which TRL
runs in its constructor (timed by wrapping ``_precompute_ref_logps``). Model loading and
tokenization are outside ``epoch_s`` on both sides and inside ``first_step_s`` (process start to
the end of the first optimizer step) on both sides.
"""
from __future__ import annotations

import functools
import tempfile
import time
from typing import Any

from harness import StepClock
from realistic_models import RealSpec, model_path, rows_for

OUR_SPEED_FIELDS = ("mixed_precision", "packing", "packing_row_tokens", "share_prompt", "prune_last_layer",
                    "precompute_ref_logps", "gradient_checkpointing", "generation_batch_size")
GRPO_REWARD = "numeric_match"  # the final number of the completion equals the GSM8K answer


def _timed(owner: type, name: str, spans: list[tuple[float, float]]) -> None:
    """Wrap ``owner.name`` so that every call appends its (start, end) ``perf_counter`` to ``spans`` (no-op if absent)."""
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spans.append((t, time.perf_counter()))

    setattr(owner, name, wrapper)


def _timing(spans: list[tuple[float, float]], clock: StepClock) -> dict[str, float]:
    """``epoch_s``: what a user waits for from the ``train()`` call (``setup_done``) to the last step, plus a
    reference precompute done before it (TRL's, in its constructor); ``precompute_s``: all reference passes;
    ``first_step_s``: process start to the end of the first optimizer step."""
    import psutil

    call = clock.marks["setup_done"]
    before = sum(min(end, call) - start for start, end in spans if start < call)
    unix = time.time() - time.perf_counter()
    return {"epoch_s": clock.ticks[-1] - call + before, "precompute_s": sum(end - start for start, end in spans),
            "first_step_s": clock.ticks[0] + unix - psutil.Process().create_time(),
            "after_first_step_s": clock.ticks[-1] - clock.ticks[0]}


def _tokenizer(spec: RealSpec):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path(spec))


# -- ours ----------------------------------------------------------------------------------------
def run_ours(algo: str, spec: RealSpec, clock: StepClock) -> dict[str, Any]:
    from verl_core.algorithms import preference
    from verl_core.train.callbacks import Callback

    class Clock(Callback):
        def on_train_begin(self, params):
            clock.mark("train_begin")

        def on_step_end(self, step):
            clock.tick()

    path = str(model_path(spec))
    rows = rows_for(algo, spec, _tokenizer(spec))
    precompute: list[tuple[float, float]] = []
    _timed(preference.PreferenceTrainer, "precompute_reference", precompute)
    common = {"max_steps": spec.total_steps, "learning_rate": spec.learning_rate, "seed": spec.seed, "progress": False,
              "logging_steps": spec.total_steps, "lr_scheduler": "constant",
              "mixed_precision": "bf16" if spec.dtype == "bf16" else "no"}
    callbacks = [Clock()]
    if algo == "grpo":
        from verl_core.algorithms.grpo import GRPOTrainer

        trainer = GRPOTrainer(policy=path, prompts=rows, callbacks=callbacks, batch_size=spec.grpo_batch,
                              num_generations=spec.num_generations, max_new_tokens=spec.max_completion_length,
                              temperature=spec.temperature, max_prompt_length=spec.max_prompt_length,
                              reward_rules={GRPO_REWARD: 1.0}, rollout={"backend": spec.rollout_backend}, **common)
    else:
        from verl_core.algorithms.dpo import DPOTrainer
        from verl_core.algorithms.kto import KTOTrainer
        from verl_core.algorithms.reward_model import RewardTrainer
        from verl_core.algorithms.sft import SFTTrainer

        cls = {"sft": SFTTrainer, "rm": RewardTrainer, "dpo": DPOTrainer, "kto": KTOTrainer}[algo]
        extra = {"beta": spec.beta} if algo in ("dpo", "kto") else {}
        trainer = cls(path, train_dataset=rows, callbacks=callbacks, batch_size=spec.batch_size,
                      max_length=spec.max_length, **common, **extra)
    clock.mark("setup_done")
    trainer.train()
    cfg = trainer.config
    settings = {k: getattr(cfg, k) for k in OUR_SPEED_FIELDS if hasattr(cfg, k)}
    resolved = getattr(trainer, "speed_features", None)  # what the trainer turned on for this model, and why not
    if resolved:
        settings["resolved"] = {k: v for k, v in resolved.items() if k != "fallbacks" or v}
    if algo in ("dpo", "kto"):
        examples = trainer.train_examples
        settings["reference"] = ("precomputed, freed" if examples and all(preference.REF_KEY in e for e in examples)
                                 else "scored every step")
    return {"settings": settings, **_timing(precompute, clock),
            "features": "verl_core defaults: " + ", ".join(f"{k}={v}" for k, v in settings.items())}


# -- TRL -----------------------------------------------------------------------------------------
def _trl_args(spec: RealSpec, out: str, algo: str) -> dict[str, Any]:
    return {"output_dir": out, "per_device_train_batch_size": spec.grpo_batch if algo == "grpo" else spec.batch_size,
            "gradient_accumulation_steps": 1, "max_steps": spec.total_steps, "learning_rate": spec.learning_rate,
            "lr_scheduler_type": "constant", "bf16": spec.dtype == "bf16", "use_cpu": spec.resolved_device() == "cpu",
            "gradient_checkpointing": False, "seed": spec.seed, "logging_steps": spec.total_steps, "save_strategy": "no",
            "report_to": "none", "disable_tqdm": True, "dataloader_num_workers": 0, "max_grad_norm": 1.0}


def run_trl(algo: str, spec: RealSpec, clock: StepClock) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.mark("train_begin")

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    path = str(model_path(spec))
    tok = _tokenizer(spec)
    data = Dataset.from_list(rows_for(algo, spec, tok))
    best, precompute = spec.trl_best, []  # precompute: (start, end) of TRL's reference passes
    settings: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        args = _trl_args(spec, out, algo)
        kw = {"processing_class": tok, "callbacks": [Clock()], "train_dataset": data}
        if algo == "sft":
            cfg = trl.SFTConfig(**args, max_length=None if best else spec.max_length, padding_free=best)
            trainer = trl.SFTTrainer(model=path, args=cfg, **kw)
            settings = {"padding_free": trainer.padding_free, "max_length": cfg.max_length}
        elif algo == "rm":
            cfg = trl.RewardConfig(**args, max_length=spec.max_length)
            trainer = trl.RewardTrainer(model=path, args=cfg, **kw)
        elif algo in ("dpo", "kto"):
            cfg_cls, cls = (trl.DPOConfig, trl.DPOTrainer) if algo == "dpo" else (trl.KTOConfig, trl.KTOTrainer)
            _timed(cls, "_precompute_ref_logps", precompute)
            cfg = cfg_cls(**args, max_length=spec.max_length, beta=spec.beta, precompute_ref_log_probs=best)
            trainer = cls(model=path, args=cfg, **kw)
            settings = {"precompute_ref_log_probs": trainer.precompute_ref_logps,
                        "reference": "precomputed" if trainer.precompute_ref_logps else "scored every step"}
        elif algo == "grpo":
            from verl_core.rewards.rules import get_rule_reward

            rule = get_rule_reward(GRPO_REWARD)

            def final_number(prompts, completions, ground_truth, **_):
                return rule(completions, ground_truth)

            cfg = trl.GRPOConfig(**args, num_generations=spec.num_generations, max_completion_length=spec.max_completion_length,
                                 temperature=spec.temperature, beta=0.0, use_transformers_paged=best)
            trainer = trl.GRPOTrainer(model=path, reward_funcs=[final_number], args=cfg, **kw)
            settings = {"generation_batch_size": cfg.generation_batch_size, "beta": cfg.beta,
                        "use_transformers_paged": cfg.use_transformers_paged}
        else:
            raise ValueError(algo)
        settings["gradient_checkpointing"] = cfg.gradient_checkpointing
        settings["bf16"] = cfg.bf16
        clock.mark("setup_done")
        trainer.train()
    name = f"trl {trl.__version__} " + ("best" if best else "defaults")
    return {"settings": settings, **_timing(precompute, clock),
            "features": name + ": " + ", ".join(f"{k}={v}" for k, v in settings.items())}
