"""Rows a stage reads: a configured data source or the bundled task's split, and the pairs a
preference-data record points at."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from verl_core.config import ConfigError
from verl_core.pipeline.config import GIVEN_PAIRS_FIELDS, DataSource
from verl_core.pipeline.records import StageRecord

log = logging.getLogger(__name__)


def load_data(source: DataSource, bundled: Callable[[int | None], list[dict]] | None = None, where: str = "data") -> list[dict]:
    """Rows of ``source`` in the stage's field names (its ``columns`` and ``prompt_template`` applied);
    ``bundled(limit)`` when it names no path. ``where`` (the config key) names it in errors."""
    if source.path is None:
        if bundled is None:
            raise ConfigError("this data source needs a path")
        return shaped_rows(bundled(source.limit), source.chat, None, None, where)
    from verl_core.data import load_rows
    from verl_core.data.columns import map_columns

    rows = load_rows(source.path, source.split).to_list()
    if source.holdout is None and not source.drop_unusable_pairs:  # the first N rows: no need to map the whole file
        rows = rows[: source.limit] if source.limit else rows
    rows = map_columns(rows, source.columns, source.prompt_template, where=where)
    return shaped_rows(rows, source.chat, source.holdout, source.limit, where, source.drop_unusable_pairs)


def shaped_rows(
    rows: list[dict], chat: bool, holdout, limit: int | None, where: str, drop_unusable_pairs: bool = False
) -> list[dict]:
    """``rows`` as messages when ``chat``, without unusable pairs when asked, then the ``holdout`` part
    (a :class:`Holdout`), then the first ``limit``."""
    from verl_core.data.dialogues import as_chat, holdout_part, usable_pairs

    rows = as_chat(rows, where) if chat else rows
    if drop_unusable_pairs:
        rows, dropped = usable_pairs(rows)
        if dropped:
            log.warning("%s: dropped %d unusable pairs (rows %s)", where, len(dropped), ", ".join(map(str, dropped[:10])))
    if holdout is not None:
        rows = holdout_part(rows, holdout.fraction, holdout.part, holdout.seed)
        if not rows:
            raise ConfigError(f"{where}.holdout: its {holdout.part} part has no rows; change holdout.fraction")
    return rows[:limit] if limit else rows


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


def preference_rows_of(record: StageRecord, section=None) -> list[dict]:
    """Pairs from a preference-data record: its ``pairs.jsonl``, its ``pairs/`` ``save_to_disk`` folder
    (what ``verl_core.preference_data`` writes), or the record's path itself (any loadable file/folder).
    The ``preference_data`` section's ``columns``, ``chat``, ``holdout`` and ``limit`` shape the pairs
    the user gave."""
    from verl_core.data import load_rows

    if record.given and section is not None:
        return load_data(pairs_source(section), where="preference_data")
    path = Path(record.output_path)
    for candidate in (path / "pairs.jsonl", path / "pairs"):
        if candidate.exists():
            return load_rows(str(candidate)).to_list()
    return load_rows(str(path)).to_list()


def pairs_source(section) -> DataSource:
    """The pairs the ``preference_data`` section gives, as a data source (same mapping, part and length)."""
    return DataSource(path=section.path, **{k: getattr(section, k) for k in GIVEN_PAIRS_FIELDS})


def prompt_rows(rows: list[dict]) -> list[dict]:
    """Prompt rows from pairs without a ``prompt`` field (Anthropic HH): the shared dialogue prefix."""
    from verl_core.data.formats import split_implicit_prompt

    out = []
    for i, row in enumerate(rows):
        if row.get("prompt") is None and "chosen" in row and "rejected" in row:
            row = {**row, "prompt": split_implicit_prompt(row["chosen"], row["rejected"], i)[0]}
        out.append(row)
    return out
