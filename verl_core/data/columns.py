"""Users' data in their own columns: rename fields and fill a prompt template before validation.

A stage reads fixed field names (``prompt``, ``completion``, ``chosen``, ``ground_truth``...).
``columns`` maps each of those to the column of the user's data that holds it, so published
datasets load as they are: GSM8K is ``{prompt: question, completion: answer}`` for SFT and
``{prompt: question, ground_truth: answer}`` for prompts. A ``prompt_template`` (``str.format``
over the row's original columns and the mapped fields) turns a bare question into the prompt
the model sees, e.g. ``"Question: {question}\\nAnswer:"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_core.data.errors import DataError


def map_columns(
    rows: list[dict[str, Any]],
    columns: Mapping[str, str] | None = None,
    prompt_template: str | None = None,
    where: str = "data",
) -> list[dict[str, Any]]:
    """Rows with ``row[field] = row[columns[field]]`` for every mapped field, then the template.

    Unmapped columns are kept. A missing column or template placeholder raises a
    :class:`DataError` naming ``where``, the row and the columns the row has.

    >>> map_columns([{"question": "1+1?", "answer": "#### 2"}], {"prompt": "question"}, "Q: {prompt}\\nA:")
    [{'question': '1+1?', 'answer': '#### 2', 'prompt': 'Q: 1+1?\\nA:'}]
    """
    if not columns and prompt_template is None:
        return rows
    out = []
    for i, row in enumerate(rows):
        mapped = dict(row)
        for field, column in (columns or {}).items():
            if column not in row:
                raise DataError(f"{where}.columns: row {i} has no column {column!r} (for {field!r}); it has {sorted(row)}")
            mapped[field] = row[column]
        if prompt_template is not None:
            try:
                mapped["prompt"] = prompt_template.format_map(mapped)
            except KeyError as err:
                raise DataError(
                    f"{where}.prompt_template: row {i} has no column {err.args[0]!r}; it has {sorted(mapped)}"
                ) from None
            except (IndexError, ValueError) as err:
                raise DataError(f"{where}.prompt_template {prompt_template!r} is not a valid format string: {err}") from None
        out.append(mapped)
    return out
