"""Agent environments by name (:data:`ENVIRONMENTS`), the settings that pick one, and the sampler that
runs episodes for the online trainers.

An :class:`Environment` is an agent task: its tools, the parser of their calls, ``max_turns``, an
optional system prompt and, for a bundled task, its prompt / evaluation / SFT rows. The online
trainers' configs take :class:`AgentSettings` (``environment``, ``tools``, ``tool_parser``,
``max_turns``, ``max_response_tokens``), checked against the registries with an error naming the key,
so the pipeline section ``policy_optimisation.<algorithm>`` and ``--set policy_optimisation.grpo.
environment=calculator_arithmetic`` have them for free.

:class:`EpisodeSampler` wraps a rollout backend: its ``generate`` runs whole episodes
(:meth:`~verl_core.agents.episodes.AgentLoop.run`), so the trainer's collect, dynamic sampling,
scoring and update take multi-turn batches unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from verl_core.agents.chat import ChatFormat
from verl_core.agents.episodes import AgentLoop, Episode, episode_metrics
from verl_core.agents.parsers import TOOL_CALL_PARSERS, get_parser
from verl_core.agents.tools import TOOLS, get_tools
from verl_core.config import StrictConfig
from verl_core.rollout.contract import RolloutBackend, RolloutBatch, SamplingParams

Rows = Callable[[int], list[dict]]


@dataclass(frozen=True)
class Environment:
    name: str
    tools: tuple[str, ...]
    parser: str = "hermes"
    max_turns: int = 4
    system_prompt: str | None = None
    summary: str = ""
    prompt_rows: Rows | None = None  # bundled RL prompts {"prompt", "ground_truth"}; None: the user's prompts
    eval_rows: Rows | None = None  # bundled held-out rows {"prompt", "ground_truth"}
    sft_rows: Rows | None = None  # bundled SFT rows showing the tool use ({"messages"}: one row per assistant turn)


ENVIRONMENTS: dict[str, Environment] = {}


def register_environment(env: Environment, overwrite: bool = False) -> Environment:
    if env.name in ENVIRONMENTS and not overwrite:
        raise ValueError(f"environment {env.name!r} is already registered")
    get_tools(env.tools), get_parser(env.parser)  # a bad entry fails where it is written
    ENVIRONMENTS[env.name] = env
    return env


def get_environment(name: str) -> Environment:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(sorted(ENVIRONMENTS))}")
    return ENVIRONMENTS[name]


class AgentSettings(StrictConfig):
    """Multi-turn episodes with tools (null ``environment``: single-turn sampling, as before)."""

    environment: str | None = Field(None, description="agent task by name (verl_core.agents.ENVIRONMENTS); null: no tools")
    tools: list[str] | None = Field(None, description="tools by name (verl_core.agents.TOOLS); null: the environment's")
    tool_parser: str | None = Field(None, description="tool-call format: hermes | pythonic; null: the environment's")
    max_turns: int | None = Field(None, ge=1, description="policy turns per episode; null: the environment's")
    max_response_tokens: int | None = Field(
        None, ge=1, description="an episode's whole continuation (policy + tool tokens); null: max_turns × (max_new_tokens + 128)"
    )

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, name):
        return None if name is None else get_environment(name).name

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, names):
        return None if names is None else list(get_tools(names))

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, name):
        return None if name is None else (get_parser(name) and name)

    @model_validator(mode="after")
    def _tools_need_an_environment(self):
        if self.environment is None and (self.tools is not None or self.tool_parser is not None):
            raise ValueError(f"tools / tool_parser need an environment (one of: {', '.join(sorted(ENVIRONMENTS))})")
        return self


def build_agent_loop(settings: AgentSettings, tokenizer, max_new_tokens: int) -> AgentLoop:
    """The loop ``settings`` describe (the environment's defaults where a setting is null)."""
    env = get_environment(settings.environment)
    tools = get_tools(settings.tools if settings.tools is not None else env.tools)
    turns = settings.max_turns or env.max_turns
    budget = settings.max_response_tokens or turns * (max_new_tokens + 128)
    chat = ChatFormat(tokenizer, [t.schema() for t in tools.values()], env.system_prompt)
    return AgentLoop(tools, get_parser(settings.tool_parser or env.parser), chat, turns, budget)


def tokenize_agent_prompts(loop: AgentLoop, rows: Any, max_prompt_length: int) -> list[dict]:
    """Prompt rows -> ``{"prompt_ids", "prompt", "ground_truth"}`` with the tools in the chat template."""
    from verl_core.data import load_rows
    from verl_core.data.errors import DataError

    out = []
    for i, row in enumerate(load_rows(rows)):
        if not row.get("prompt"):
            raise DataError(f"row {i}: missing field 'prompt'")
        ids = loop.chat.prompt_ids(row["prompt"])
        if len(ids) > max_prompt_length:
            raise DataError(
                f"row {i}: prompt is {len(ids)} tokens with the tools, longer than max_prompt_length {max_prompt_length}"
            )
        truth = row.get("ground_truth")
        out.append({"prompt_ids": ids, "prompt": row["prompt"], "ground_truth": None if truth is None else str(truth)})
    return out


class EpisodeSampler:
    """A rollout backend whose ``generate`` samples whole episodes through ``inner`` (see module doc);
    :attr:`episodes` and :meth:`metrics` describe the last call."""

    def __init__(self, inner: RolloutBackend, loop: AgentLoop):
        self.inner, self.loop = inner, loop
        self.episodes: list[Episode] = []

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seed: int | Sequence[int] = 0
    ) -> RolloutBatch:
        batch, self.episodes = self.loop.run(self.inner, prompt_ids, params, seed)
        return batch

    def metrics(self) -> dict[str, float]:
        return episode_metrics(self.episodes)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.inner.sync_weights(model)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def evaluate_episodes(
    backend: RolloutBackend, loop: AgentLoop, rows: list[dict], reward: str, max_new_tokens: int, max_prompt_length: int = 256
) -> tuple[float, list[float], list[Episode]]:
    """Greedy episodes on held-out rows: mean rule reward (of the policy's text), each score, the episodes."""
    from verl_core.rewards.rules import get_rule_reward
    from verl_core.rollout.contract import decode_responses

    examples = tokenize_agent_prompts(loop, rows, max_prompt_length)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    batch, episodes = loop.run(backend, [e["prompt_ids"] for e in examples], params, 0)
    texts = decode_responses(loop.tokenizer, batch)
    scores = [float(s) for s in get_rule_reward(reward)(texts, [e["ground_truth"] for e in examples])]
    return sum(scores) / max(1, len(scores)), scores, episodes


__all__ = [
    "ENVIRONMENTS",
    "TOOL_CALL_PARSERS",
    "TOOLS",
    "AgentSettings",
    "Environment",
    "EpisodeSampler",
    "build_agent_loop",
    "evaluate_episodes",
    "get_environment",
    "register_environment",
    "tokenize_agent_prompts",
]
