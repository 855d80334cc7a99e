"""Load rows from JSONL / JSON / Parquet / CSV files, `save_to_disk` folders, Python
lists, `datasets` objects, or hub ids (when online)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets

from verl_core.data.errors import DataError
from verl_core.data.files import READERS, check_column_types
from verl_core.data.hub import hub_id, hub_offline, not_found_hint


def load_rows(source: Any, split: str = "train") -> datasets.Dataset:
    """Return ``source`` as a non-empty ``datasets.Dataset``.

    ``source`` may be a Dataset, a DatasetDict (``split`` is taken), a list of dicts,
    a file path (``.jsonl``, ``.json``, ``.parquet``, ``.csv``, optionally ``.gz``), a
    folder written by ``save_to_disk``, or a hub dataset id written ``hf://org/name`` (needs network;
    see :mod:`verl_core.data.hub`).
    """
    ds = _load(source, split)
    if len(ds) == 0:
        raise DataError(f"dataset {_name(source)} is empty (0 rows)")
    return ds


def _load(source: Any, split: str) -> datasets.Dataset:
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise DataError(f"dataset has no split {split!r}; splits: {sorted(source)}")
        return source[split]
    if isinstance(source, (list, tuple)):
        return _from_list(source)
    if isinstance(source, (str, os.PathLike)):
        return _from_path_or_id(str(source), split)
    raise DataError(f"cannot load a dataset from {type(source).__name__}; give rows, a path or a hub id")


def _from_list(rows: Iterable[Any], where: str = "") -> datasets.Dataset:
    rows = list(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"row {i}: expected a dict, got {type(row).__name__}")
    if not rows:
        raise DataError("dataset is empty (0 rows)")
    check_column_types(rows, where)
    try:
        return datasets.Dataset.from_list(rows)
    except (TypeError, ValueError, datasets.exceptions.DatasetGenerationError) as err:
        raise DataError(f"rows do not share one schema: {err}") from None
    except Exception as err:  # pyarrow type clashes between rows
        raise DataError(f"rows do not share one schema: {err}") from None


def _from_path_or_id(text: str, split: str) -> datasets.Dataset:
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
            raise DataError(f"{path} is a folder but not one written by save_to_disk")
        return _load(datasets.load_from_disk(str(path)), split)
    if path.is_file():
        return _from_file(path)
    repo = hub_id(text)
    if repo is None:
        raise DataError(f"data path does not exist: {text}{not_found_hint(text)}")
    if hub_offline():
        raise DataError(f"{text!r} is not a local path, and hub downloads are off (HF_HUB_OFFLINE=1)")
    try:
        return _load(datasets.load_dataset(repo), split)
    except Exception as err:
        raise DataError(f"could not load hub dataset {repo!r}: {err}") from None


def _from_file(path: Path) -> datasets.Dataset:
    suffixes = [s for s in path.suffixes if s != ".gz"]
    suffix = suffixes[-1] if suffixes else ""
    if suffix == ".parquet":
        try:
            return datasets.load_dataset("parquet", data_files=str(path), split="train")
        except Exception as err:
            raise DataError(f"{path}: could not be read as parquet: {err}") from None
    if suffix not in READERS:
        raise DataError(f"{path}: unknown file type; use one of {sorted([*READERS, '.parquet'])} (optionally .gz)")
    try:
        rows, lines = READERS[suffix](path)
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err})") from None
    if not rows:
        raise DataError(f"{path} is empty: it holds no rows")
    check_column_types(rows, f"{path} ", lines)
    return _from_list(rows, where=f"{path} ")


def _name(source: Any) -> str:
    return repr(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__
