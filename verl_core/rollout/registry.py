"""The rollout backends by name (:data:`ROLLOUT_BACKENDS`: each with what it can do) and the ``rollout``
setting that picks one, with a section of options per backend (``rollout.vllm``).

``rollout.backend: hf`` (the default) samples with the policy's own KV cache in this process;
``vllm`` with a colocated vLLM engine (:mod:`verl_core.rollout.vllm_backend`) whose weights are pushed
in place after every policy update. Online trainers, the preference-data generator and the
evaluation stage each take a ``rollout`` section and build their backend with
:func:`build_rollout_backend`.

When to switch: on a GPU, for any real model, vLLM (its paged attention and batching are what
every peer samples with). On a CPU, the bench (``bench/vllm_rollout.py``) decides: vLLM samples
faster there too at the bench model's size, but its engine costs ~10 s to start and the model
must have a head size its CPU attention supports (32, 64, 80, 96, 112, 128 or 256).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from verl_core.config import ConfigError, StrictConfig
from verl_core.rollout.contract import RolloutBackend
from verl_core.rollout.hf_backend import HFRolloutBackend

log = logging.getLogger("verl_core")


class VLLMOptions(StrictConfig):
    """The ``rollout.vllm`` section: the options of the vLLM engine (read only when ``backend: vllm``)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the engine's weights; auto = the autocast dtype on a GPU under mixed precision, else the policy's"
    )
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + response; null = the model's")
    kv_cache_space_gib: int = Field(1, ge=1, description="on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="on GPU: the engine's share of GPU memory")
    sleep_between_rollouts: bool = Field(
        False, description="on GPU: free the engine's memory during the update (sleep level 1, woken for sampling)"
    )
    enforce_eager: bool = Field(
        False,
        description="skip torch.compile / graph capture; true starts in ~4 s instead of ~20 s (12 s with a warm "
        "compile cache) but samples slower (bench model on 2 CPU cores: 7.3k vs 9.7k tokens/s)",
    )
    engine_options: dict[str, Any] = Field(default_factory=dict, description="further vllm.LLM keyword arguments")


def _hf_backend(config: RolloutConfig, model: torch.nn.Module, tokenizer, autocast_dtype) -> RolloutBackend:
    return HFRolloutBackend(model, tokenizer.eos_token_id, tokenizer.pad_token_id, autocast_dtype)


def _vllm_backend(config: RolloutConfig, model: torch.nn.Module, tokenizer, autocast_dtype) -> RolloutBackend:
    """An engine built from the live model's config with placeholder weights (``load_format="dummy"``:
    nothing is read from disk), then given the live weights by one :meth:`sync_weights`."""
    from verl_core.rollout.vllm_backend import VLLMRolloutBackend, VLLMUnavailableError, import_vllm, vllm_skip_reason

    import_vllm()  # the missing-extra error before anything is written
    device = next(model.parameters()).device.type
    reason = vllm_skip_reason(getattr(model, "config", None), device)
    if reason is not None:
        raise VLLMUnavailableError(f"rollout.backend 'vllm' cannot run this policy: {reason}; use rollout.backend: hf")
    options = config.vllm
    dtype = options.dtype if options.dtype != "auto" else _auto_dtype(model, autocast_dtype, device)
    with _architecture_folder(model, tokenizer) as folder:
        backend = VLLMRolloutBackend(
            folder,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            dtype,
            max_model_len=options.max_model_len,
            enforce_eager=options.enforce_eager,
            kv_cache_space_gib=options.kv_cache_space_gib,
            gpu_memory_utilization=options.gpu_memory_utilization,
            sleep_between_rollouts=options.sleep_between_rollouts,
            **{"load_format": "dummy", **options.engine_options},
        )
    backend.sync_weights(model)
    log.info("rollout: vLLM engine (%s)", dtype)
    return backend


def _auto_dtype(model: torch.nn.Module, autocast_dtype: torch.dtype | None, device: str) -> str:
    """``dtype: auto``: on a GPU under mixed precision the autocast dtype (the policy keeps fp32 master
    weights, but its forward passes, and any peer's engine, run in bf16/fp16); otherwise the policy's
    own dtype, so a CPU run (fp32 in tests) samples exactly what the trainer scores."""
    if device == "cuda" and autocast_dtype is not None:
        return str(autocast_dtype).removeprefix("torch.")
    return str(next(model.parameters()).dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RolloutBackendSpec:
    """A backend and what it can do, so callers ask it instead of testing its name.

    ``shares_training_model``: samples with the live training module in this process (nothing to start,
    no weight copy, its log-probs are the trainer's own); ``per_training_process``: one can run beside each
    of several training processes. Its options, if any, are the section of :class:`RolloutConfig` named after it."""

    build: Callable[..., RolloutBackend]  # (config, live model, tokenizer, autocast dtype) -> backend
    summary: str
    shares_training_model: bool
    per_training_process: bool


ROLLOUT_BACKENDS: dict[str, RolloutBackendSpec] = {
    "hf": RolloutBackendSpec(_hf_backend, "the policy's KV cache in this process", True, True),
    "vllm": RolloutBackendSpec(_vllm_backend, "a colocated vLLM engine (options: rollout.vllm)", False, False),
}


class RolloutConfig(StrictConfig):
    """Which engine samples completions (``backend``), and each engine's own options in its section."""

    backend: Literal[tuple(ROLLOUT_BACKENDS)] = Field(  # type: ignore[valid-type]
        "hf", description="; ".join(f"{name}: {spec.summary}" for name, spec in ROLLOUT_BACKENDS.items())
    )
    vllm: VLLMOptions = Field(default_factory=VLLMOptions, description="vllm: the engine's options")

    @property
    def spec(self) -> RolloutBackendSpec:
        return ROLLOUT_BACKENDS[self.backend]


def build_rollout_backend(
    config: RolloutConfig | None,
    model: torch.nn.Module,
    tokenizer,
    autocast_dtype: torch.dtype | None = None,
    processes: int = 1,
) -> RolloutBackend:
    """The backend ``config.backend`` names, sampling from ``model`` (its current weights) for one of
    ``processes`` training processes."""
    config = config or RolloutConfig()
    if processes > 1 and not config.spec.per_training_process:
        raise ConfigError(
            f"rollout.backend {config.backend!r} runs one engine colocated with one training process; this run has "
            f"{processes} (use rollout.backend: hf with a launcher)"
        )
    return config.spec.build(config, model, tokenizer, autocast_dtype)


def close_backend(backend: RolloutBackend | None) -> None:
    """Free an engine's memory now (a vLLM engine holds its KV cache until closed); the HF backend has none of its own."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()


@contextlib.contextmanager
def _architecture_folder(model: torch.nn.Module, tokenizer) -> Iterator[Path]:
    """A temporary folder with the live model's config and its tokenizer, all an engine reads to build the
    architecture (a peft model's base config: the engine runs the merged weights)."""
    tmp = Path(tempfile.mkdtemp(prefix="verl-core-vllm-"))
    try:
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        lm.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
