"""Rows a stage reads: a configured data source or the bundled task's split, and the pairs a
preference-data record points at."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from verl_core.config import ConfigError
from verl_core.pipeline.config import DataSource
from verl_core.pipeline.records import StageRecord


def load_data(source: DataSource, bundled: Callable[[int | None], list[dict]] | None = None) -> list[dict]:
    """Rows of ``source``; ``bundled(limit)`` when it names no path."""
    if source.path is None:
        if bundled is None:
            raise ConfigError("this data source needs a path")
        return bundled(source.limit)
    from verl_core.data import load_rows

    rows = load_rows(source.path, source.split).to_list()
    return rows[: source.limit] if source.limit else rows


def data_label(source: DataSource, bundled: str) -> str:
    return source.path or f"bundled:arithmetic/{bundled}"


def preference_rows_of(record: StageRecord) -> list[dict]:
    """Pairs from a preference-data record: its ``pairs.jsonl``, its ``pairs/`` ``save_to_disk`` folder
    (what ``verl_core.preference_data`` writes), or the record's path itself (any loadable file/folder)."""
    from verl_core.data import load_rows

    path = Path(record.output_path)
    for candidate in (path / "pairs.jsonl", path / "pairs"):
        if candidate.exists():
            return load_rows(str(candidate)).to_list()
    return load_rows(str(path)).to_list()
