"""The rollout backends by name (:data:`ROLLOUT_BACKENDS`) and the ``rollout`` setting that picks one.

``rollout.backend: hf`` (the default) samples with the policy's own KV cache in this process;
``vllm`` with a colocated vLLM engine (:mod:`verl_core.rollout_vllm`) whose weights are pushed
in place after every policy update. Online trainers, the preference-data generator and the
evaluation stage each take a ``rollout`` section and build their backend with
:func:`build_rollout_backend`.

When to switch: on a GPU, for any real model, vLLM (its paged attention and batching are what
every peer samples with). On a CPU, the bench (``bench/vllm_rollout.py``) decides: vLLM samples
faster there too at the bench model's size, but its engine costs ~10 s to start and the model
must have a head size its CPU attention supports (32, 64, 80, 96, 112, 128 or 256).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from verl_core.config import ConfigError, StrictConfig
from verl_core.rollout import HFRolloutBackend, RolloutBackend

log = logging.getLogger("verl_core")


def _hf_backend(config: RolloutConfig, model: torch.nn.Module, tokenizer, autocast_dtype, model_path) -> RolloutBackend:
    return HFRolloutBackend(model, tokenizer.eos_token_id, tokenizer.pad_token_id, autocast_dtype)


def _vllm_backend(config: RolloutConfig, model: torch.nn.Module, tokenizer, autocast_dtype, model_path) -> RolloutBackend:
    from verl_core.rollout_vllm import VLLMRolloutBackend, VLLMUnavailableError, import_vllm, vllm_skip_reason

    import_vllm()  # the missing-extra error before anything is written
    device = next(model.parameters()).device.type
    reason = vllm_skip_reason(getattr(model, "config", None), device)
    if reason is not None:
        raise VLLMUnavailableError(f"rollout.backend 'vllm' cannot run this policy: {reason}; use rollout.backend: hf")
    dtype = config.dtype if config.dtype != "auto" else str(next(model.parameters()).dtype).removeprefix("torch.")
    with _model_folder(model, tokenizer, model_path) as folder:
        backend = VLLMRolloutBackend(
            folder,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            dtype,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            kv_cache_space_gib=config.kv_cache_space_gib,
            gpu_memory_utilization=config.gpu_memory_utilization,
            sleep_between_rollouts=config.sleep_between_rollouts,
            **config.engine_options,
        )
    backend.sync_weights(model)  # the live weights (an in-memory or LoRA policy differs from its folder)
    log.info("rollout: vLLM engine (%s) for %s", dtype, model_path or "the live policy")
    return backend


# name -> builder(config, live model, tokenizer, autocast dtype, model folder or None)
ROLLOUT_BACKENDS: dict[str, Callable[..., RolloutBackend]] = {"hf": _hf_backend, "vllm": _vllm_backend}


class RolloutConfig(StrictConfig):
    """Which engine samples completions, and its options (the vLLM ones are ignored by ``hf``)."""

    backend: Literal[tuple(ROLLOUT_BACKENDS)] = Field(  # type: ignore[valid-type]
        "hf", description="hf: the policy's KV cache in this process; vllm: a vLLM engine"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vllm: the engine's weights; auto = the policy's dtype"
    )
    max_model_len: int | None = Field(None, ge=1, description="vllm: longest prompt + response; null = the model's")
    kv_cache_space_gib: int = Field(1, ge=1, description="vllm on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="vllm on GPU: the engine's share of GPU memory")
    sleep_between_rollouts: bool = Field(
        False, description="vllm on GPU: free the engine's memory during the update (sleep level 1, woken for sampling)"
    )
    enforce_eager: bool = Field(
        False,
        description="vllm: skip torch.compile / graph capture; true starts in ~4 s instead of ~20 s (12 s with a warm "
        "compile cache) but samples slower (bench model on 2 CPU cores: 7.3k vs 9.7k tokens/s)",
    )
    engine_options: dict[str, Any] = Field(default_factory=dict, description="vllm: further vllm.LLM keyword arguments")


def build_rollout_backend(
    config: RolloutConfig | None,
    model: torch.nn.Module,
    tokenizer,
    autocast_dtype: torch.dtype | None = None,
    model_path: str | os.PathLike | None = None,
    processes: int = 1,
) -> RolloutBackend:
    """The backend ``config.backend`` names, sampling from ``model`` (its current weights) for one of
    ``processes`` training processes."""
    config = config or RolloutConfig()
    if config.backend != "hf" and processes > 1:
        raise ConfigError(
            f"rollout.backend {config.backend!r} runs one engine colocated with one training process; this run has "
            f"{processes} (use rollout.backend: hf with a launcher)"
        )
    return ROLLOUT_BACKENDS[config.backend](config, model, tokenizer, autocast_dtype, model_path)


def close_backend(backend: RolloutBackend | None) -> None:
    """Free an engine's memory now (a vLLM engine holds its KV cache until closed); the HF backend has none of its own."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()


class _model_folder:
    """The policy's own folder when it has one, else a temporary ``save_pretrained`` of the live model
    (the engine reads the architecture from it; the weights are pushed afterwards)."""

    def __init__(self, model: torch.nn.Module, tokenizer, model_path):
        self.model, self.tokenizer = model, tokenizer
        self.path = Path(model_path) if model_path and (Path(model_path) / "config.json").is_file() else None
        self.tmp: str | None = None

    def __enter__(self) -> Path:
        if self.path is not None:
            return self.path
        from verl_core.rollout_vllm import hf_checkpoint_weights

        self.tmp = tempfile.mkdtemp(prefix="verl-core-vllm-")
        lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        with hf_checkpoint_weights(self.model) as weights:
            lm.save_pretrained(self.tmp, state_dict=dict(weights))
        self.tokenizer.save_pretrained(self.tmp)
        return Path(self.tmp)

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
