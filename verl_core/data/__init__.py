"""Data: load rows from anywhere `datasets` can, validate them, tokenize, collate."""

from verl_core.data.collate import collate_pairs, collate_sequences, collate_sft, pad_to
from verl_core.data.errors import DataError
from verl_core.data.formats import tokenize_pairs, tokenize_prompts, tokenize_sft, tokenize_unpaired
from verl_core.data.loading import load_rows

__all__ = [
    "DataError",
    "collate_pairs",
    "collate_sequences",
    "collate_sft",
    "load_rows",
    "pad_to",
    "tokenize_pairs",
    "tokenize_prompts",
    "tokenize_sft",
    "tokenize_unpaired",
]
