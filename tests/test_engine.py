"""The shared engine: exact resume, gradient accumulation, multi-process equivalence, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_core.algorithms.sft import SFTTrainer
from verl_core.bundled import arithmetic
from verl_core.errors import TrainingError
from verl_core.train.callbacks import Callback
from verl_core.train.checkpoints import checkpoint_step, latest_checkpoint

ROWS = arithmetic.sft_rows(64)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Kill(Callback):
    """Simulates a crash: raises right after step ``at`` finishes."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, step: int) -> None:
        if step == self.at:
            raise KeyboardInterrupt(f"killed after step {step}")


class _Updates(Callback):
    """Records the optimizer-step counter the engine reports after every update."""

    def __init__(self):
        self.steps: list[int] = []

    def on_update(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(step)


def _trainer(path, out, **kw):
    cfg = dict(
        train_dataset=ROWS,
        max_steps=6,
        batch_size=8,
        learning_rate=1e-3,
        warmup_steps=2,
        output_dir=str(out) if out else None,
        progress=False,
        logging_steps=1,
        seed=3,
    )
    cfg.update(kw)
    return SFTTrainer(str(path), **cfg)


@pytest.mark.slow
def test_resume_after_kill_equals_uninterrupted_run_bitwise(tiny_path, tmp_path):
    updates = _Updates()
    full = _trainer(tiny_path, tmp_path / "full", callbacks=[updates])
    full_result = full.train()
    assert updates.steps == [1, 2, 3, 4, 5, 6] and full_result.resumed_from_step == 0

    killed = _trainer(tiny_path, tmp_path / "resumed", save_steps=3, callbacks=[_Kill(at=3)])
    with pytest.raises(KeyboardInterrupt):
        killed.train()
    assert not (tmp_path / "resumed" / "model").exists(), "a killed run must not leave a final model"
    resumed = _trainer(tiny_path, tmp_path / "resumed", save_steps=3)
    resumed_result = resumed.train()
    assert resumed_result.resumed_from_step == checkpoint_step(latest_checkpoint(tmp_path / "resumed")) == 3

    assert resumed_result.steps == full_result.steps == 6
    a, b = _params(full.engine.unwrapped), _params(resumed.engine.unwrapped)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed parameters differ from the uninterrupted run"
    full_losses = [v for s, v in full_result.history["loss"] if s > 3]
    resumed_losses = [v for s, v in resumed_result.history["loss"] if s > 3]
    assert full_losses == resumed_losses


@pytest.mark.slow
def test_gradient_accumulation_4x4_equals_1x16(tiny_path):
    one = _trainer(tiny_path, None, max_steps=1, batch_size=16, gradient_accumulation_steps=1)
    four = _trainer(tiny_path, None, max_steps=1, batch_size=16, gradient_accumulation_steps=4)
    r1, r4 = one.train(), four.train()
    assert abs(r1.metrics["loss"] - r4.metrics["loss"]) < 1e-5
    a, b = _params(one.engine.unwrapped), _params(four.engine.unwrapped)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive  # the torchrun stage tests (test_distributed_stages.py) run the same DDP path end to end
def test_two_processes_equal_one_process(tiny_path, tmp_path):
    """torchrun --nproc_per_node 2 (accelerate MULTI_CPU, gloo) vs one process, same global batch."""
    script = Path(__file__).with_name("distributed_step.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    single, multi = tmp_path / "single.pt", tmp_path / "multi.pt"
    subprocess.run([sys.executable, str(script), str(tiny_path), str(single)], check=True, env=env, timeout=300)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--standalone",  # a free port of torchrun's choosing, not a fixed one another job may hold
            str(script),
            str(tiny_path),
            str(multi),
        ],
        check=True,
        env=env,
        timeout=300,
    )
    s, m = torch.load(single), torch.load(multi)
    assert s["processes"] == 1 and m["processes"] == 2
    assert abs(s["loss"] - m["loss"]) < 1e-5
    assert max((s["params"][k] - m["params"][k]).abs().max().item() for k in s["params"]) < 1e-5


def test_nan_loss_stops_training_without_a_checkpoint(tiny_path, tmp_path):
    trainer = _trainer(tiny_path, tmp_path / "nan", save_steps=1)
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    with pytest.raises(TrainingError, match="non-finite loss"):
        trainer.train()
    assert not list((tmp_path / "nan").glob("checkpoints/step-*"))
    assert not (tmp_path / "nan" / "model").exists()


@pytest.mark.slow
def test_too_few_rows_for_the_batch_train_on_batches_of_what_there_is(tiny_path):
    trainer = _trainer(tiny_path, None, train_dataset=ROWS[:4], batch_size=8, shrink_batch_to_data=True)
    assert trainer.config.batch_size == 4 and trainer.train().steps >= 1


def test_batch_must_split_evenly_over_accumulation(tiny_path):
    with pytest.raises(TrainingError, match="not divisible"):
        _trainer(tiny_path, None, batch_size=8, gradient_accumulation_steps=3).train()
