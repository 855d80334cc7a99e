"""Load policy, reference, critic and reward models from a local folder or a hub id."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from verl_core.config import StrictConfig
from verl_core.data.hub import hub_id, hub_offline, not_found_hint
from verl_core.modeling.model_files import ModelLoadError
from verl_core.processes import write_then_rename
from verl_core.train.progress import quiet_library_bars

DType = Literal["float32", "bfloat16", "float16"]
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


log = logging.getLogger("verl_core")


class LoraSettings(StrictConfig):
    """LoRA through peft (Hu et al. 2021, arXiv:2106.09685)."""

    r: int = Field(8, ge=1)
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"


def check_model_source(path: str | os.PathLike) -> str:
    """What ``from_pretrained`` is given for a model path: a folder, or a hub id when allowed.

    Every model path (base, SFT/RM/policy, reference, reward model, the trainers, tokenizers) resolves here,
    so the other sources are handled once: ``bundled:<name>`` (:mod:`verl_core.modeling.real_model`) and a
    ``.gguf`` file, each turned into a cached Hugging Face folder (:mod:`verl_core.modeling.gguf`).
    Anything that cannot be loaded raises :class:`ModelLoadError` naming the path.
    """
    text = str(path)
    if text.startswith("bundled:"):
        from verl_core.modeling.real_model import bundled_model_path

        return str(bundled_model_path(text.removeprefix("bundled:")))
    local = Path(text).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelLoadError(f"model folder {text} has no config.json; is it a save_pretrained folder?")
        return str(local)
    if local.is_file():
        from verl_core.modeling.gguf import converted_folder, looks_like_gguf

        if looks_like_gguf(local):
            return str(converted_folder(local))
        raise ModelLoadError(f"model path {text} is a file; give a save_pretrained folder or a .gguf file")
    repo = hub_id(text)
    if repo is None or Path(text).exists():
        raise ModelLoadError(f"model path does not exist: {text}{not_found_hint(text)}")
    if hub_offline():
        raise ModelLoadError(f"{text!r} is not a local folder and hub downloads are off (HF_HUB_OFFLINE=1)")
    return repo


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    source = check_model_source(path)
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as err:  # any loader failure (truncated file, refused pickle) is about this folder
        raise ModelLoadError(f"cannot load tokenizer from {source}: {type(err).__name__}: {err}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _from_pretrained(auto_cls, path, dtype: DType, trust_remote_code: bool, **kwargs):
    source = check_model_source(path)
    quiet_library_bars()  # off a terminal "Loading weights" would write a frame per tensor into the log
    try:
        return auto_cls.from_pretrained(source, dtype=TORCH_DTYPES[dtype], trust_remote_code=trust_remote_code, **kwargs)
    except Exception as err:  # a truncated model.safetensors, a .bin refused by weights_only loading, ...
        raise ModelLoadError(f"cannot load {auto_cls.__name__} from {source}: {type(err).__name__}: {err}") from None


def load_causal_lm(
    path: str | os.PathLike,
    dtype: DType = "float32",
    gradient_checkpointing: bool = False,
    lora: LoraSettings | None = None,
    trust_remote_code: bool = False,
    trainable: bool = True,
):
    """A causal LM for a policy (``trainable=True``) or a frozen reference (``trainable=False``)."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, path, dtype, trust_remote_code)
    return _prepare(model, gradient_checkpointing, lora, trainable, task_type="CAUSAL_LM")


class _NewScoreHeadOnly(logging.Filter):
    """Drop transformers' load report when the only weights it calls missing are the new score head's."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def filter(self, record: logging.LogRecord) -> bool:
        text = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())
        if "LOAD REPORT" not in text:
            return True
        missing = [line.split("|")[0].strip() for line in text.splitlines() if "| MISSING" in line]
        if missing and all(name.startswith("score.") for name in missing):
            log.info("reward model from %s: a new score head on the causal LM's weights", self.source)
            return False
        return True


def load_reward_model(
    path: str | os.PathLike,
    dtype: DType = "float32",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    trainable: bool = True,
):
    """A sequence classifier with one output (``num_labels=1``): the scalar reward at the last token.

    Loading a causal LM folder adds a freshly initialised score head (seed it first).
    """
    from transformers import AutoModelForSequenceClassification

    # transformers' coloured "LOAD REPORT ... score.weight MISSING" for the head that is new by design: one plain
    # line instead; a report naming any other missing weight is kept
    report_filter = _NewScoreHeadOnly(str(path))
    modeling_log = logging.getLogger("transformers.modeling_utils")
    modeling_log.addFilter(report_filter)
    try:
        model = _from_pretrained(AutoModelForSequenceClassification, path, dtype, trust_remote_code, num_labels=1)
    finally:
        modeling_log.removeFilter(report_filter)
    if model.config.pad_token_id is None:
        raise ModelLoadError(f"{path}: the reward model needs config.pad_token_id to find each sequence's last token")
    return _prepare(model, gradient_checkpointing, None, trainable, task_type="SEQ_CLS")


def _prepare(model, gradient_checkpointing: bool, lora: LoraSettings | None, trainable: bool, task_type: str):
    if not trainable:
        model.eval().requires_grad_(False)
        return model
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules, task_type=task_type
        )
        model = get_peft_model(model, cfg)
    model.train()
    return model


def context_window(model) -> int | None:
    """The longest sequence ``model`` was built for (``max_position_embeddings``), if its config says."""
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_fits_context(model, examples: list[dict], extra: int = 0, name: str | None = None) -> None:
    """A :class:`DataError` naming the first tokenized row longer than ``model``'s context window (with
    ``extra`` tokens still to come, e.g. ``max_new_tokens``): positions past the window were never trained,
    so such a row would train, or be sampled, on garbage."""
    from verl_core.data.errors import DataError

    window = context_window(model)
    if window is None:
        return
    for i, ex in enumerate(examples):
        prompt = len(ex.get("prompt_ids", ()))
        longest = max((len(v) for k, v in ex.items() if k.endswith("_ids") and k != "prompt_ids"), default=0)
        if prompt + longest + extra > window:
            more = f" + {extra} to generate" if extra else ""
            raise DataError(
                f"row {i}: {prompt + longest} tokens{more}, longer than the context window of {name or 'the model'} "
                f"({window} tokens, max_position_embeddings): shorten the row or lower max_length / max_prompt_length"
            )


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def save_pretrained_atomic(model, tokenizer, target: str | os.PathLike) -> Path:
    """Write an HF folder under a temporary name, then rename it into place.

    A LoRA model is merged into its base first, so the folder loads with plain
    ``from_pretrained``. A crash mid-write leaves no folder at ``target``.
    """
    if is_peft(model):
        model = model.merge_and_unload()

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return write_then_rename(target, write)
