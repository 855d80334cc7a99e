"""On-policy distillation: the student samples, a frozen teacher grades every token.

One rollout step is :class:`~verl_core.algorithms.online.OnlineTrainer`'s: the student (the policy)
samples completions through the rollout backend, then, without gradients, the teacher (any causal LM
with the same tokenizer) gives ``log π_T(x_t)`` of each sampled token (the fused, chunked log-prob path
of the reference model: no full fp32 vocabulary softmax). The loss, ``loss`` (names of
:data:`~verl_core.losses.distill.DISTILL_LOSSES`):

- ``"reverse_kl"`` (default; Lu & Thinking Machines Lab 2025, "On-Policy Distillation"): per-token
  advantage ``A_t = -(log π_S(x_t) - log π_T(x_t))`` (discount 0), updated by the configured policy loss
  (``policy_loss``, PPO-clip by default). Its expected gradient is ``-∇ KL(π_S ‖ π_T)``.
- ``"jsd"`` (GKD, Agarwal et al. 2024, arXiv:2306.13649): the generalized JSD(``jsd_beta``) between the
  student's and the teacher's full next-token distributions at every policy token of the samples,
  token mean, minimised directly (TRL's convention: β = 0 forward KL, β = 1 reverse KL). The teacher's
  hidden states are recomputed per mini-batch and the logits of both models exist one chunk of
  positions at a time (:func:`~verl_core.losses.distill.linear_generalized_jsd_tokens`).

Only the policy's tokens count: ``response_mask`` leaves out padding and, in agent episodes, the tool
text, which is context for both models. No reward is needed; rules, functions or a reward model, when
given, are scored and logged (``reward/*``) but do not enter the loss.

``teacher_forced_fraction`` is GKD's λ seen from the other side: λ is the fraction of student-generated
outputs (GKD Algorithm 1; ``lmbda`` of TRL's ``GKDTrainer``), the rest being off-policy outputs, here
sampled from the teacher (TRL's ``seq_kd=True``): ``teacher_forced_fraction = 1 - λ``. It is a fixed
share of each step's (seeded, shuffled) prompts, so a step is a pure function of the seed and resumes
exactly. On teacher rows, ``"jsd"`` is unchanged; ``"reverse_kl"`` gives every token ``A_t = 1``, whose
policy gradient is the negative log-likelihood's: sequence-level KD on the teacher's samples (Kim & Rush
2016, arXiv:1606.07947), the sampled forward KL(π_T ‖ π_S).

Metrics: ``distill/reverse_kl`` (token mean of ``log π_S - log π_T`` on the student's samples, the
progress bar's number), ``distill/teacher_logp``, ``distill/jsd`` (loss ``"jsd"``), ``distill/teacher_rows``.
A smaller student initialised from the teacher: :func:`verl_core.modeling.student.student_from_teacher`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from verl_core.agents.environments import EpisodeSampler
from verl_core.algorithms.online import OnlineTrainer
from verl_core.algorithms.online_config import OnlineConfig
from verl_core.algorithms.sampling import step_request
from verl_core.config import ConfigError
from verl_core.losses.distill import (
    DISTILL_LOSSES,
    generalized_jsd_tokens,
    linear_generalized_jsd_tokens,
    sampled_reverse_kl,
)
from verl_core.losses.masked import masked_mean
from verl_core.modeling.forward import fused_head_skip_reason, last_hidden_states, output_head_weight, response_logprobs
from verl_core.modeling.loading import TORCH_DTYPES, load_causal_lm, load_tokenizer
from verl_core.policies import LLMPolicy
from verl_core.rollout.contract import RolloutBatch, concat_rollouts
from verl_core.rollout.hf_backend import HFRolloutBackend
from verl_core.train.engine import LossOutput
from verl_core.train.precision import AUTOCAST_DTYPES

DistillLoss = Literal[tuple(DISTILL_LOSSES)]  # type: ignore[valid-type]
_INPUTS = ("input_ids", "attention_mask", "position_ids")
TEACHER_SEED_SHIFT = 104_729  # the teacher's sampling stream: the step's seed(s) shifted by a prime


def _seeds(seed: int | list[int], lo: int, hi: int, shift: int = 0) -> int | list[int]:
    """The seed of prompts ``lo:hi`` (one stream for all, or one per prompt), shifted."""
    return [s + shift for s in seed[lo:hi]] if isinstance(seed, list) else seed + shift


class DistillConfig(OnlineConfig):
    """``DistillConfig(teacher_model="path/to/teacher", loss="reverse_kl")``; no reward needed, no
    reference model (``kl_coef`` 0), one sample per prompt."""

    teacher_model: str | None = Field(
        None,
        description="the frozen teacher: a folder, a .gguf file or bundled:<name>, with the policy's tokenizer (required)",
    )
    loss: DistillLoss = Field("reverse_kl", description=" | ".join(DISTILL_LOSSES))
    jsd_beta: float = Field(0.5, ge=0, le=1, description="jsd: the mixture weight β of the teacher (0 forward KL, 1 reverse KL)")
    teacher_forced_fraction: float = Field(
        0.0, ge=0, le=1, description="share of each step's prompts answered by the teacher instead of the student (1 - GKD's λ)"
    )
    kl_coef: float = Field(0.0, ge=0, description="KL to the initial policy; 0 (the default) skips the reference model")

    @model_validator(mode="after")
    def _teacher_rows(self):
        if self.teacher_forced_fraction > 0 and self.async_rollout.enabled:
            raise ValueError("teacher_forced_fraction > 0 samples teacher rows in process: set async_rollout.max_staleness: 0")
        if self.teacher_forced_fraction > 0 and self.rollout_correction != "none":
            raise ValueError("teacher_forced_fraction > 0 with rollout_correction: teacher rows have no student sampler")
        if self.loss == "jsd" and (self.kl_coef > 0 or self.adaptive_kl or self.entropy_coef > 0):
            raise ValueError("loss 'jsd' is minimised directly: kl_coef, adaptive_kl and entropy_coef apply to 'reverse_kl' only")
        return self


def vocabulary_difference(student_tok, teacher_tok) -> str | None:
    """Why two tokenizers do not share one vocabulary (sizes, first differing token), or None."""
    s, t = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s == t:
        return None
    by_id_s, by_id_t = {i: w for w, i in s.items()}, {i: w for w, i in t.items()}
    first = next(i for i in range(max(len(by_id_s), len(by_id_t)) + 1) if by_id_s.get(i) != by_id_t.get(i))
    return f"{len(s)} vs {len(t)} tokens, first difference at id {first}: {by_id_s.get(first)!r} vs {by_id_t.get(first)!r}"


class DistillTrainer(OnlineTrainer):
    """``DistillTrainer(policy=student, config=DistillConfig(teacher_model=...), prompts=rows).train()``;
    ``teacher=`` takes a loaded :class:`~verl_core.policies.LLMPolicy` in place of ``teacher_model``."""

    config_cls = DistillConfig
    config: DistillConfig
    default_rules = None  # rewards are optional: logged, not trained on
    progress_key = "distill/reverse_kl"

    def packing_unsupported(self, lm):
        return "distillation updates on padded batches (the teacher's log-probs are laid out per row)"

    def __init__(self, policy: LLMPolicy | str, *args: Any, teacher: LLMPolicy | None = None, **kwargs: Any):
        super().__init__(policy, *args, **kwargs)
        c = self.config
        if teacher is None and c.teacher_model is None:
            raise ConfigError("distill needs a teacher: set teacher_model (a folder, a .gguf file or bundled:<name>)")
        student_name = self.policy.source or type(self.policy.model).__name__
        if teacher is None:
            dtype = {v: k for k, v in TORCH_DTYPES.items()}[next(self.policy.model.parameters()).dtype]
            teacher_name, teacher_tok = c.teacher_model, load_tokenizer(c.teacher_model)
            why = vocabulary_difference(self.policy.tokenizer, teacher_tok)  # before loading the weights
            lm = None if why else load_causal_lm(c.teacher_model, dtype=dtype, trainable=False)
        else:
            teacher_name, teacher_tok, lm = teacher.source or type(teacher.model).__name__, teacher.tokenizer, teacher.model
            why = vocabulary_difference(self.policy.tokenizer, teacher_tok)
        if why:
            raise ConfigError(
                f"teacher_model {teacher_name} does not share the vocabulary of the policy {student_name}: {why}; "
                "distillation compares per-token probabilities, so both need the same tokenizer"
            )
        self.teacher = lm.eval().requires_grad_(False)
        self.teacher_backend: Any = None
        self.teacher_rows = 0  # rows of the current step sampled from the teacher (the first ones)

    # -- sampling: the student, and a share of teacher rows -----------------------------------
    def teacher_sampler(self) -> Any:
        if self.teacher_backend is None:
            tok = self.policy.tokenizer
            autocast = AUTOCAST_DTYPES.get(self.config.mixed_precision)
            backend = HFRolloutBackend(self.teacher, tok.eos_token_id, tok.pad_token_id, autocast)
            self.teacher_backend = EpisodeSampler(backend, self.agent) if self.agent is not None else backend
        return self.teacher_backend

    def collect(self, step: int) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
        """The step's prompts: the first ``round(teacher_forced_fraction · prompts)`` answered by the teacher
        (its own seed stream), the rest by the student; rows in prompt order."""
        c = self.config
        examples, seed = step_request(self, step)
        ids = [e["prompt_ids"] for e in examples]
        k = round(c.teacher_forced_fraction * len(ids))
        t0 = time.perf_counter()
        batches = []
        if k:
            self.teacher.to(self.engine.accelerator.device)
            batches.append(self.teacher_sampler().generate(ids[:k], self.sampling, seed=_seeds(seed, 0, k, TEACHER_SEED_SHIFT)))
        if k < len(ids):
            batches.append(self.backend.generate(ids[k:], self.sampling, seed=_seeds(seed, k, len(ids))))
        rollout = concat_rollouts(batches, self.policy.tokenizer.pad_token_id)
        seconds = time.perf_counter() - t0
        self.teacher_rows = k * c.num_generations
        scores, metrics = self.score(rollout, examples)
        metrics["perf/gen_seconds"] = seconds
        metrics["perf/gen_tokens_per_s"] = rollout.response_lengths.sum().item() / max(seconds, 1e-9)
        metrics["distill/teacher_rows"] = self.teacher_rows / len(rollout)
        return rollout, scores, metrics

    # -- experience: the teacher's log-probs of the sampled tokens ----------------------------
    @torch.no_grad()
    def make_experience(self, rollout: RolloutBatch) -> dict[str, torch.Tensor]:
        c, acc = self.config, self.engine.accelerator
        exp = super().make_experience(rollout)
        self.teacher.to(acc.device)
        chunk = max(1, self.mini_batch_size // (acc.num_processes * c.gradient_accumulation_steps))
        keys = (*_INPUTS, "response_ids", "response_mask")
        teacher = []
        for s in range(0, len(rollout), chunk):
            mb = {k: exp[k][s : s + chunk] for k in keys}
            with acc.autocast():
                teacher.append(response_logprobs(self.teacher, mb, 1.0 / c.temperature, fused=c.fused_lm_head)[0].float())
        mask = exp["response_mask"].bool()
        exp["teacher_logp"] = torch.where(mask, torch.cat(teacher), 0.0)
        if "old_logp" not in exp:  # one on-policy update: the sampler's log-probs are the student's (rollout contract)
            exp["sampler_logp"] = torch.where(mask, rollout.logprobs.to(acc.device).float(), 0.0)
        exp["teacher_row"] = (torch.arange(len(rollout), device=acc.device) < self.teacher_rows).float()
        return exp

    def compute_advantages(self, exp: dict[str, torch.Tensor], scores: torch.Tensor) -> dict[str, float]:
        """``A_t = -(log π_S - log π_T)`` on the student's rows, 1 on the teacher's (see the module doc),
        minus ``kl_coef · kl_t`` when a KL to the reference is in the reward."""
        mask = exp["response_mask"].bool()
        student = exp.pop("sampler_logp", None)
        student = exp["old_logp"] if student is None else student
        teacher_logp, teacher_row = exp.pop("teacher_logp"), exp.pop("teacher_row").bool()[:, None]
        on_policy = mask & ~teacher_row
        k = sampled_reverse_kl(student, teacher_logp, on_policy)
        advantages = torch.where(mask & teacher_row, 1.0, -k)
        if "kl" in exp and self.config.kl_in == "reward":
            advantages = advantages - self.kl_ctl.value * torch.where(mask, exp["kl"], 0.0)
        exp["advantages"] = advantages
        metrics = {"advantages/abs_mean": masked_mean(advantages.abs(), mask).item()}
        if on_policy.any():
            metrics["distill/reverse_kl"] = masked_mean(k, on_policy).item()
            metrics["distill/teacher_logp"] = masked_mean(teacher_logp, on_policy).item()
        return metrics

    # -- the loss ----------------------------------------------------------------------------
    def loss(self, model, mb: dict[str, torch.Tensor]) -> LossOutput:
        """``reverse_kl``: the policy loss on the advantages above; ``jsd``: :meth:`jsd_loss`."""
        return super().loss(model, mb) if self.config.loss == "reverse_kl" else self.jsd_loss(model, mb)

    def jsd_loss(self, model, mb: dict[str, torch.Tensor]) -> LossOutput:
        """GKD's JSD(β) summed over the policy tokens of ``mb`` (the engine divides by their count)."""
        c, acc = self.config, self.engine.accelerator
        mask = mb["response_mask"].bool()
        r, vocab = mb["response_ids"].shape[1], len(self.policy.tokenizer)
        inputs = {k: mb[k] for k in _INPUTS}
        fused = c.fused_lm_head and fused_head_skip_reason(model) is None and fused_head_skip_reason(self.teacher) is None
        if fused:  # hidden states in, one chunk of logits at a time
            h_s = last_hidden_states(model, **inputs, use_cache=False)[:, -r - 1 : -1][mask]
            with torch.no_grad(), acc.autocast():
                h_t = last_hidden_states(self.teacher, **inputs, use_cache=False)[:, -r - 1 : -1][mask]
            w_s, w_t = output_head_weight(model)[:vocab], output_head_weight(self.teacher)[:vocab]
            per_token = linear_generalized_jsd_tokens(h_s, w_s, h_t, w_t, c.jsd_beta, c.temperature)
        else:  # the models' own logits at the response positions (soft-capped or biased heads)
            z_s = model(**inputs, use_cache=False, logits_to_keep=r + 1).logits[:, :-1, :vocab]
            with torch.no_grad(), acc.autocast():
                z_t = self.teacher(**inputs, use_cache=False, logits_to_keep=r + 1).logits[:, :-1, :vocab]
            per_token = generalized_jsd_tokens(z_s, z_t, mask, c.jsd_beta, c.temperature)
        total = per_token.sum()
        n = per_token.numel()
        value = total.item() / max(n, 1)
        return LossOutput(loss_sum=total, count=n, metrics={"distill/jsd": value, "policy/loss": value})
