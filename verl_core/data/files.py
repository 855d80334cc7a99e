"""Read JSONL, JSON and CSV files into rows ourselves, so that every error names the file and line.

``datasets``' builders report a bad line as "An error occurred while generating the dataset" and
infer CSV column types (an answer column of digits becomes int). Here: JSON values keep their JSON
types, CSV values stay strings (except a ``label`` column of true/false, which KTO reads as
booleans), a CSV record must have as many fields as the header and quoting must be well formed,
and a column must hold one type across rows (checked in :func:`check_column_types`).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path
from typing import Any

from verl_core.data.errors import DataError

BOOL_WORDS = {"true": True, "false": False}


def _text(path: Path) -> str:
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataError(f"{path} line {line}: not valid UTF-8 (byte 0x{raw[err.start]:02x}); save the file as UTF-8") from None


def read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """Rows of a JSON Lines file and the line each came from (blank lines are skipped)."""
    rows, lines = [], []
    for n, line in enumerate(_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path} line {n}: not valid JSON ({err.msg} at column {err.colno}); each line must be one object"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(n)
    return rows, lines


def read_json(path: Path) -> tuple[list[dict], list[int] | None]:
    """Rows of a JSON file holding a list of objects (or an object of equally long columns)."""
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"{path} line {err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise DataError(f"{path}: columns have different lengths {sorted(lengths)}")
        data = [dict(zip(data, vals)) for vals in zip(*data.values())]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of objects (or an object of columns), got {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: expected an object, got {type(row).__name__}")
    return data, None


def read_csv(path: Path) -> tuple[list[dict], list[int]]:
    """Rows of a CSV file with a header; values stay strings. A record with the wrong number of fields
    or broken quoting (a quote left open merges lines) is an error naming its line."""
    reader = csv.reader(io.StringIO(_text(path), newline=""), strict=True)
    rows, lines = [], []
    try:
        header = next(reader, None)
        if header is None:
            return [], []
        start = reader.line_num + 1
        for record in reader:
            if not record:
                start = reader.line_num + 1
                continue
            if len(record) != len(header):
                raise DataError(
                    f"{path} line {start}: {len(record)} fields, the header has {len(header)}"
                    + (f" (this record runs to line {reader.line_num}: a quote left open?)" if reader.line_num > start else "")
                )
            row = dict(zip(header, record))
            if "label" in row:
                word = row["label"].strip().lower()
                if word not in BOOL_WORDS:
                    raise DataError(f"{path} line {start}: field 'label' must be true or false, got {row['label']!r}")
                row["label"] = BOOL_WORDS[word]
            rows.append(row)
            lines.append(start)
            start = reader.line_num + 1
    except csv.Error as err:
        raise DataError(f"{path} line {start}: malformed CSV ({err}); check the quotes from this line on") from None
    return rows, lines


READERS = {".jsonl": read_jsonl, ".json": read_json, ".csv": read_csv}


def _kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def check_column_types(rows: list[dict], where: str, lines: list[int] | None = None) -> None:
    """Each field must hold one kind of value across rows (Arrow needs one type per column); the error
    names the first row that differs and the row that set the kind."""
    first: dict[str, tuple[str, int]] = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            kind = _kind(value)
            if kind is None:
                continue
            seen = first.setdefault(key, (kind, i))
            if seen[0] != kind:
                at = f"line {lines[i]}" if lines else f"row {i}"
                then = f"line {lines[seen[1]]}" if lines else f"row {seen[1]}"
                raise DataError(
                    f"{where}{at}: field {key!r} is a {kind} ({value!r:.60}), but it is a {seen[0]} at {then}; "
                    "a field must have one type in every row"
                )


def line_of_row(source: Any, row: int) -> int | None:
    """The line of ``source``'s ``row`` (a JSONL or CSV path), to name it in errors found after loading."""
    path = Path(str(source)).expanduser()
    suffixes = [s for s in path.suffixes if s != ".gz"]
    reader = READERS.get(suffixes[-1] if suffixes else "")
    if reader is None or reader is read_json or not path.is_file():
        return None
    try:
        _, lines = reader(path)
    except DataError:
        return None
    return lines[row] if 0 <= row < len(lines) else None


def naming_source(err: DataError, source: Any) -> DataError:
    """``err`` about ``row i`` of rows loaded from ``source`` (a file), naming the file and the row's line."""
    import re

    if source is None or str(source) in str(err):
        return err
    match = re.match(r"row (\d+): ", str(err))
    if match is None:
        return DataError(f"{source}: {err}")
    line = line_of_row(source, int(match.group(1)))
    where = f"{source} row {match.group(1)}" + (f" (line {line})" if line else "")
    return DataError(f"{where}: {str(err)[match.end() :]}")


def names_source(fn):
    """Decorate a ``tokenize_*(source, ...)``: a :class:`DataError` about ``row i`` of a file source is
    re-raised naming the file and the row's line (the row checks run after loading, on plain rows)."""
    import functools
    import os

    @functools.wraps(fn)
    def wrapper(source, *args, **kwargs):
        try:
            return fn(source, *args, **kwargs)
        except DataError as err:
            if not isinstance(source, (str, os.PathLike)):
                raise
            named = naming_source(err, source)
            if named is err:
                raise
            raise named from None

    return wrapper
