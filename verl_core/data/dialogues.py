"""Rows as a chat model reads them, and a held-out part that never shares a prompt with training.

``as_chat``: plain-text rows become message lists, so the model's chat template renders them (a
chat model answers its own format, not ``"\\n\\nHuman:"`` transcripts). An Anthropic HH dialogue
(``"\\n\\nHuman: ...\\n\\nAssistant: ..."``) becomes its turns; any other prompt string one user
message, any other completion string one assistant message.

``holdout_part``: a deterministic split keyed by a hash of each row's prompt (the explicit
``prompt``, else the dialogue prefix a pair shares), so rows with the same prompt always land in
the same part and the held-out prompts are disjoint from the training prompts, whatever the order
or number of rows.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

from verl_core.data.errors import DataError

HoldoutPart = Literal["train", "held_out"]
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}
PROMPT_FIELDS = ("prompt",)
ANSWER_FIELDS = ("completion", "chosen", "rejected", "text")


def hh_messages(text: str) -> list[dict[str, str]] | None:
    """The turns of an Anthropic HH transcript (``"\\n\\nHuman: a\\n\\nAssistant: b"``), or None when
    ``text`` is not one. A trailing empty ``Assistant:`` turn (a prompt awaiting its answer) is dropped."""
    parts = _HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        return None
    messages = [{"role": _ROLES[role], "content": body.strip()} for role, body in zip(parts[1::2], parts[2::2])]
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()  # a prompt awaiting its answer (or a pair's empty answer: split_implicit_prompt names it)
    return messages or None


def as_chat(rows: list[dict[str, Any]], where: str = "data") -> list[dict[str, Any]]:
    """Rows whose text fields are message lists (see the module docstring); lists are kept as they are."""
    out = []
    for i, row in enumerate(rows):
        new = dict(row)
        for field in (*PROMPT_FIELDS, *ANSWER_FIELDS):
            value = row.get(field)
            if value is None or isinstance(value, list):
                continue
            if not isinstance(value, str):
                raise DataError(f"{where}: row {i} field {field!r} is {type(value).__name__}, not text or messages")
            dialogue = hh_messages(value)
            if dialogue is not None:
                new[field] = dialogue
            else:
                new[field] = [{"role": "user" if field in PROMPT_FIELDS else "assistant", "content": value}]
        out.append(new)
    return out


def row_prompt(row: dict[str, Any], i: int) -> Any:
    """What a row asks: its ``prompt``, else the shared prefix of ``chosen``/``rejected``, else its text."""
    from verl_core.data.formats import split_implicit_prompt

    if row.get("prompt") is not None:
        return row["prompt"]
    if row.get("chosen") is not None and row.get("rejected") is not None:
        try:
            return split_implicit_prompt(row["chosen"], row["rejected"], i)[0]
        except DataError:  # an unusable pair still belongs to one part; the stage reading it names it
            return row["chosen"]
    for field in ("messages", "text"):
        if row.get(field) is not None:
            return row[field]
    raise DataError(f"row {i}: no prompt to split by (it has {sorted(row)})")


def usable_pairs(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """The pair rows a preference trainer can read (an answer after the prompt on both sides, the two
    different), and the indices of the others. Rows that are not pairs are kept."""
    from verl_core.data.formats import split_implicit_prompt

    kept, dropped = [], []
    for i, row in enumerate(rows):
        if row.get("chosen") is None or row.get("rejected") is None:
            kept.append(row)
            continue
        try:
            if row.get("prompt") is None:
                _, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"], i)
            else:
                chosen, rejected = row["chosen"], row["rejected"]
            usable = bool(chosen) and bool(rejected) and chosen != rejected
        except DataError:
            usable = False
        (kept if usable else dropped).append(row if usable else i)
    return kept, dropped


def holdout_part(rows: list[dict[str, Any]], fraction: float, part: HoldoutPart, seed: int = 0) -> list[dict[str, Any]]:
    """The rows of ``part``: a row is held out when the hash of (seed, its prompt) falls below
    ``fraction``, so a prompt never appears in both parts. Order is kept."""
    if not 0 < fraction < 1:
        raise ValueError(f"holdout fraction must be in (0, 1), got {fraction}")
    keep = []
    for i, row in enumerate(rows):
        key = json.dumps([seed, row_prompt(row, i)], sort_keys=True, ensure_ascii=False)
        held_out = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 < fraction
        if held_out == (part == "held_out"):
            keep.append(row)
    return keep
