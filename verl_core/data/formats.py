"""Validate rows and turn them into token ids.

Row formats (plain strings or conversational message lists):

- SFT: ``text``; ``prompt`` + ``completion``; or ``messages`` (loss on the last
  assistant message).
- preference: ``prompt`` / ``chosen`` / ``rejected``, or implicit-prompt rows with only
  ``chosen`` / ``rejected`` that share a dialogue prefix (Anthropic HH).
- unpaired: ``prompt`` / ``completion`` / ``label`` (bool).
- prompt-only: ``prompt`` + optional ``ground_truth``.

Truncation policy: a prompt is never truncated. A prompt longer than
``max_prompt_length`` (default ``max_length - 1``) raises a :class:`DataError` naming
the row, or is dropped when ``on_long_prompt="drop"``. A completion is cut on the right
so that prompt + completion fits ``max_length`` (the end-of-sequence token is then lost).
Conversational rows go through the tokenizer's chat template; loss is only ever on
completion tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from verl_core.data.errors import DataError
from verl_core.data.files import names_source
from verl_core.data.loading import load_rows

log = logging.getLogger(__name__)
Messages = list[dict[str, str]]
LongPromptPolicy = Literal["error", "drop"]
HH_ASSISTANT = "\n\nAssistant:"


def _check_messages(value: Any, i: int, field: str) -> Messages:
    if not value:
        raise DataError(f"row {i}: field {field!r} is an empty message list")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"row {i}: field {field!r}[{j}] must be a dict with string 'role' and 'content'")
    return value


def _text_or_messages(row: dict, i: int, field: str) -> str | Messages:
    if field not in row or row[field] is None:
        raise DataError(f"row {i}: missing field {field!r}")
    value = row[field]
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"row {i}: field {field!r} is empty")
        return value
    if isinstance(value, list):
        return _check_messages(value, i, field)
    raise DataError(f"row {i}: field {field!r} must be a string or a list of messages, got {type(value).__name__}")


class _Encoder:
    """Token ids for prompts and completions, plain or through the chat template."""

    def __init__(self, tokenizer, max_length: int, max_prompt_length: int | None, on_long_prompt: LongPromptPolicy):
        if tokenizer.eos_token_id is None:
            raise DataError("tokenizer has no eos_token; set one before training")
        self.tok = tokenizer
        self.max_length = max_length
        self.max_prompt_length = min(max_prompt_length or max_length - 1, max_length - 1)
        self.on_long_prompt = on_long_prompt
        self.dropped: list[int] = []

    def ids(self, text: str, special: bool) -> list[int]:
        return self.tok(text, add_special_tokens=special)["input_ids"]

    def prompt(self, prompt: str | Messages, i: int) -> list[int] | None:
        if isinstance(prompt, str):
            ids = self.ids(prompt, special=True)
        else:
            ids = self.ids(self._template(prompt, generation=True, i=i), special=False)
        if len(ids) > self.max_prompt_length:
            if self.on_long_prompt == "drop":
                self.dropped.append(i)
                return None
            raise DataError(
                f"row {i}: prompt is {len(ids)} tokens, longer than max_prompt_length "
                f"{self.max_prompt_length} (max_length {self.max_length}); shorten it, raise the limit, "
                f"or set on_long_prompt='drop'"
            )
        return ids

    def completion(
        self, prompt: str | Messages, completion: str | Messages, prompt_ids: list[int], i: int, field: str
    ) -> list[int]:
        if isinstance(prompt, str) != isinstance(completion, str):
            raise DataError(f"row {i}: 'prompt' and {field!r} must both be strings or both be message lists")
        if isinstance(completion, str):
            ids = self.ids(completion, special=False) + [self.tok.eos_token_id]
        else:
            full = self.ids(self._template(prompt + completion, generation=False, i=i), special=False)
            if full[: len(prompt_ids)] != prompt_ids:
                raise DataError(f"row {i}: the chat template does not render the prompt as a prefix of the full dialogue")
            ids = full[len(prompt_ids) :]
            eos = self.tok.eos_token_id
            if eos in ids:  # the template's text after the turn's EOS ("<|im_end|>\n"): never sampled, so never trained
                ids = ids[: len(ids) - ids[::-1].index(eos)]
        if not ids:
            raise DataError(f"row {i}: field {field!r} encodes to no tokens")
        return ids[: self.max_length - len(prompt_ids)]

    def _template(self, messages: Messages, generation: bool, i: int) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise DataError(
                f"row {i}: a conversation (a list of messages) needs a tokenizer with a chat_template, and "
                f"{getattr(self.tok, 'name_or_path', 'this tokenizer') or 'this tokenizer'} has none: give text rows, "
                "or a model whose tokenizer has a chat template"
            )
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def report(self, what: str) -> None:
        if self.dropped:
            log.warning(
                "%s: dropped %d rows whose prompt exceeds max_prompt_length (first: row %d)",
                what,
                len(self.dropped),
                self.dropped[0],
            )


def _rows(source: Any) -> list[dict]:
    return list(load_rows(source))


RowEncoder = Callable[["_Encoder", dict, int], "dict | None"]


def _row_tokenizer(what: str, encode_row: RowEncoder, prepare: Callable[[list[dict]], list[dict]] | None = None):
    """A public ``tokenize_*(source, tokenizer, max_length, max_prompt_length, on_long_prompt)``: load the
    rows, encode each with ``encode_row`` (None: a long prompt dropped), and refuse an empty result. The
    docstring is ``encode_row``'s, so each format documents itself in one place."""

    @names_source
    def tokenize(
        source: Any,
        tokenizer,
        max_length: int = 512,
        max_prompt_length: int | None = None,
        on_long_prompt: LongPromptPolicy = "error",
    ) -> list[dict]:
        rows = _rows(source)
        enc = _Encoder(tokenizer, max_length, max_prompt_length, on_long_prompt)
        out = [encoded for i, row in enumerate(prepare(rows) if prepare else rows) if (encoded := encode_row(enc, row, i))]
        enc.report(what)
        return _nonempty(out, what)

    tokenize.__doc__ = encode_row.__doc__
    tokenize.__name__ = tokenize.__qualname__ = f"tokenize_{encode_row.__name__.strip('_').removesuffix('_row')}"
    return tokenize


def _sft_row(enc: _Encoder, row: dict, i: int) -> dict | None:
    """SFT rows → ``{"prompt_ids", "completion_ids"}`` (loss only on completion ids)."""
    if row.get("messages") is not None:
        messages = _check_messages(row["messages"], i, "messages")
        if messages[-1]["role"] != "assistant":
            raise DataError(f"row {i}: field 'messages' must end with an assistant message")
        prompt, completion = messages[:-1], messages[-1:]
        if not prompt:
            raise DataError(f"row {i}: field 'messages' has no turn before the assistant's")
    elif row.get("prompt") is not None or row.get("completion") is not None:
        prompt, completion = _text_or_messages(row, i, "prompt"), _text_or_messages(row, i, "completion")
    elif row.get("text") is not None:
        text = _text_or_messages(row, i, "text")
        if not isinstance(text, str):
            raise DataError(f"row {i}: field 'text' must be a string")
        ids = enc.ids(text, special=True) + [enc.tok.eos_token_id]
        return {"prompt_ids": [], "completion_ids": ids[: enc.max_length]}
    else:
        raise DataError(f"row {i}: an SFT row needs 'text', 'prompt'+'completion' or 'messages'; it has {sorted(row)}")
    prompt_ids = enc.prompt(prompt, i)
    if prompt_ids is None:
        return None
    return {"prompt_ids": prompt_ids, "completion_ids": enc.completion(prompt, completion, prompt_ids, i, "completion")}


def split_implicit_prompt(chosen: str | Messages, rejected: str | Messages, i: int):
    """Split rows without a ``prompt`` into (prompt, chosen, rejected).

    Strings: the prompt is the shared prefix up to and including its last
    ``"\\n\\nAssistant:"`` (Anthropic HH), or the whole shared prefix when that marker
    is absent. Message lists: the prompt is the shared leading messages.
    """
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = 0
        for a, b in zip(chosen, rejected):
            if a != b:
                break
            n += 1
        common = chosen[:n]
        cut = common.rfind(HH_ASSISTANT)
        prompt = common[: cut + len(HH_ASSISTANT)] if cut >= 0 else common
    elif isinstance(chosen, list) and isinstance(rejected, list):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt = chosen[:n]
    else:
        raise DataError(f"row {i}: 'chosen' and 'rejected' must both be strings or both be message lists")
    if not prompt:
        raise DataError(f"row {i}: no 'prompt' field and 'chosen'/'rejected' share no prefix to use as the prompt")
    chosen_rest, rejected_rest = chosen[len(prompt) :], rejected[len(prompt) :]
    for field, rest in (("chosen", chosen_rest), ("rejected", rejected_rest)):
        if not rest or (isinstance(rest, str) and not rest.strip()):
            raise DataError(f"row {i}: field {field!r} has nothing after the shared prompt")
    return prompt, chosen_rest, rejected_rest


def _preference_parts(row: dict, i: int):
    chosen, rejected = _text_or_messages(row, i, "chosen"), _text_or_messages(row, i, "rejected")
    if row.get("prompt") is None:
        return split_implicit_prompt(chosen, rejected, i)
    return _text_or_messages(row, i, "prompt"), chosen, rejected


def _pairs_row(enc: _Encoder, row: dict, i: int) -> dict | None:
    """Preference rows → ``{"prompt_ids", "chosen_ids", "rejected_ids"}``."""
    prompt, chosen, rejected = _preference_parts(row, i)
    if chosen == rejected:
        raise DataError(f"row {i}: 'chosen' and 'rejected' are identical; such a pair carries no preference")
    prompt_ids = enc.prompt(prompt, i)
    if prompt_ids is None:
        return None
    return {
        "prompt_ids": prompt_ids,
        "chosen_ids": enc.completion(prompt, chosen, prompt_ids, i, "chosen"),
        "rejected_ids": enc.completion(prompt, rejected, prompt_ids, i, "rejected"),
    }


def pairs_to_unpaired(rows: list[dict]) -> list[dict]:
    """Each preference row becomes two unpaired rows: chosen → desirable, rejected → undesirable."""
    out = []
    for i, row in enumerate(rows):
        prompt, chosen, rejected = _preference_parts(row, i)
        out.append({"prompt": prompt, "completion": chosen, "label": True})
        out.append({"prompt": prompt, "completion": rejected, "label": False})
    return out


def _unpaired_row(enc: _Encoder, row: dict, i: int) -> dict | None:
    """Unpaired rows (``prompt``/``completion``/``label``) → ``{"prompt_ids", "completion_ids", "label"}``.

    Preference rows (``chosen``/``rejected``) are accepted too and split with
    :func:`pairs_to_unpaired`.
    """
    prompt, completion = _text_or_messages(row, i, "prompt"), _text_or_messages(row, i, "completion")
    label = row.get("label")
    if label is None:
        raise DataError(f"row {i}: missing field 'label' (True = desirable, False = undesirable)")
    if not isinstance(label, bool):  # not 0/1 or "yes": a typo must not become a label
        raise DataError(f"row {i}: field 'label' must be true or false (a JSON boolean), got {label!r}")
    prompt_ids = enc.prompt(prompt, i)
    if prompt_ids is None:
        return None
    completion_ids = enc.completion(prompt, completion, prompt_ids, i, "completion")
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "label": label}


def _split_pairs_if_any(rows: list[dict]) -> list[dict]:
    return pairs_to_unpaired(rows) if rows and "label" not in rows[0] and "chosen" in rows[0] else rows


tokenize_sft = _row_tokenizer("SFT", _sft_row)
tokenize_pairs = _row_tokenizer("preference", _pairs_row)
tokenize_unpaired = _row_tokenizer("unpaired", _unpaired_row, prepare=_split_pairs_if_any)


@names_source
def tokenize_prompts(
    source: Any, tokenizer, max_prompt_length: int = 256, on_long_prompt: LongPromptPolicy = "error"
) -> list[dict]:
    """Prompt-only rows → ``{"prompt_ids", "prompt", "ground_truth"}``."""
    enc = _Encoder(tokenizer, max_prompt_length + 1, max_prompt_length, on_long_prompt)
    out = []
    for i, row in enumerate(_rows(source)):
        prompt = _text_or_messages(row, i, "prompt")
        truth = row.get("ground_truth")
        if truth is not None and not isinstance(truth, (str, int, float)):
            raise DataError(f"row {i}: field 'ground_truth' must be a string or number, got {type(truth).__name__}")
        prompt_ids = enc.prompt(prompt, i)
        if prompt_ids is not None:
            out.append({"prompt_ids": prompt_ids, "prompt": prompt, "ground_truth": None if truth is None else str(truth)})
    enc.report("prompts")
    return _nonempty(out, "prompt")


def _nonempty(rows: list[dict], what: str) -> list[dict]:
    if not rows:
        raise DataError(f"no usable {what} rows left after validation")
    return rows
