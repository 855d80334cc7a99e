"""Every data file a run will read, checked before its first step.

Without this, ``evaluation.data.path=/nonexistent`` failed only after SFT, the reward model and PPO had
trained (133 s), and a prompt file without ``ground_truth`` failed at the first reward. For every enabled
stage that reads a file (``sft.data``, ``preference_data.prompts`` or ``.path``,
``policy_optimisation.prompts``, ``evaluation.data``) the file is loaded with the stage's column mapping
and each row is checked for the fields that stage reads; an error names the config key, the file, the
row and its line. A ``ground_truth`` is required where a configured rule reward cannot score without one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from verl_core.algorithms.registry import ALGORITHMS
from verl_core.data.errors import DataError
from verl_core.data.files import line_of_row
from verl_core.pipeline.config import DataSource, PipelineConfig
from verl_core.pipeline.data import load_data, pairs_source, prompt_rows
from verl_core.pipeline.registry import given_record, stage_enabled
from verl_core.rewards.rules import get_rule_reward


def rule_needs_ground_truth(name: str) -> bool:
    """Whether rule ``name`` needs a ground truth: the rules' contract is a ValueError when given None."""
    try:
        get_rule_reward(name)(["0"], [None])
    except ValueError:
        return True
    return False


@dataclass(frozen=True)
class DataNeed:
    key: str  # the config key of the source
    source: DataSource
    fields: tuple[tuple[str, ...], ...]  # each row needs every field of one of these alternatives
    why: str


def _prompt_fields(rules) -> tuple[tuple[str, ...], ...]:
    truth = any(rule_needs_ground_truth(r) for r in rules or ())
    return (("prompt", "ground_truth"),) if truth else (("prompt",),)


def data_needs(config: PipelineConfig) -> Iterator[DataNeed]:
    """The files the enabled stages of ``config`` read, and the fields each of their rows needs."""
    if stage_enabled(config, "sft") and given_record(config, "sft") is None and config.sft.data.path:
        yield DataNeed("sft.data", config.sft.data, (("prompt", "completion"), ("messages",)), "SFT rows")
    pd = config.preference_data
    if pd.path and not Path(pd.path).expanduser().exists():
        raise DataError(f"preference_data.path: data path does not exist: {pd.path}")
    if pd.path and Path(pd.path).expanduser().is_file():  # a folder is a preference-data stage's output
        pairs = (("prompt", "chosen", "rejected"), ("chosen", "rejected"), ("prompt", "completion", "label"))
        yield DataNeed("preference_data.path", pairs_source(pd), pairs, "preference rows")
    if stage_enabled(config, "preference_data") and pd.path is None and pd.method == "sample_and_score" and pd.prompts.path:
        rules = pd.sample_and_score.reward.reward_rules
        yield DataNeed("preference_data.prompts", pd.prompts, _prompt_fields(rules), "prompts to sample and score")
    po = config.policy_optimisation
    algorithm = ALGORITHMS.get(po.algorithm)
    if algorithm and stage_enabled(config, "policy_optimisation") and given_record(config, "policy_optimisation") is None:
        if algorithm.data == "prompts" and po.prompts.path:
            section = getattr(po, algorithm.name)
            rules = getattr(getattr(section, "reward", None), "reward_rules", None) or getattr(section, "reward_rules", None)
            yield DataNeed("policy_optimisation.prompts", po.prompts, _prompt_fields(rules), f"{algorithm.name} prompts")
    ev = config.evaluation
    if stage_enabled(config, "evaluation") and ev.data.path:
        fields = _prompt_fields([ev.reward] if ev.reward else [])
        yield DataNeed("evaluation.data", ev.data, (*fields, ("chosen", "rejected")), "held-out rows")


def _check_rows(need: DataNeed, rows: list[dict]) -> None:
    path = need.source.path
    for i, row in enumerate(rows):
        if any(all(row.get(f) is not None for f in alt) for alt in need.fields):
            continue
        best = min(need.fields, key=lambda alt: sum(row.get(f) is None for f in alt))
        missing = next(f for f in best if row.get(f) is None)
        line = line_of_row(path, i)
        needs = " or ".join("/".join(alt) for alt in need.fields)
        raise DataError(
            f"{need.key}: {path} row {i}" + (f" (line {line})" if line else "") + f": missing field {missing!r} "
            f"({need.why} need {needs}"
            + ("; map your columns with " + f"{need.key}.columns" if not need.source.columns else "")
            + ")"
        )


def check_data(config: PipelineConfig) -> None:
    """Load every file the run will read and check its rows' fields (:class:`DataError` naming key, file, row, line)."""
    for need in data_needs(config):
        rows = load_data(need.source, None, where=need.key)
        if need.key == "evaluation.data":
            rows = prompt_rows(rows)
        _check_rows(need, rows)
