"""Agentic RL: tools, tool-call parsers, multi-turn episodes over the rollout backends, agent tasks.

``verl_core.sandbox.runner`` (the python tool's child-process sandbox) is imported only when a
program runs.
"""

from verl_core.agents import tasks  # noqa: F401  (registers the bundled environments)
from verl_core.agents.environments import (
    ENVIRONMENTS,
    AgentSettings,
    Environment,
    EpisodeSampler,
    build_agent_loop,
    evaluate_episodes,
    get_environment,
    register_environment,
    tokenize_agent_prompts,
)
from verl_core.agents.episodes import AgentLoop, Episode, episode_metrics, episode_samples, trajectory_table
from verl_core.agents.parsers import TOOL_CALL_PARSERS, ParsedTurn, register_parser
from verl_core.agents.tools import TOOLS, Tool, ToolCall, ToolResult, call_tools, register_tool

__all__ = [
    "ENVIRONMENTS",
    "TOOLS",
    "TOOL_CALL_PARSERS",
    "AgentLoop",
    "AgentSettings",
    "Environment",
    "Episode",
    "EpisodeSampler",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolResult",
    "build_agent_loop",
    "call_tools",
    "episode_metrics",
    "episode_samples",
    "evaluate_episodes",
    "get_environment",
    "register_environment",
    "register_parser",
    "register_tool",
    "tokenize_agent_prompts",
    "trajectory_table",
]
