"""A causal LM as judge: a question about each (prompt, completion), scored from the judge's answer.

The judge reads ``template`` with ``{prompt}``, ``{completion}`` and ``{ground_truth}`` filled in
(through its chat template when its tokenizer has one and ``use_chat_template`` is not false), then:

- ``mode="yes_no"``: the score is the judge's next-token probability of ``yes_token`` against
  ``no_token``, ``p(yes) / (p(yes) + p(no)) = sigmoid(z_yes - z_no)`` from the logits ``z`` at the
  last prompt position (no sampling, never a parse error). ``judge/yes_no_mass`` is the mean
  ``p(yes) + p(no)``: near 0 means the judge hardly considers either word.
- ``mode="number"``: the judge answers greedily (``max_new_tokens``); the first number in its
  answer, clipped to ``[min_score, max_score]``, becomes ``(x - min_score) / (max_score - min_score)``.
  An answer without a number scores 0 and counts in ``judge/parse_errors`` (logged with the answer).

Scores are batched (``batch_size`` rows per forward pass, right-padded for ``yes_no``, left-padded
for generation) and equal, up to float noise, to scoring each row alone.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
from pydantic import Field, model_validator

from verl_core.config import ConfigError, StrictConfig
from verl_core.data import pad_to
from verl_core.modeling.forward import base_module, last_hidden_states
from verl_core.modeling.loading import DType, load_causal_lm, load_tokenizer
from verl_core.rollout.greedy import greedy_completions

log = logging.getLogger("verl_core")

DEFAULT_TEMPLATE = "Question:\n{prompt}\n\nProposed answer:\n{completion}\n\nIs the answer correct? Answer Yes or No.\nAnswer:"
_FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_PLACEHOLDERS = ("{prompt}", "{completion}", "{ground_truth}")


class JudgeConfig(StrictConfig):
    """A judge model and the question it is asked (see the module docstring)."""

    model: str = Field(..., description="folder, .gguf file, bundled:<name> or hub id of a causal LM")
    template: str = Field(DEFAULT_TEMPLATE, description="the question; {prompt}, {completion}, {ground_truth}")
    mode: Literal["yes_no", "number"] = "yes_no"
    yes_token: str = Field(" Yes", description="yes_no: the word read as yes (one token of the judge's tokenizer)")
    no_token: str = Field(" No", description="yes_no: the word read as no (one token of the judge's tokenizer)")
    min_score: float = Field(0.0, description="number: the answer that maps to 0")
    max_score: float = Field(10.0, description="number: the answer that maps to 1")
    max_new_tokens: int = Field(8, ge=1, description="number: length of the judge's answer")
    batch_size: int = Field(16, ge=1)
    max_length: int = Field(1024, ge=8, description="judge prompts longer than this keep their last tokens")
    use_chat_template: Optional[bool] = Field(None, description="None: when the judge's tokenizer has one")
    dtype: DType = "float32"
    device: Optional[str] = Field(None, description="None: cuda when available, else cpu")

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if "{completion}" not in self.template:
            raise ValueError("judge template needs a {completion} placeholder")
        if self.mode == "number" and not self.max_score > self.min_score:
            raise ValueError(f"judge max_score ({self.max_score}) must be above min_score ({self.min_score})")
        return self


def render(template: str, prompt: Any, completion: str, ground_truth: str | None) -> str:
    """``template`` with its placeholders filled (plain replacement: other braces stay as they are).

    >>> render("Q: {prompt} A: {completion} ({ground_truth}) {x}", "1+1?", "2", None)
    'Q: 1+1? A: 2 () {x}'
    """
    values = (prompt_text(prompt), completion, "" if ground_truth is None else str(ground_truth))
    for key, value in zip(_PLACEHOLDERS, values):
        template = template.replace(key, value)
    return template


def prompt_text(prompt: Any) -> str:
    """A prompt as text: a string as it is, a message list as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)


def parse_number_score(answer: str, min_score: float, max_score: float) -> float | None:
    """The first number in ``answer`` clipped to ``[min_score, max_score]`` and mapped to [0, 1]; None without one.

    >>> [parse_number_score(a, 0, 10) for a in [" 7/10", "Score: 12", "-3", "about 2.5 points", "none"]]
    [0.7, 1.0, 0.0, 0.25, None]
    """
    match = _FIRST_NUMBER.search(answer)
    if match is None:
        return None
    value = min(max(float(match.group()), min_score), max_score)
    return (value - min_score) / (max_score - min_score)


def single_token_id(tokenizer: Any, word: str, field: str) -> int:
    """The one token id of ``word``; a :class:`ConfigError` naming the word and its pieces otherwise."""
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ConfigError(
            f"judge {field} {word!r} is {len(ids)} tokens of the judge's tokenizer ({pieces}), not one; "
            "pick a word that is a single token (often with a leading space, e.g. ' Yes')"
        )
    return ids[0]


class JudgeReward:
    """``JudgeReward(config).score(prompts, completions, ground_truths) -> list[float]`` in [0, 1].

    ``metrics()`` gives, since its previous call, ``judge/parse_errors`` (answers without a number),
    ``judge/mean`` (mean score), ``judge/truncated`` (judge prompts cut to ``max_length``),
    ``judge/seconds`` and, for yes/no, ``judge/yes_no_mass``.
    """

    def __init__(self, config: JudgeConfig, model: torch.nn.Module | None = None, tokenizer: Any = None):
        self.config = c = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(c.model)
        if self.tokenizer.pad_token_id is None:
            raise ConfigError(f"the judge's tokenizer ({c.model}) has neither a pad nor an EOS token")
        if c.mode == "yes_no":  # checked before the weights load
            self.yes_id = single_token_id(self.tokenizer, c.yes_token, "yes_token")
            self.no_id = single_token_id(self.tokenizer, c.no_token, "no_token")
            if self.yes_id == self.no_id:
                raise ConfigError(f"judge yes_token {c.yes_token!r} and no_token {c.no_token!r} are the same token")
        device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = model if model is not None else load_causal_lm(c.model, dtype=c.dtype, trainable=False)
        self.model = model.eval().requires_grad_(False).to(device)
        self.head = base_module(self.model).get_output_embeddings()
        chat = c.use_chat_template
        self.chat = bool(getattr(self.tokenizer, "chat_template", None)) if chat is None else chat
        if self.chat and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"judge use_chat_template is true but the tokenizer of {c.model} has no chat template")
        self.parse_errors_total = 0
        self.last_answers: list[str] = []  # number mode: the judge's answers of the last score() call
        self._logged_first = False
        self._reset()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _reset(self) -> None:
        self._stats = {"parse_errors": 0, "sum": 0.0, "n": 0, "truncated": 0, "seconds": 0.0, "mass": 0.0}

    def judge_prompt(self, prompt: Any, completion: str, ground_truth: str | None) -> str:
        """The text the judge reads for one row (after its chat template, when it uses one)."""
        text = render(self.config.template, prompt, completion, ground_truth)
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return text

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"]
        if len(ids) > self.config.max_length:
            self._stats["truncated"] += 1
            ids = ids[-self.config.max_length :]
        return ids

    @torch.no_grad()
    def score(self, prompts: Sequence[Any], completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
        if not len(prompts) == len(completions) == len(ground_truths):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(ground_truths)} ground truths")
        t0 = time.perf_counter()
        texts = [self.judge_prompt(p, c, g) for p, c, g in zip(prompts, completions, ground_truths)]
        if texts and not self._logged_first:
            self._logged_first = True
            log.info("judge %s (%s) reads, for the first row:\n%s", self.config.model, self.config.mode, texts[0])
        ids = [self._encode(t) for t in texts]
        scores: list[float] = []
        self.last_answers = []
        bs = self.config.batch_size
        for start in range(0, len(ids), bs):
            chunk = ids[start : start + bs]
            if self.config.mode == "yes_no":
                scores += self._yes_no(chunk)
            else:
                scores += self._number(chunk, start)
        self._stats["sum"] += sum(scores)
        self._stats["n"] += len(scores)
        self._stats["seconds"] += time.perf_counter() - t0
        return scores

    def _yes_no(self, chunk: list[list[int]]) -> list[float]:
        pad = self.tokenizer.pad_token_id
        ids = pad_to(chunk, pad).to(self.device)
        mask = pad_to([[1] * len(x) for x in chunk], 0).to(self.device)
        # the head on each row's last token only: [rows, V], never [rows, T, V] (49k columns on a real vocabulary)
        hidden = last_hidden_states(self.model, input_ids=ids, attention_mask=mask, use_cache=False)
        last = hidden[torch.arange(len(chunk), device=self.device), mask.sum(-1) - 1]
        logp = torch.log_softmax(self.head(last).float(), dim=-1)
        yes, no = logp[:, self.yes_id], logp[:, self.no_id]
        self._stats["mass"] += (yes.exp() + no.exp()).sum().item()
        return torch.sigmoid(yes - no).cpu().tolist()

    def _number(self, chunk: list[list[int]], first_index: int) -> list[float]:
        c = self.config
        answers = greedy_completions(self.model, self.tokenizer, chunk, c.max_new_tokens, batch_size=len(chunk))
        self.last_answers += answers
        scores = []
        for i, answer in enumerate(answers):
            value = parse_number_score(answer, c.min_score, c.max_score)
            if value is None or not math.isfinite(value):
                self._stats["parse_errors"] += 1
                self.parse_errors_total += 1
                if self.parse_errors_total <= 5:  # the first few, not one line per row of a long run
                    log.warning("judge answer of row %d has no number, scored 0: %r", first_index + i, answer)
                value = 0.0
            scores.append(value)
        return scores

    def metrics(self) -> dict[str, float]:
        """Counters since the previous call (then reset)."""
        s = self._stats
        out = {
            "judge/parse_errors": float(s["parse_errors"]),
            "judge/truncated": float(s["truncated"]),
            "judge/seconds": s["seconds"],
        }
        if s["n"]:
            out["judge/mean"] = s["sum"] / s["n"]
            if self.config.mode == "yes_no":
                out["judge/yes_no_mass"] = s["mass"] / s["n"]
        self._reset()
        return out
