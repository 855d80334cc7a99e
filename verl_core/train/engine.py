"""The one training loop every algorithm uses.

An algorithm supplies ``loss_fn(model, micro_batch) -> LossOutput``: the *sum* of its
loss over the units it counts (tokens for SFT, pairs for DPO, ...) and that count.
The engine sums gradients over micro-batches and processes and divides once by the
global count, so 4 micro-batches × 4 equals 1 × 16 and N processes equal one.

Data order is a pure function of (seed, step): step ``s`` reads the ``s``-th global
batch of a seeded permutation per epoch. A checkpoint therefore needs no data-loader
state, and resume is exact: model, optimizer, scheduler, RNG states and step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_core.errors import TrainingError
from verl_core.train.batches import micro_batch_indices, steps_for, to_device
from verl_core.train.callbacks import Callback, HistoryCallback
from verl_core.train.checkpoints import CHECKPOINT_PREFIX, CHECKPOINTS_DIR, ENGINE_STATE, latest_checkpoint
from verl_core.train.config import TrainConfig
from verl_core.train.parameter_memory import own_parameter_memory
from verl_core.train.precision import allow_precision_change
from verl_core.train.progress import progress_bar
from verl_core.train.state_io import load_training_state, read_text, refuse_pickles, save_training_state
from verl_core.train.update_checks import check_gradients, check_loss, check_update, update_overflowed

log = logging.getLogger("verl_core")


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    count: float | torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


LossFn = Callable[[torch.nn.Module, Any], LossOutput]


@dataclass
class TrainResult:
    """What a run did. ``steps`` and ``resumed_from_step`` count loop steps (optimizer steps
    offline, rollout steps online); ``resumed_from_step`` is 0 for a fresh run."""

    steps: int
    metrics: dict[str, float]
    history: dict[str, list[tuple[int, float]]]
    output_dir: str | None = None
    resumed_from_step: int = 0


StepFn = Callable[[int], dict[str, float]]
EvalFn = Callable[[], dict[str, float]]


@dataclass
class _Progress:
    """Loop and optimizer-step counters, registered with accelerate so a checkpoint restores them.
    They differ online (a rollout step is several optimizer steps): the scheduler follows optimizer
    steps; cadences (logging, eval, save) and resume follow loop steps."""

    step: int = 0
    optimizer_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # checkpoints from before the two counters had one; offline they are equal
        self.step, self.optimizer_steps = int(state["step"]), int(state.get("optimizer_steps", state["step"]))


class Engine:
    """Owns the optimisation and the one training loop (:meth:`run`). ``total_steps`` counts loop
    steps; each makes ``updates_per_step`` optimizer steps (1 offline, ``ppo_epochs × mini-batches``
    online), and the learning-rate schedule spans all of those."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainConfig,
        callbacks: Sequence[Callback] = (),
        total_steps: int | None = None,
        updates_per_step: int = 1,
    ):
        from accelerate import Accelerator
        from accelerate.utils import set_seed
        from transformers import get_scheduler

        self.config = config
        self.callbacks = list(callbacks)
        allow_precision_change(config.mixed_precision)
        self.accelerator = Accelerator(
            mixed_precision=config.mixed_precision, cpu=not torch.cuda.is_available(), step_scheduler_with_optimizer=False
        )
        set_seed(config.seed)
        world, accum = self.accelerator.num_processes, config.gradient_accumulation_steps
        if config.batch_size % (world * accum):
            raise TrainingError(
                f"batch_size {config.batch_size} is not divisible by processes ({world}) × gradient_accumulation_steps ({accum})"
            )
        if (
            config.gradient_checkpointing
            and hasattr(model, "gradient_checkpointing_enable")
            and not getattr(model, "is_gradient_checkpointing", False)
        ):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise TrainingError("model has no trainable parameters")
        if self.accelerator.device.type == "cpu":
            own_parameter_memory(params)
        optimizer = torch.optim.AdamW(
            params,
            lr=config.learning_rate,
            betas=config.adam_betas,
            weight_decay=config.weight_decay,
            fused=self._fused_optimizer(params) or None,
        )
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # FSDP2 replaces parameters with sharded ones: rescale and clip those (DDP keeps the same objects)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.total_steps = total_steps or config.max_steps or 1
        self.total_optimizer_steps = self.total_steps * updates_per_step
        name = config.lr_scheduler if config.lr_scheduler != "constant" else "constant_with_warmup"
        self.scheduler = get_scheduler(
            name, self.optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=self.total_optimizer_steps
        )
        self.progress = _Progress()
        # what a checkpoint holds besides the model (safetensors + JSON: verl_core.train.state_io, no pickles)
        self.states: dict[str, Any] = {"optimizer": self.optimizer, "scheduler": self.scheduler, "progress": self.progress}
        if self.accelerator.scaler is not None:
            self.states["grad_scaler"] = self.accelerator.scaler
        self.params = params
        self.resumed_from_step = 0

    def _fused_optimizer(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether AdamW runs its fused kernel: asked for, plain floating tensors on CPU or CUDA, and
        no FSDP / DeepSpeed (which shard or replace the optimizer)."""
        from accelerate.utils import DistributedType

        kind = self.accelerator.distributed_type
        sharded = kind in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        plain = all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        return self.config.fused_optimizer and plain and not sharded

    def register_state(self, name: str, obj: Any) -> None:
        """Add a trainer's state (an object with ``state_dict``/``load_state_dict`` of plain data and
        tensors) to what checkpoints save and resume restores."""
        self.states[name] = obj

    @property
    def step(self) -> int:
        """Loop steps completed."""
        return self.progress.step

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps completed (equals :attr:`step` offline)."""
        return self.progress.optimizer_steps

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    # -- one optimizer step -----------------------------------------------------------------
    def optimizer_step(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients over ``micro_batches`` (this process's share), step once, report to ``on_update``."""
        acc = self.accelerator
        self.model.train()
        total_count = torch.zeros((), dtype=torch.float64)
        weighted: dict[str, float] = {}
        loss_sum = 0.0
        for i, mb in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            ctx = acc.no_sync(self.model) if not sync and acc.num_processes > 1 else contextlib.nullcontext()
            with ctx:
                out = loss_fn(self.model, to_device(mb, acc.device))
                check_loss(out.loss_sum, self.step + 1, i, self.params)
                acc.backward(out.loss_sum)
            count = float(out.count)
            total_count += count
            loss_sum += float(out.loss_sum.detach())
            for k, v in out.metrics.items():
                weighted[k] = weighted.get(k, 0.0) + float(v) * count
        stats = torch.tensor(
            [total_count.item(), loss_sum] + [weighted[k] for k in sorted(weighted)], dtype=torch.float64, device=acc.device
        )
        stats = acc.reduce(stats, reduction="sum") if acc.num_processes > 1 else stats
        global_count = stats[0].item()
        if global_count <= 0:
            raise TrainingError(f"step {self.step + 1}: the batch has nothing to learn from (count 0); check masks and data")
        # DDP averaged gradients over processes; turn that into a sum over the global batch / global count.
        scale = acc.num_processes / global_count
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        cfg, mean_loss = self.config, stats[1].item() / global_count
        if cfg.max_grad_norm is not None:
            grad_norm = float(acc.clip_grad_norm_(self.params, cfg.max_grad_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]))
        if acc.scaler is None:  # a loss scaler skips steps with inf gradients by design
            check_gradients(grad_norm, mean_loss, self.step + 1)
        settings = (
            f"learning_rate={cfg.learning_rate}, adam_betas={cfg.adam_betas}, weight_decay={cfg.weight_decay}, "
            f"max_grad_norm={cfg.max_grad_norm}"
        )
        try:
            self.optimizer.step()
        except RuntimeError as err:
            raise update_overflowed(err, self.step + 1, settings) from None
        check_update(self.params, self.step + 1, mean_loss, grad_norm, settings)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.optimizer_steps += 1
        metrics = {"loss": mean_loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm}
        metrics.update({k: stats[2 + j].item() / global_count for j, k in enumerate(sorted(weighted))})
        if self.is_main:  # the metrics are already global (reduced above), so one process reports them
            for cb in self.callbacks:
                cb.on_update(self.optimizer_steps, metrics)
        return metrics

    # -- the loop ---------------------------------------------------------------------------
    def run(
        self,
        step_fn: StepFn,
        eval_fn: EvalFn | None = None,
        params: dict[str, Any] | None = None,
        desc: str = "train",
        progress_key: str = "loss",
    ) -> TrainResult:
        """Call ``step_fn(step)`` (one loop step's optimizer steps; returns its metrics) for each loop
        step from the resumed one to ``total_steps - 1``. The loop owns resume, the progress bar, metric
        means over ``logging_steps`` (at most ``total_steps // 20``), ``eval_fn()`` every ``eval_steps``
        and at the end, checkpoints every ``save_steps`` (all counted in loop steps) and the callbacks."""
        cfg = self.config
        history = HistoryCallback()
        callbacks = self.callbacks + [history]
        self.resumed_from_step = self.maybe_resume()
        for cb in callbacks:
            cb.on_train_begin({**cfg.model_dump(), **(params or {})})
        bar = progress_bar(self.total_steps, self.step, desc, disable=not (cfg.progress and self.is_main))
        # at least ~20 points per curve on a short run: log every min(logging_steps, total/20) steps
        every = max(1, min(cfg.logging_steps, self.total_steps // 20))
        last: dict[str, float] = {}
        window: list[dict[str, float]] = []
        status = "FAILED"
        try:
            while self.step < self.total_steps:
                metrics = step_fn(self.step)
                self.progress.step += 1
                step, final = self.step, self.step == self.total_steps
                window.append(metrics)
                bar.update(1)
                if progress_key in metrics:
                    bar.set_postfix({progress_key: f"{metrics[progress_key]:.4g}"})
                logged: dict[str, float] = {}
                if step % every == 0 or final:
                    logged = _mean(window)
                    last = dict(logged)
                    window = []
                # the last step's eval is the final eval below: do not run it twice
                if eval_fn is not None and cfg.eval_steps and step % cfg.eval_steps == 0 and not final:
                    evaluated = eval_fn()
                    last.update(evaluated)
                    logged.update(evaluated)
                if logged:
                    self._log(callbacks, logged)
                if cfg.save_steps and step % cfg.save_steps == 0 and not final:
                    self.save_checkpoint()
                for cb in callbacks:
                    cb.on_step_end(step)
            if eval_fn is not None:
                final_eval = eval_fn()
                last.update(final_eval)
                self._log(callbacks, final_eval)
            status = "FINISHED"
        finally:
            bar.close()
            for cb in callbacks:
                cb.on_train_end(status, last)
        return TrainResult(
            steps=self.step,
            metrics=last,
            history=history.history,
            output_dir=cfg.output_dir,
            resumed_from_step=self.resumed_from_step,
        )

    def fit(
        self,
        examples: Sequence[Any],
        collate: Callable[[list], Any],
        loss_fn: LossFn,
        eval_fn: Callable[[torch.nn.Module], dict[str, float]] | None = None,
        params: dict[str, Any] | None = None,
        desc: str = "train",
    ) -> TrainResult:
        """Offline training: each loop step is one optimizer step on the step's global batch of ``examples``;
        ``desc`` names the run in its progress lines (the trainer, so that SFT and the reward model read apart)."""
        cfg, acc = self.config, self.accelerator
        if len(examples) < cfg.batch_size:
            raise TrainingError(f"dataset has {len(examples)} rows, fewer than batch_size {cfg.batch_size}")

        def step_fn(step: int) -> dict[str, float]:
            idx = micro_batch_indices(
                len(examples),
                step,
                cfg.batch_size,
                cfg.seed,
                acc.process_index,
                acc.num_processes,
                cfg.gradient_accumulation_steps,
            )
            return self.optimizer_step([collate([examples[i] for i in mb]) for mb in idx], loss_fn)

        evaluate = (lambda: eval_fn(self.unwrapped)) if eval_fn is not None else None
        return self.run(step_fn, eval_fn=evaluate, params=params, desc=desc)

    def _log(self, callbacks: Sequence[Callback], metrics: dict[str, float]) -> None:
        if self.is_main:
            for cb in callbacks:
                cb.on_log(self.step, metrics)

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path | None:
        return Path(self.config.output_dir) / CHECKPOINTS_DIR if self.config.output_dir else None

    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step-N`` (N = loop step) atomically: a temporary folder renamed when complete."""
        root = self.checkpoint_root
        if root is None:
            return None
        acc = self.accelerator
        final = root / f"{CHECKPOINT_PREFIX}{self.step:08d}"
        tmp = root / f".tmp-{CHECKPOINT_PREFIX}{self.step:08d}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        save_training_state(acc, self.model, self.states, tmp)
        acc.wait_for_everyone()
        if self.is_main:
            state = {
                "step": self.step,
                "total_steps": self.total_steps,
                "optimizer_steps": self.optimizer_steps,
                "total_optimizer_steps": self.total_optimizer_steps,
            }
            (tmp / ENGINE_STATE).write_text(json.dumps(state))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in sorted(root.glob(f"{CHECKPOINT_PREFIX}*"))[: -self.config.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        for cb in self.callbacks:
            cb.on_checkpoint(self.step, str(final))
        return final

    def maybe_resume(self) -> int:
        """Restore the latest complete checkpoint (when ``resume``); returns the loop step reached."""
        ckpt = latest_checkpoint(self.config.output_dir) if self.config.resume and self.config.output_dir else None
        if ckpt is None:
            return 0
        refuse_pickles(ckpt)
        state = json.loads(read_text(ckpt / ENGINE_STATE))
        made_for = (state["total_steps"], state.get("total_optimizer_steps", self.total_optimizer_steps))
        if made_for != (self.total_steps, self.total_optimizer_steps):
            raise TrainingError(
                f"checkpoint {ckpt} was made for {made_for[0]} steps ({made_for[1]} optimizer steps), this run "
                f"has {self.total_steps} ({self.total_optimizer_steps}); use a new output_dir or set resume=False"
            )
        load_training_state(self.accelerator, self.model, self.states, ckpt)
        log.info("resumed from %s at step %d", ckpt, self.step)
        return self.step


def _mean(window: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean over the steps of a logging window (a key may be missing from some steps)."""
    keys = dict.fromkeys(k for m in window for k in m)
    return {k: sum(vals) / len(vals) for k in keys for vals in [[m[k] for m in window if k in m]]}


__all__ = ["Engine", "LossOutput", "TrainResult", "TrainingError", "micro_batch_indices", "steps_for"]
