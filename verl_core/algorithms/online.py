"""Online RL over the shared engine: sample, score, estimate advantages, update with PPO-clip.

One training step (the RLHF loop of Ziegler et al. 2019, arXiv:1909.08593, and Ouyang et al.
2022, arXiv:2203.02155):

1. take ``batch_size / num_generations`` prompts (a seeded permutation: a pure function of
   ``(seed, step)``, so a resumed run sees the same prompts),
2. sample ``num_generations`` completions per prompt (:mod:`verl_core.rollout.contract`, seeded),
3. score them (:class:`~verl_core.rewards.RewardSource`),
4. without gradients: old log-probs, reference log-probs (only when a KL term is on), values,
5. advantages (the algorithm's :meth:`OnlineTrainer.compute_advantages`: GAE, GRPO, RLOO, ...),
6. ``ppo_epochs`` passes over shuffled mini-batches, one ``Engine.optimizer_step`` each, on the
   policy loss ``POLICY_LOSSES[policy_loss]`` (default ``"vanilla"``, the PPO clipped surrogate;
   ``"gspo"``, ``"cispo"``) aggregated with ``loss_agg`` (default: that loss's own) (+ entropy
   bonus, + KL when ``kl_in="loss"``, + the algorithm's extra loss, e.g. the PPO value loss). Steps 1-3
   are :meth:`OnlineTrainer.collect` (GRPO's dynamic sampling repeats them).

:meth:`OnlineTrainer.train_step` is that step; :meth:`Engine.run` loops over it (resume, logging,
eval and checkpoint cadences in rollout steps, callbacks). Each update's own metrics reach
:meth:`Callback.on_update`; the rollout step logs their mean.

Log-probs in training are ``log softmax(z / T)`` at the sampling temperature ``T``, the same
distribution the rollout sampled from. Old log-probs are recomputed with a training-layout
forward pass (not taken from the sampler) so that the first mini-batch has ratio 1 up to float
noise, also under mixed precision; when there is exactly one update per rollout (one epoch, one
mini-batch) the update is on-policy and ``old = logp.detach()`` saves that pass. Stale batches from
rollout workers bring their own old log-probs (``async_rollout.old_logprobs``, :mod:`.async_rollout`).

The KL to the frozen reference is estimated per token with ``kl_penalty(kind=kl_estimator)`` and
either subtracted from the reward (``kl_in="reward"``: ``r_t -= beta * kl_t``, Ziegler et al.) or
added to the loss (``kl_in="loss"``: ``+ beta * agg(kl_t)``, GRPO, Shao et al. 2024). With
several processes each samples and scores its share of the prompts, then advantages, statistics
and mini-batches are those of the global batch (:mod:`verl_core.algorithms.online_batch`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from verl_core.agents.environments import EpisodeSampler, build_agent_loop
from verl_core.algorithms import online_batch
from verl_core.algorithms.agentic import evaluate_agent, online_prompts
from verl_core.algorithms.async_rollout import build_backend
from verl_core.algorithms.base import FINAL_MODEL_DIR, resolve_config
from verl_core.algorithms.online_batch import gather_experience, gather_rows, mean_over_ranks, minibatch_share
from verl_core.algorithms.online_config import OnlineConfig
from verl_core.algorithms.online_scoring import rollout_samples, score_rollout
from verl_core.algorithms.sampling import step_request
from verl_core.algorithms.speed import describe, resolve_speed
from verl_core.config import ConfigError
from verl_core.losses.advantages import outcome_token_rewards
from verl_core.losses.correction import correct_rollout_mismatch, rollout_mismatch
from verl_core.losses.masked import masked_mean
from verl_core.losses.policy import POLICY_LOSSES, AdaptiveKLController, FixedKLController, aggregate, kl_penalty, kl_summary
from verl_core.modeling.forward import response_logprobs
from verl_core.modeling.loading import check_fits_context, save_pretrained_atomic
from verl_core.policies import LLMPolicy
from verl_core.rewards.model import RewardModel, RewardSource, UserRewards
from verl_core.rollout.contract import RolloutBackend, RolloutBatch, SamplingParams
from verl_core.rollout.registry import close_backend
from verl_core.train.callbacks import Callback
from verl_core.train.engine import Engine, LossOutput, TrainResult
from verl_core.train.precision import AUTOCAST_DTYPES, allow_precision_change

log = logging.getLogger("verl_core")


class OnlineTrainer:
    """The loop above; an algorithm provides :meth:`compute_advantages` and may override
    :meth:`build_module` / :meth:`policy_outputs` / :meth:`extra_loss` (PPO adds a value head)."""

    config_cls: ClassVar[type[OnlineConfig]] = OnlineConfig
    default_rules: ClassVar[dict[str, float] | None] = {"exact_match": 1.0}  # None: no reward needed (only logged if given)
    progress_key: ClassVar[str] = "reward/mean"  # the metric on the progress bar
    needs_values: ClassVar[bool] = False
    behaviour_is_old = False  # the sampler's log-probs are the old ones (rollout workers, old_logprobs: behaviour)

    def __init__(
        self,
        policy: LLMPolicy | str,
        reward_model: RewardModel | str | None = None,
        config: OnlineConfig | dict | None = None,
        prompts: Any = None,
        reward_fns: UserRewards = None,
        eval_prompts: Any = None,
        callbacks: Sequence[Callback] = (),
        rollout_backend: RolloutBackend | None = None,
        **overrides: Any,
    ):
        c = self.config = resolve_config(self.config_cls, config, overrides)
        self.policy = policy if isinstance(policy, LLMPolicy) else LLMPolicy.from_pretrained(policy)
        tok = self.policy.tokenizer
        self.agent = build_agent_loop(c, tok, c.max_new_tokens) if c.environment else None  # multi-turn episodes with tools
        self.prompts = online_prompts(c, prompts, tok, self.agent)
        check_fits_context(self.policy.model, self.prompts, c.max_new_tokens, str(policy))  # episodes: max_response_tokens
        if len(self.prompts) < c.batch_size // c.num_generations:
            raise ConfigError(
                f"{len(self.prompts)} prompts, fewer than the {c.batch_size // c.num_generations} one rollout step needs"
            )
        self.eval_prompts = eval_prompts
        optional = self.default_rules is None and not c.names_a_reward() and reward_model is None and not reward_fns
        self.rewards = None if optional else RewardSource.build(c, reward_model, reward_fns, self.default_rules)
        self.rm_reads_ids = bool(self.rewards and self.rewards.reward_model and self.rewards.reward_model.shares_vocab(tok))
        shared = c.model_dump(include={"max_new_tokens", "temperature", "top_p", "top_k"})
        self.sampling = SamplingParams(**shared, n=c.num_generations, batch_size=c.generation_batch_size)
        torch.manual_seed(c.seed)
        self.config, self.speed_features = resolve_speed(
            self.policy.model,
            c,
            type(self).__name__,
            unsupported=self.packing_unsupported(self.policy.model),
            fused_head_unsupported=self.fused_head_unsupported,
        )
        self.module = self.build_module(self.policy.model)
        uses_ref = c.kl_coef > 0 or c.adaptive_kl
        self.reference = copy.deepcopy(self.policy.model).eval().requires_grad_(False) if uses_ref else None
        self.kl_ctl = (
            AdaptiveKLController(c.kl_coef, c.kl_target, c.kl_horizon) if c.adaptive_kl else FixedKLController(c.kl_coef)
        )
        self.callbacks = list(callbacks)
        self.backend = rollout_backend
        self.engine: Engine | None = None

    # -- what an algorithm provides ----------------------------------------------------------
    def packing_unsupported(self, lm: torch.nn.Module) -> str | None:
        """Why this trainer cannot update ``lm`` on packed batches (None: it can, or has no packed path)."""
        return None

    fused_head_unsupported: str | None = None  # why the policy's log-probs cannot skip its logits

    def build_module(self, lm: torch.nn.Module) -> torch.nn.Module:
        """The module the engine optimises (default: the policy LM itself)."""
        return lm

    def policy_lm(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def policy_outputs(
        self, model, batch: dict[str, torch.Tensor], with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs at the sampling temperature [B, R], their entropies [B, R] (when
        asked, else None) and values [B, R] (or None) of the module being optimised."""
        return *self.response_logprobs(model, batch, with_entropy), None

    def response_logprobs(
        self, model, batch: dict[str, torch.Tensor], with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, R] log-probs at the sampling temperature of a plain LM (the policy, the reference),
        and their entropies (or None)."""
        c = self.config
        return response_logprobs(model, batch, 1.0 / c.temperature, with_entropy, c.entropy_coef > 0, c.fused_lm_head)

    def compute_advantages(self, exp: dict[str, torch.Tensor], scores: torch.Tensor) -> dict[str, float]:
        """Write ``exp["advantages"]`` ([B, R], 0 off the mask); return metrics."""
        raise NotImplementedError

    def extra_loss(
        self, values: torch.Tensor | None, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor | float, dict[str, float]]:
        return 0.0, {}

    # -- helpers for algorithms --------------------------------------------------------------
    def token_rewards(self, exp: dict[str, torch.Tensor], scores: torch.Tensor) -> torch.Tensor:
        """``r_t = -beta * kl_t`` (when ``kl_in="reward"``) plus the score on the last valid token."""
        dense = -self.kl_ctl.value * exp["kl"] if "kl" in exp and self.config.kl_in == "reward" else None
        return outcome_token_rewards(scores.to(exp["response_mask"].device), exp["response_mask"], dense)

    # -- the run -----------------------------------------------------------------------------
    @property
    def mini_batch_size(self) -> int:
        return self.config.mini_batch_size or self.config.batch_size

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per rollout step."""
        return self.config.ppo_epochs * (self.config.batch_size // self.mini_batch_size)

    def train(self) -> TrainResult:
        """Run :meth:`train_step` for ``max_steps`` rollout steps in the engine's loop; save the policy LM."""
        c = self.config
        allow_precision_change(c.mixed_precision)
        self.engine = engine = Engine(
            self.module, c, self.callbacks, total_steps=c.max_steps, updates_per_step=self.updates_per_step
        )
        acc = engine.accelerator
        online_batch.check_split(c, self.mini_batch_size, acc.num_processes)
        engine.register_state("kl_controller", self.kl_ctl)
        if self.reference is not None:
            self.reference.to(acc.device)
        if self.rewards is not None and self.rewards.reward_model is not None:
            self.rewards.reward_model.to(acc.device).autocast_dtype = AUTOCAST_DTYPES.get(c.mixed_precision)
        lm = self.policy_lm(engine.unwrapped)
        owned = None  # an engine this run starts is closed when it ends
        if self.backend is None:  # async_rollout.max_staleness > 0: worker processes (.async_rollout), else in-process
            self.backend = owned = build_backend(self, lm, AUTOCAST_DTYPES.get(c.mixed_precision))
        self.behaviour_is_old = bool(getattr(self.backend, "behaviour_is_old", False))
        if self.agent is not None and not isinstance(self.backend, EpisodeSampler):
            self.backend = EpisodeSampler(self.backend, self.agent)  # the turn loop around any backend
        if engine.is_main:
            log.info("%s: %s", type(self).__name__, describe(self.speed_features))
        speed = {f"speed/{k}": v for k, v in self.speed_features.items() if k != "fallbacks"}
        try:
            result = engine.run(
                self.train_step,
                eval_fn=self.evaluate if self.eval_prompts is not None else None,
                params={"algorithm": type(self).__name__, "rollout_backend": c.rollout.backend, **speed},
                desc=type(self).__name__,
                progress_key=self.progress_key,
            )
        finally:
            if owned is not None:
                close_backend(owned)
                self.backend = None
        result.output_dir = None
        if c.output_dir and engine.is_main:
            result.output_dir = str(save_pretrained_atomic(lm, self.policy.tokenizer, Path(c.output_dir) / FINAL_MODEL_DIR))
        acc.wait_for_everyone()
        return result

    def evaluate(self) -> dict[str, float]:
        from verl_core.evaluation import answer_accuracy

        lm = self.policy_lm(self.engine.unwrapped if self.engine else self.module)
        if self.agent is not None:
            return evaluate_agent(self, lm)
        acc = answer_accuracy(lm, self.policy.tokenizer, self.eval_prompts, self.config.eval_reward, self.config.max_new_tokens)
        return {"eval/accuracy": acc}

    def train_step(self, step: int) -> dict[str, float]:
        """One rollout step: sample, score, advantages, ``ppo_epochs`` passes of updates."""
        c, engine = self.config, self.engine
        acc = engine.accelerator
        rollout, scores, metrics = self.collect(step)
        if engine.is_main and step % max(1, c.logging_steps) == 0:  # a few samples per logging interval: traces
            samples = rollout_samples(self, rollout, scores)
            for cb in self.callbacks:
                cb.on_samples(step + 1, "rollout", samples)
        # from here on the global batch (every process's rows, in prompt order; identity alone)
        exp = gather_experience(self.make_experience(rollout), acc, self.policy.tokenizer.pad_token_id)
        scores, finished = gather_rows(scores.to(acc.device), acc), gather_rows(rollout.finished.to(acc.device), acc)
        if acc.num_processes > 1:
            metrics = mean_over_ranks(metrics, acc)
            metrics["reward/std"] = scores.std(unbiased=False).item()
        metrics.update(correct_rollout_mismatch(exp, self.config.rollout_correction, self.config.tis_cap))
        metrics.update(kl_summary(exp["kl"], exp["response_mask"]) if "kl" in exp else {})
        metrics.update(self.compute_advantages(exp, scores))
        exp.pop("kl", None)
        t1 = time.perf_counter()
        updates = self.update(exp, step)
        train_seconds = time.perf_counter() - t1
        if c.adaptive_kl and "kl" in metrics:
            self.kl_ctl.update(metrics["kl"], c.batch_size)
        self.backend.sync_weights(self.policy_lm(engine.unwrapped))
        lengths = exp["response_mask"].sum(-1).float()
        metrics.update({k: sum(u[k] for u in updates) / len(updates) for k in updates[0]})
        metrics |= {
            "response_length/mean": lengths.mean().item(),
            "response_length/max": lengths.max().item(),
            "response/eos_fraction": finished.float().mean().item(),
            "kl_coef": self.kl_ctl.value,
            "perf/train_seconds": train_seconds,
            "perf/train_tokens_per_s": c.ppo_epochs * exp["attention_mask"].sum().item() / max(train_seconds, 1e-9),
        }
        return metrics

    def collect(self, step: int) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
        """This process's prompts of ``step`` (seeded), their sampled completions, scores, reward and sampling metrics."""
        examples, seed = step_request(self, step)
        t0 = time.perf_counter()
        rollout = self.backend.generate([e["prompt_ids"] for e in examples], self.sampling, seed=seed)
        seconds = time.perf_counter() - t0
        scores, metrics = self.score(rollout, examples)
        metrics["perf/gen_seconds"] = seconds
        metrics["perf/gen_tokens_per_s"] = rollout.response_lengths.sum().item() / max(seconds, 1e-9)
        return rollout, scores, metrics

    def rollout_seed(self, step: int, round: int = 0) -> int:
        """Sampling seed of this process at ``step`` (``round`` > 0: dynamic sampling's extra rounds)."""
        c, rank = self.config, self.engine.accelerator.process_index
        return (c.seed * 1_000_003 + step) * 1_009 + rank + round * 7_919_009

    def score(self, rollout: RolloutBatch, examples: list[dict]) -> tuple[torch.Tensor, dict[str, float]]:
        return score_rollout(self, rollout, examples)

    @torch.no_grad()
    def make_experience(self, rollout: RolloutBatch) -> dict[str, torch.Tensor]:
        """Training tensors of one rollout: layout, old/reference log-probs, values, per-token KL."""
        c, acc = self.config, self.engine.accelerator
        exp = {k: v.to(acc.device) for k, v in rollout.training_inputs().items()}
        off_policy = self.updates_per_step > 1 or self.behaviour_is_old
        need_old = off_policy or self.needs_values or (self.reference is not None and c.kl_in == "reward")
        need_old = need_old or self.measures_mismatch
        forward = self.needs_values or (need_old and not self.behaviour_is_old)
        chunk = max(1, self.mini_batch_size // (acc.num_processes * c.gradient_accumulation_steps))
        old, values, ref = [], [], []
        for s in range(0, len(rollout), chunk):
            mb = {k: v[s : s + chunk] for k, v in exp.items()}
            if forward:
                self.engine.model.eval()
                logp, _, v = self.policy_outputs(self.engine.model, mb)
                old.append(logp)
                if v is not None:
                    values.append(v.float())
            if self.reference is not None:
                with acc.autocast():
                    ref.append(self.response_logprobs(self.reference, mb)[0])
        mask = exp["response_mask"].bool()
        sampler_logp = self.behaviour_is_old or self.measures_mismatch  # else the sampler's are not read
        behaviour = torch.where(mask, rollout.logprobs.to(acc.device).float(), 0.0) if sampler_logp else None
        if need_old:  # stale batches from rollout workers: the ratio may be taken against the sampler
            exp["old_logp"] = behaviour if self.behaviour_is_old else torch.where(mask, torch.cat(old), 0.0)
        if self.measures_mismatch:
            exp["rollout_logp"] = behaviour
        if values:
            exp["values"] = torch.where(mask, torch.cat(values), 0.0)
        if ref:
            exp["ref_logp"] = torch.where(mask, torch.cat(ref), 0.0)
            if need_old:
                exp["kl"] = torch.where(mask, kl_penalty(exp["old_logp"], exp["ref_logp"], c.kl_estimator), 0.0)
        return exp

    @property
    def measures_mismatch(self) -> bool:
        """Whether old log-probs are recomputed to compare with the sampler's: a sampler other than the
        training model itself (vLLM), or a correction asked for."""
        c = self.config  # rollout workers (async) never share the training module, whatever their backend
        other = not (c.rollout.spec.shares_training_model and not c.async_rollout.enabled) or c.rollout_correction != "none"
        return other and not self.behaviour_is_old  # (with the behaviour's, the loss logs mismatch/*)

    def update(self, exp: dict[str, torch.Tensor], step: int) -> list[dict[str, float]]:
        """``ppo_epochs`` seeded passes over shuffled mini-batches of the global batch ``exp`` (this
        process takes its share of each); the metrics of each optimizer step."""
        c, acc = self.config, self.engine.accelerator
        n = exp["input_ids"].shape[0]
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + step)
        out = []
        for _ in range(c.ppo_epochs):
            order = torch.randperm(n, generator=gen).to(exp["input_ids"].device)
            for k in range(n // self.mini_batch_size):
                rows = minibatch_share(order, k, self.mini_batch_size, acc)
                micro = [{key: v[i] for key, v in exp.items()} for i in rows.chunk(c.gradient_accumulation_steps)]
                out.append(self.engine.optimizer_step(micro, self.loss))
        return out

    def loss(self, model, mb: dict[str, torch.Tensor]) -> LossOutput:
        """Clipped surrogate + entropy bonus + KL (``kl_in="loss"``) + the algorithm's extra loss."""
        c = self.config
        logp, token_entropy, values = self.policy_outputs(model, mb, with_entropy=True)
        mask = mb["response_mask"]
        old = mb["old_logp"] if "old_logp" in mb else logp.detach()
        advantages = mb["advantages"]
        if "tis_weight" in mb:
            # every registered policy loss is, per token, positively homogeneous in the advantage
            # (l(w·A) = w·l(A) for w >= 0), so this weights each token's loss by w as TIS prescribes
            advantages = advantages * mb["tis_weight"]
        pl = POLICY_LOSSES[c.policy_loss](old, logp, advantages, mask, **c.policy_loss_kwargs())
        total = pl.loss
        norm = c.aggregation_norm
        entropy = aggregate(token_entropy, mask, c.aggregation, norm)
        if c.entropy_coef > 0:
            total = total - c.entropy_coef * entropy
        ratio_dev = torch.where(mask.bool(), (logp.detach() - old).exp() - 1, 0.0).abs()
        metrics = {
            "policy/loss": pl.loss.item(),
            "policy/clip_fraction": pl.clip_fraction.item(),
            "policy/approx_kl": pl.approx_kl.item(),
            "policy/entropy": entropy.item(),
            "policy/ratio_dev_mean": masked_mean(ratio_dev, mask).item(),
            "policy/ratio_dev_max": ratio_dev.max().item(),
        }
        if self.behaviour_is_old:  # how far the updated policy is from the (stale) sampler, per update
            metrics.update(rollout_mismatch(logp.detach(), old, mask))
        if "ref_logp" in mb and c.kl_in == "loss":
            kl = aggregate(kl_penalty(logp, mb["ref_logp"], c.kl_estimator), mask, c.aggregation, norm)
            total = total + self.kl_ctl.value * kl
            metrics["policy/kl_loss"] = kl.item()
        extra, extra_metrics = self.extra_loss(values, mb)
        total = total + extra
        metrics.update(extra_metrics)
        # the engine divides the summed loss by the global count: tokens for token-mean, sequences with a
        # token for every seq-mean-* aggregation (seq-mean-token-sum-norm's constant is inside the mean)
        units = mask.sum() if c.aggregation == "token-mean" else (mask.sum(-1) > 0).sum()
        return LossOutput(loss_sum=total * units, count=units.item(), metrics=metrics)
