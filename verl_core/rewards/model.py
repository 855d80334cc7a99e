"""Reward-model scoring, user reward callables, and their weighted combination with rule rewards.

Every reward source is batched and checked: a source that raises, returns the wrong number of
scores, or a NaN/inf score raises :class:`~verl_core.rewards.rules.RewardError` naming the
source and the sample.

The combined score of completion ``i`` is a weighted sum over sources::

    r_i = sum_rule w_rule * rule(i) + w_rm * RM(prompt_i, completion_i) + sum_fn w_fn * fn(i)
          + w_judge * judge(i) + w_remote * remote(i)

with an LM as judge (:mod:`verl_core.rewards.judge`) and a reward service over HTTP
(:mod:`verl_core.rewards.remote`) as optional sources.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from pydantic import Field

from verl_core.config import ConfigError, StrictConfig
from verl_core.data import pad_to
from verl_core.data.packing import collate_packed
from verl_core.modeling.loading import DType, load_reward_model, load_tokenizer
from verl_core.modeling.packed_forward import packed_sequence_scores, packing_unsupported, padded_sequence_scores
from verl_core.rewards.judge import JudgeConfig, JudgeReward
from verl_core.rewards.remote import RemoteReward, RemoteRewardConfig
from verl_core.rewards.rules import RULE_REWARDS, RewardError, RewardFn, RuleWeights, _checked_scores, get_rule_reward

Prompt = Union[str, list[dict[str, str]]]


class RewardModel:
    """A scalar reward model (sequence classifier, one logit read at the last token).

    ``RewardModel.from_pretrained(path).score(prompts, completions)`` → ``[N]`` fp32 scores.
    Prompts and completions are either texts, or token ids of this model's tokenizer. Texts are
    encoded the way :class:`~verl_core.algorithms.reward_model.RewardTrainer` saw its training
    rows: the prompt with special tokens (a message list goes through the chat template), the
    completion without, then EOS. Sequences longer than ``max_length`` keep their last
    ``max_length`` tokens (the end is what the score head reads).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, batch_size: int = 64, max_length: int = 1024):
        if tokenizer.pad_token_id is None:
            raise ConfigError("the reward model's tokenizer needs a pad token")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.autocast_dtype: torch.dtype | None = None
        self._packed = packing_unsupported(model, needs_score_head=True) is None

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: DType = "float32",
        batch_size: int = 64,
        max_length: int = 1024,
        trust_remote_code: bool = False,
    ) -> RewardModel:
        model = load_reward_model(path, dtype=dtype, trust_remote_code=trust_remote_code, trainable=False)
        return cls(model, load_tokenizer(path, trust_remote_code=trust_remote_code), batch_size, max_length)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> RewardModel:
        self.model.to(device)
        return self

    def shares_vocab(self, tokenizer: Any) -> bool:
        """True when ``tokenizer`` maps text to the same ids, so token ids can be scored as they are."""
        return tokenizer is self.tokenizer or tokenizer.get_vocab() == self.tokenizer.get_vocab()

    def encode(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
        tok = self.tokenizer
        prompt_ids = []
        for p in prompts:
            if isinstance(p, str):
                prompt_ids.append(tok(p, add_special_tokens=True)["input_ids"])
            else:
                text = tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                prompt_ids.append(tok(text, add_special_tokens=False)["input_ids"])
        completion_ids = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
        return prompt_ids, completion_ids

    @torch.no_grad()
    def score(
        self, prompts: Sequence[Prompt] | Sequence[Sequence[int]], completions: Sequence[str] | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Scores of ``completions`` given ``prompts`` (texts, or ids of this tokenizer); [N] fp32 on CPU."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if completions and isinstance(completions[0], str):
            prompt_ids, completion_ids = self.encode(prompts, completions)
        else:
            prompt_ids, completion_ids = [list(p) for p in prompts], [list(c) for c in completions]
        # batches of similar lengths: real prompts range from 20 to 1,000 tokens, and a batch padded to
        # its longest row spent most of its time on padding (each row's score is unchanged by the order)
        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))
        out = torch.zeros(len(prompt_ids))
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            with torch.autocast(
                self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
            ):
                scores = self._scores([prompt_ids[i] + completion_ids[i] for i in index])
            out[index] = scores.float().cpu()
        return out

    def _scores(self, sequences: list[list[int]]) -> torch.Tensor:
        """Scores of whole token sequences, each cut to its last ``max_length`` tokens (the end is what the
        score head reads): packed where the model's attention takes a packed mask (no pad token computed,
        the last layer only where the score is read), else right-padded."""
        pad = self.tokenizer.pad_token_id
        kept = [s[-self.max_length :] for s in sequences]
        if self._packed:
            # each sequence a unit of its own: its last token as the "completion" the score is read at
            batch = collate_packed([s[:-1] for s in kept], [[s[-1:] for s in kept]], pad, False, "longest")
            return packed_sequence_scores(self.model, {k: v.to(self.device) for k, v in batch.items()})
        ids, mask = pad_to(kept, pad), pad_to([[1] * len(s) for s in kept], 0)
        return padded_sequence_scores(self.model, ids.to(self.device), mask.to(self.device))


class RewardSourceConfig(StrictConfig):
    """The serialisable part of a reward: rule names and weights, a reward-model folder, an LM judge, a service."""

    reward_rules: RuleWeights = Field(None, description="rule reward name -> weight (see RULE_REWARDS)")
    reward_model_path: str | None = None
    reward_model_weight: float = 1.0
    judge: JudgeConfig | None = Field(None, description="a causal LM asked about each completion (rewards.judge)")
    judge_weight: float = 1.0
    remote: RemoteRewardConfig | None = Field(None, description="a reward service over HTTP (rewards.remote)")
    remote_weight: float = 1.0

    def names_a_reward(self) -> bool:
        """Whether any source is configured (else a trainer uses its default rules, or none)."""
        return any(x is not None for x in (self.reward_rules, self.reward_model_path, self.judge, self.remote))


@dataclass
class RewardScores:
    total: torch.Tensor  # [N] weighted sum
    components: dict[str, torch.Tensor] = field(default_factory=dict)  # source name -> [N] unweighted


UserRewards = Union[Mapping[str, Union[RewardFn, tuple[RewardFn, float]]], Sequence[RewardFn], RewardFn, None]


class RewardSource:
    """Rules + reward model + user callables + judge + remote service, each with a weight, scored together.

    A user callable has the rule-reward signature ``fn(completions, ground_truths) -> list[float]``
    and is given as a list (weight 1, named after the function), or a mapping
    ``name -> fn`` / ``name -> (fn, weight)``. :meth:`metrics` gives the judge's ``judge/*`` and the
    service's ``remote/*`` counters since its previous call.
    """

    def __init__(
        self,
        rules: Mapping[str, float] | None = None,
        reward_model: RewardModel | None = None,
        reward_model_weight: float = 1.0,
        functions: UserRewards = None,
        judge: JudgeReward | None = None,
        judge_weight: float = 1.0,
        remote: RemoteReward | None = None,
        remote_weight: float = 1.0,
    ):
        self.rules = dict(rules or {})
        for name in self.rules:
            get_rule_reward(name)  # unknown names fail here, before any model is loaded
        self.reward_model = reward_model
        self.reward_model_weight = float(reward_model_weight)
        self.functions = _normalise_functions(functions)
        self.judge, self.judge_weight = judge, float(judge_weight)
        self.remote, self.remote_weight = remote, float(remote_weight)
        for name, w in [
            *self.rules.items(),
            *((n, w) for n, (_, w) in self.functions.items()),
            ("reward_model", self.reward_model_weight),
            ("judge", self.judge_weight),
            ("remote", self.remote_weight),
        ]:
            if not math.isfinite(w):
                raise ConfigError(f"weight of reward {name!r} is not finite: {w}")
        if not self.rules and reward_model is None and not self.functions and judge is None and remote is None:
            raise ConfigError("no reward: give reward_rules, a reward model, a judge, a remote service or reward functions")

    @classmethod
    def build(
        cls,
        config: RewardSourceConfig,
        reward_model: RewardModel | str | os.PathLike | None = None,
        functions: UserRewards = None,
        default_rules: Mapping[str, float] | None = None,
    ) -> RewardSource:
        """From a config plus live objects; ``default_rules`` apply only when nothing else is given."""
        rm = reward_model if reward_model is not None else config.reward_model_path
        if isinstance(rm, (str, os.PathLike)):
            rm = RewardModel.from_pretrained(rm)
        rules = config.reward_rules
        if rules is None and rm is None and not functions and config.judge is None and config.remote is None:
            rules = dict(default_rules or {})
        remote = RemoteReward(config.remote) if config.remote is not None else None  # a missing token_env fails first
        judge = JudgeReward(config.judge) if config.judge is not None else None
        return cls(rules, rm, config.reward_model_weight, functions, judge, config.judge_weight, remote, config.remote_weight)

    def score(
        self,
        prompts: Sequence[Prompt],
        completions: Sequence[str],
        ground_truths: Sequence[str | None],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> RewardScores:
        """Weighted total and per-source scores. The reward model reads ``prompt_ids``/``completion_ids``
        when given (they must be ids of its tokenizer), else the texts."""
        n = len(completions)
        total = torch.zeros(n, dtype=torch.float32)
        parts: dict[str, torch.Tensor] = {}
        for name, weight in self.rules.items():
            parts[name] = torch.tensor(_checked_scores(name, RULE_REWARDS[name], completions, ground_truths))
            total += weight * parts[name]
        for name, (fn, weight) in self.functions.items():
            parts[name] = torch.tensor(_checked_scores(name, fn, completions, ground_truths), dtype=torch.float32)
            total += weight * parts[name]
        if self.reward_model is not None:
            if prompt_ids is not None and completion_ids is not None:
                rm = self.reward_model.score(prompt_ids, completion_ids)
            else:
                rm = self.reward_model.score(prompts, completions)
            parts["reward_model"] = _finite("reward_model", rm, completions)
            total += self.reward_model_weight * rm
        if self.judge is not None:
            judged = torch.tensor(self.judge.score(prompts, completions, ground_truths), dtype=torch.float32)
            parts["judge"] = _finite("judge", judged, completions)
            total += self.judge_weight * parts["judge"]
        if self.remote is not None:  # checked by the client: a RewardError naming the URL, never a missing score
            parts["remote"] = torch.tensor(self.remote.score(prompts, completions, ground_truths), dtype=torch.float32)
            total += self.remote_weight * parts["remote"]
        return RewardScores(total, parts)

    def metrics(self) -> dict[str, float]:
        """``judge/*`` and ``remote/*`` counters since the previous call (empty without either source)."""
        out: dict[str, float] = {}
        for source in (self.judge, self.remote):
            if source is not None:
                out.update(source.metrics())
        return out


def _finite(name: str, scores: torch.Tensor, completions: Sequence[str]) -> torch.Tensor:
    bad = (~torch.isfinite(scores)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise RewardError(name, i, f"returned a non-finite score {scores[i].item()}", completions[i])
    return scores


def _normalise_functions(functions: UserRewards) -> dict[str, tuple[RewardFn, float]]:
    if functions is None:
        return {}
    if callable(functions):
        functions = [functions]
    out: dict[str, tuple[RewardFn, float]] = {}
    if isinstance(functions, Mapping):
        for name, value in functions.items():
            fn, weight = value if isinstance(value, tuple) else (value, 1.0)
            out[str(name)] = (_check_callable(fn, name), float(weight))
        return out
    for fn in functions:
        name = getattr(fn, "__name__", type(fn).__name__)
        if name in out or name in RULE_REWARDS:
            name = f"{name}_{len(out)}"
        out[name] = (_check_callable(fn, name), 1.0)
    return out


def _check_callable(fn: Callable, name: Any) -> RewardFn:
    if not callable(fn):
        raise ConfigError(f"reward function {name!r} is not callable (got {type(fn).__name__})")
    return fn
