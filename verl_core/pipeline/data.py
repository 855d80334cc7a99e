"""Rows a stage reads: a configured data source or the bundled task's split, and the pairs a
preference-data record points at."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from verl_core.config import ConfigError
from verl_core.pipeline.config import DataSource
from verl_core.pipeline.records import StageRecord


def load_data(source: DataSource, bundled: Callable[[int | None], list[dict]] | None = None, where: str = "data") -> list[dict]:
    """Rows of ``source`` in the stage's field names (its ``columns`` and ``prompt_template`` applied);
    ``bundled(limit)`` when it names no path. ``where`` (the config key) names it in errors."""
    if source.path is None:
        if bundled is None:
            raise ConfigError("this data source needs a path")
        return bundled(source.limit)
    from verl_core.data import load_rows
    from verl_core.data.columns import map_columns

    rows = load_rows(source.path, source.split).to_list()
    rows = rows[: source.limit] if source.limit else rows
    return map_columns(rows, source.columns, source.prompt_template, where=where)


def data_label(source: DataSource, bundled: str, task: str = "arithmetic") -> str:
    return source.path or f"bundled:{task}/{bundled}"


def agent_environment(cfg):
    """The agent task (:mod:`verl_core.agents`) of the chosen algorithm's ``environment``, or None. With one
    set, the bundled data of every step is that task's: SFT rows showing the tool use, its prompts and
    its held-out rows, and evaluation runs greedy episodes with its tools."""
    section = getattr(cfg.policy_optimisation, cfg.policy_optimisation.algorithm, None)
    name = getattr(section, "environment", None)
    if name is None:
        return None
    from verl_core.agents import get_environment

    return get_environment(name)


def bundled_rows(cfg, split: str, limit: int, default: Callable[[int], list[dict]]) -> list[dict]:
    """``limit`` bundled rows of ``split`` (``prompt_rows``, ``eval_rows``, ``sft_rows``): the agent task's
    when it has them, else ``default``'s (the arithmetic task)."""
    env = agent_environment(cfg)
    rows = getattr(env, split, None) if env is not None else None
    return (rows or default)(limit)


def preference_rows_of(record: StageRecord, columns: dict[str, str] | None = None) -> list[dict]:
    """Pairs from a preference-data record: its ``pairs.jsonl``, its ``pairs/`` ``save_to_disk`` folder
    (what ``verl_core.preference_data`` writes), or the record's path itself (any loadable file/folder).
    ``columns`` (``preference_data.columns``) maps the fields of pairs the user gave."""
    from verl_core.data import load_rows
    from verl_core.data.columns import map_columns

    path = Path(record.output_path)
    for candidate in (path / "pairs.jsonl", path / "pairs"):
        if candidate.exists():
            return load_rows(str(candidate)).to_list()
    return map_columns(load_rows(str(path)).to_list(), columns if record.given else None, where="preference_data")


def prompt_rows(rows: list[dict]) -> list[dict]:
    """Prompt rows from pairs without a ``prompt`` field (Anthropic HH): the shared dialogue prefix."""
    from verl_core.data.formats import split_implicit_prompt

    out = []
    for i, row in enumerate(rows):
        if row.get("prompt") is None and "chosen" in row and "rejected" in row:
            row = {**row, "prompt": split_implicit_prompt(row["chosen"], row["rejected"], i)[0]}
        out.append(row)
    return out
