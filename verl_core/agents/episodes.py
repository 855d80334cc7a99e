"""Multi-turn episodes over any rollout backend: the policy's turns alternate with tool results.

The turn loop (:meth:`AgentLoop.run`) lives here, outside the backends, which only ever continue
token lists (:meth:`~verl_core.rollout.contract.RolloutBackend.generate`). Each call continues every active
episode by one policy turn, its whole history so far as the prompt; a turn that ends with EOS and
calls tools gets their answers appended (:class:`~verl_core.agents.chat.ChatFormat`) and stays
active; a turn without a call is the final answer. An episode also ends when it reaches
``max_turns`` policy turns, or ``max_response_tokens`` (its whole continuation: policy and tool
tokens), or a turn is cut by ``max_new_tokens`` before its EOS (these three are *truncated*).

Sampling is n=1 per continuation with a seed per episode and turn (:func:`episode_seed`), so an
episode is a pure function of (weights, prompt, its seed) whatever else is in the batch: a resumed
run or another split of prompts over processes samples the same episodes.

The result is a :class:`~verl_core.rollout.contract.RolloutBatch` the online trainers take as it is:
``response_ids`` is the whole continuation, ``response_attention_mask`` covers all of it and
``response_mask`` (loss, log-probs, rewards, advantages) only the tokens the policy sampled, with
the sampler's log-probs there and 0 on tool tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_core.agents.chat import ChatFormat
from verl_core.agents.parsers import ToolCallParser
from verl_core.agents.tools import Tool, ToolCall, ToolResult, call_tools
from verl_core.data import pad_to
from verl_core.rollout.contract import RolloutBackend, RolloutBatch, SamplingParams


def _mix(*parts: int) -> int:
    """A 40-bit seed from integers (small enough for every backend's seed arithmetic)."""
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=5).digest(), "little")


def episode_seed(seed: int | Sequence[int], prompt: int, sample: int) -> int:
    """Seed of sample ``sample`` of prompt ``prompt``: from the call's seed, or from the prompt's own."""
    return _mix(seed, prompt, sample) if isinstance(seed, int) else _mix(int(seed[prompt]), sample)


@dataclass
class Episode:
    """One episode's tokens and what happened in it. ``turns``: ``{"role": "assistant", "text", "tool_calls"}``
    and ``{"role": "tool", "results": [text], "ok": [bool]}`` entries, in order."""

    prompt_ids: list[int]
    group: int
    seed: int
    response: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    policy_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    finished: bool = False  # ended with a final answer (a turn without a call, closed by EOS)
    truncated: str | None = None  # why it was cut: "max_new_tokens", "max_turns", "max_response_tokens"

    def add(self, tokens: list[int], logprobs: list[float] | None) -> None:
        self.response += tokens
        self.policy_mask += [1 if logprobs is not None else 0] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


@dataclass
class AgentLoop:
    """Tools, the parser of their calls and the chat format, with the episode limits."""

    tools: dict[str, Tool]
    parser: ToolCallParser
    chat: ChatFormat
    max_turns: int = 4
    max_response_tokens: int = 512

    @property
    def tokenizer(self):
        return self.chat.tok

    def run(
        self, backend: RolloutBackend, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seed: int | Sequence[int] = 0
    ) -> tuple[RolloutBatch, list[Episode]]:
        """``params.n`` episodes per prompt (rows ``i*n .. i*n+n-1``), every active one advanced one turn per call."""
        tok = self.tokenizer
        eos = {tok.eos_token_id} if isinstance(tok.eos_token_id, int) else set(tok.eos_token_id)
        episodes = [Episode(list(p), i, episode_seed(seed, i, j)) for i, p in enumerate(prompt_ids) for j in range(params.n)]
        for turn in range(self.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            budgets = [self.max_response_tokens - len(e.response) for e in active]
            call = params.updated(n=1, max_new_tokens=max(1, min(params.max_new_tokens, max(budgets))))
            out = backend.generate([e.prompt_ids + e.response for e in active], call, [_mix(e.seed, turn) for e in active])
            lists, masks = out.response_lists(), out.response_mask.bool()
            wanting: list[tuple[Episode, list[ToolCall], list[str]]] = []
            for e, tokens, row_logp, row_mask, budget in zip(active, lists, out.logprobs, masks, budgets):
                tokens = tokens[:budget]
                e.add(tokens, row_logp[row_mask].tolist()[: len(tokens)])
                e.policy_turns += 1
                text = tok.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
                closed = bool(tokens) and tokens[-1] in eos
                parsed = self.parser(text) if closed else None
                e.turns.append({"role": "assistant", "text": text, "tool_calls": []})
                if not closed:
                    e.done, e.truncated = True, "max_response_tokens" if len(tokens) == budget else "max_new_tokens"
                elif not parsed.wants_tools:
                    e.done = e.finished = True
                elif turn == self.max_turns - 1:
                    e.done, e.truncated = True, "max_turns"
                else:
                    e.turns[-1]["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
                    wanting.append((e, parsed.calls, parsed.errors))
            self._answer(wanting)
        return self._batch(episodes), episodes

    def _answer(self, wanting: list[tuple[Episode, list[ToolCall], list[str]]]) -> None:
        """Run every call of this turn (all episodes together, so a tool can batch them), append the answers."""
        flat = [c for _, calls, _ in wanting for c in calls]
        answers = iter(call_tools(flat, self.tools))
        for e, calls, errors in wanting:
            results = [next(answers) for _ in calls] + [ToolResult(f"error: {m}", ok=False) for m in errors]
            e.tool_calls += len(results)
            e.tool_errors += sum(not r.ok for r in results)
            e.turns.append({"role": "tool", "results": [r.text for r in results], "ok": [r.ok for r in results]})
            ids = self.chat.tool_ids(results)
            if len(e.response) + len(ids) >= self.max_response_tokens:  # no room left for another policy turn
                e.done, e.truncated = True, "max_response_tokens"
            else:
                e.add(ids, None)

    def _batch(self, episodes: list[Episode]) -> RolloutBatch:
        pad = self.tokenizer.pad_token_id
        width = max(1, max(len(e.response) for e in episodes))

        def right(rows: list[list], value) -> list[list]:
            return [r + [value] * (width - len(r)) for r in rows]

        return RolloutBatch(
            prompt_ids=pad_to([e.prompt_ids for e in episodes], pad, side="left"),
            prompt_mask=pad_to([[1] * len(e.prompt_ids) for e in episodes], 0, side="left"),
            response_ids=torch.tensor(right([e.response for e in episodes], pad), dtype=torch.long),
            response_mask=torch.tensor(right([e.policy_mask for e in episodes], 0), dtype=torch.long),
            logprobs=torch.tensor(right([e.logprobs for e in episodes], 0.0), dtype=torch.float32),
            group_index=torch.tensor([e.group for e in episodes], dtype=torch.long),
            finished=torch.tensor([e.finished for e in episodes], dtype=torch.bool),
            response_attention_mask=torch.tensor(right([[1] * len(e.response) for e in episodes], 0), dtype=torch.long),
        )


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means over the episodes: policy turns, tool calls and tool errors (unknown tool, bad arguments,
    unreadable call, the tool failing) per episode, the share truncated, policy and tool tokens."""
    n = max(1, len(episodes))
    policy = sum(sum(e.policy_mask) for e in episodes)
    return {
        "agent/turns_mean": sum(e.policy_turns for e in episodes) / n,
        "agent/tool_calls_per_episode": sum(e.tool_calls for e in episodes) / n,
        "agent/tool_errors_per_episode": sum(e.tool_errors for e in episodes) / n,
        "agent/episodes_with_tool_fraction": sum(e.tool_calls > 0 for e in episodes) / n,
        "agent/truncated_fraction": sum(e.truncated is not None for e in episodes) / n,
        "agent/policy_tokens_mean": policy / n,
        "agent/tool_tokens_mean": (sum(len(e.response) for e in episodes) - policy) / n,
    }


def trajectory_table(episodes: Sequence[Episode], scores: Sequence[float], tokenizer, limit: int = 32) -> dict[str, list]:
    """The first ``limit`` episodes as table columns (MLflow ``log_table``): prompt, turns, tool calls,
    tool errors, reward and the whole transcript (prompt excluded)."""
    import json

    rows = list(zip(episodes, scores))[:limit]
    return {
        "episode": list(range(len(rows))),
        "prompt": [tokenizer.decode(e.prompt_ids, skip_special_tokens=True)[-300:] for e, _ in rows],
        "turns": [e.policy_turns for e, _ in rows],
        "tool_calls": [json.dumps([c for t in e.turns for c in t.get("tool_calls", [])]) for e, _ in rows],
        "tool_results": [json.dumps([r for t in e.turns for r in t.get("results", [])]) for e, _ in rows],
        "tool_errors": [e.tool_errors for e, _ in rows],
        "truncated": [e.truncated or "" for e, _ in rows],
        "reward": [float(s) for _, s in rows],
        "transcript": [tokenizer.decode(e.response, skip_special_tokens=False)[:2000] for e, _ in rows],
    }


def episode_samples(episodes: Sequence[Episode], scores: Sequence[float | None], tokenizer, limit: int = 8) -> list[dict]:
    """The first ``limit`` episodes as samples for MLflow traces (:mod:`verl_core.train.traces`): prompt,
    the policy's text, reward, and the turns with their tool calls and results."""
    return [
        {
            "prompt": tokenizer.decode(e.prompt_ids, skip_special_tokens=True),
            "completion": tokenizer.decode([t for t, m in zip(e.response, e.policy_mask) if m], skip_special_tokens=True),
            "reward": None if s is None else float(s),
            "turns": e.turns,
            "truncated": e.truncated,
        }
        for e, s in list(zip(episodes, scores))[:limit]
    ]
