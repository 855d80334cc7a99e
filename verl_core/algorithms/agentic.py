"""The online trainers' agent side (``environment`` set, :mod:`verl_core.agents`): their prompts and
their evaluation by greedy episodes, which also reports a table of sample trajectories."""

from __future__ import annotations

from typing import Any

from verl_core.agents.environments import get_environment, tokenize_agent_prompts
from verl_core.agents.episodes import AgentLoop
from verl_core.bundled import arithmetic
from verl_core.data import tokenize_prompts


def online_prompts(config, prompts: Any, tokenizer, agent: AgentLoop | None) -> list[dict]:
    """Tokenized prompt rows: ``prompts``, else the environment's bundled prompts, else the bundled
    arithmetic task's; with an agent through its chat format (the tools in the template)."""
    if agent is None:
        return tokenize_prompts(arithmetic.prompt_rows() if prompts is None else prompts, tokenizer, config.max_prompt_length)
    if prompts is None:
        bundled = get_environment(config.environment).prompt_rows
        prompts = bundled(512) if bundled is not None else arithmetic.prompt_rows()
    return tokenize_agent_prompts(agent, prompts, config.max_prompt_length)


def evaluate_agent(trainer, lm) -> dict[str, float]:
    """Held-out accuracy of greedy episodes (``eval/accuracy``), their tool metrics (``eval/agent/*``),
    and the first episodes as a table and as samples (:meth:`~verl_core.train.callbacks.Callback.on_table`,
    :meth:`~verl_core.train.callbacks.Callback.on_samples`: MLflow traces)."""
    from verl_core.agents.environments import evaluate_episodes
    from verl_core.agents.episodes import episode_metrics, episode_samples, trajectory_table
    from verl_core.rollout.hf_backend import HFRolloutBackend

    c, tok = trainer.config, trainer.policy.tokenizer
    backend = HFRolloutBackend(lm, tok.eos_token_id, tok.pad_token_id)
    accuracy, scores, episodes = evaluate_episodes(
        backend, trainer.agent, trainer.eval_prompts, c.eval_reward, c.max_new_tokens, c.max_prompt_length
    )
    engine = trainer.engine
    if engine is not None and engine.is_main:
        table = trajectory_table(episodes, scores, tok)
        samples = episode_samples(episodes, scores, tok)
        for cb in trainer.callbacks:
            cb.on_table(engine.step, "agent_trajectories", table)
            cb.on_samples(engine.step, "evaluation", samples)
    metrics = {f"eval/{k}": v for k, v in episode_metrics(episodes).items()}
    return {"eval/accuracy": accuracy, **metrics}
