"""The embedded default: a small Llama-family model and a BPE tokenizer built locally.

Both are built deterministically from a seed and saved with ``save_pretrained`` into
a cache folder, so every code path loads them through ``from_pretrained`` exactly
like a user's model. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pydantic import Field

from verl_core.bundled import arithmetic
from verl_core.config import StrictConfig

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


class TinyModelConfig(StrictConfig):
    """Sizes of the embedded default model (defaults: ~0.2M parameters, trains in minutes on 2 cores).

    Three heads of 32: a head size vLLM's CPU attention supports (see :mod:`verl_core.rollout.vllm_backend`)."""

    vocab_size: int = Field(384, ge=300)
    hidden_size: int = 96
    intermediate_size: int = 256
    num_hidden_layers: int = 3
    num_attention_heads: int = 3
    num_key_value_heads: int = 1
    max_position_embeddings: int = 2048  # nominal (RoPE, no learned positions): recipes here reach ~720 tokens
    seed: int = 0

    def fingerprint(self) -> str:
        blob = json.dumps(self.model_dump(), sort_keys=True) + BUILD_VERSION
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


BUILD_VERSION = "tiny-v2"


def default_cache_dir() -> Path:
    return Path(os.environ.get("VERL_CORE_CACHE", Path.home() / ".cache" / "verl_core"))


def build_tokenizer(vocab_size: int = 384):
    """Byte-level BPE trained on the bundled task's text; digits are always single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(arithmetic.corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>", model_max_length=1024)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(config: TinyModelConfig, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = config.model_dump(exclude={"vocab_size", "seed"})  # the rest are LlamaConfig's own field names
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        **sizes,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(cfg)


def tiny_model_path(config: TinyModelConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """Folder of the embedded default model + tokenizer, built on first use.

    The folder is written under a temporary name and renamed into place, so a
    crash mid-build never leaves a folder that looks complete; processes that ask
    at once build it once (:func:`~verl_core.processes.build_folder_once`).
    """
    from verl_core.processes import build_folder_once

    config = config or TinyModelConfig()
    root = Path(cache_dir) if cache_dir else default_cache_dir()

    def build(folder: Path) -> None:
        tokenizer = build_tokenizer(config.vocab_size)
        build_model(config, tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return build_folder_once(root / f"tiny-llama-{config.fingerprint()}", build, done=lambda t: (t / "config.json").is_file())
