"""Checkpoints hold no pickles and are loaded without unpickling; non-finite numbers stop training
before that step's checkpoint exists (issue 18, points 1 and 5)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import safetensors.torch
import torch

from verl_core.algorithms.sft import SFTTrainer
from verl_core.bundled import arithmetic
from verl_core.config import ConfigError
from verl_core.errors import TrainingError
from verl_core.train.callbacks import Callback
from verl_core.train.checkpoints import latest_checkpoint
from verl_core.train.state_io import SAFE_SUFFIXES, CheckpointError, load_tree, save_tree
from verl_core.train.update_checks import check_update

ROWS = arithmetic.sft_rows(32)


class _Kill(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, step: int) -> None:
        if step == self.at:
            raise KeyboardInterrupt


class _WritesAFile:
    """A pickle payload: unpickling it writes ``path`` (stands for any code an attacker plants)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _trainer(tiny_path, out, **kw):
    cfg = dict(train_dataset=ROWS, max_steps=3, batch_size=8, learning_rate=1e-3, output_dir=str(out), progress=False, seed=1)
    return SFTTrainer(str(tiny_path), **{**cfg, **kw})


def _killed_at_step_1(tiny_path, out) -> Path:
    with pytest.raises(KeyboardInterrupt):
        _trainer(tiny_path, out, save_steps=1, callbacks=[_Kill(at=1)]).train()
    ckpt = latest_checkpoint(out)
    assert ckpt is not None
    return ckpt


def test_checkpoints_hold_only_safetensors_and_json(tiny_path, tmp_path):
    ckpt = _killed_at_step_1(tiny_path, tmp_path)
    files = sorted(p.name for p in ckpt.iterdir())
    assert files and all(Path(f).suffix in SAFE_SUFFIXES for f in files), files
    for f in ckpt.iterdir():  # each file parses as what its name says (no pickle under a safe name)
        if f.suffix == ".json":
            json.loads(f.read_text())
        else:
            safetensors.torch.load_file(str(f))


@pytest.mark.parametrize("planted", ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"])
def test_a_planted_pickle_is_refused_and_never_runs(tiny_path, tmp_path, planted):
    marker = tmp_path / "payload-ran"
    live = tmp_path / "payload-is-live"
    pickle.loads(pickle.dumps(_WritesAFile(live)))
    assert live.exists(), "the payload must be one that would run if unpickled"

    ckpt = _killed_at_step_1(tiny_path, tmp_path / "run")
    (ckpt / planted).write_bytes(pickle.dumps(_WritesAFile(marker)))
    with pytest.raises(CheckpointError, match=planted) as err:
        _trainer(tiny_path, tmp_path / "run", save_steps=1).train()
    assert "no pickles" in str(err.value) and str(ckpt) in str(err.value)
    assert not marker.exists(), "code from the checkpoint ran"

    (ckpt / planted).unlink()  # the fixed folder resumes
    assert _trainer(tiny_path, tmp_path / "run", save_steps=1).train().resumed_from_step == 1


def test_a_truncated_checkpoint_file_is_named(tiny_path, tmp_path):
    ckpt = _killed_at_step_1(tiny_path, tmp_path)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors.*damaged"):
        _trainer(tiny_path, tmp_path, save_steps=1).train()


def test_state_tree_round_trips_int_keys_tuples_and_numpy(tmp_path):
    import numpy as np

    state = {
        "state": {0: {"step": torch.tensor(3.0), "m": torch.ones(2, 2)}},
        "betas": (0.9, 0.999),
        "rng": np.arange(5, dtype=np.uint32),
    }
    state["lr"] = [float("inf"), None, True, "x"]
    save_tree(state, tmp_path, "s")
    back = load_tree(tmp_path, "s")
    assert torch.equal(back["state"][0]["m"], state["state"][0]["m"]) and back["betas"] == (0.9, 0.999)
    assert back["rng"].dtype == np.uint32 and back["rng"].tolist() == list(range(5)) and back["lr"] == state["lr"]


@pytest.mark.parametrize("key", ["learning_rate", "max_grad_norm", "weight_decay"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_hyper_parameters_are_rejected(tiny_path, key, value):
    with pytest.raises(ConfigError, match=key):
        _trainer(tiny_path, "unused", **{key: value})


def test_an_overflowing_update_stops_before_its_checkpoint(tiny_path, tmp_path):
    # 1e38 is finite and passes the config; AdamW's first step size (lr / (1 - beta1)) is beyond float32
    trainer = _trainer(tiny_path, tmp_path, learning_rate=1e38, save_steps=1, warmup_steps=0)
    with pytest.raises(TrainingError, match=r"update of step 1 .*overflowed.*learning_rate=1e\+38"):
        trainer.train()
    assert latest_checkpoint(tmp_path) is None and not (tmp_path / "model").exists()


def test_huge_weights_stop_at_the_overflowing_backward_pass(tiny_path, tmp_path):
    trainer = _trainer(tiny_path, tmp_path, save_steps=1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.fill_(1e30)
    with pytest.raises(TrainingError, match=r"non-finite gradient norm \(nan\) at step 1 with a finite loss"):
        trainer.train()
    assert latest_checkpoint(tmp_path) is None


def test_an_update_that_makes_weights_non_finite_is_named():
    weights = [torch.nn.Parameter(torch.tensor([1.0, float("inf")]))]
    with pytest.raises(TrainingError, match=r"update of step 7 made parameters non-finite.*loss \(0.5\).*lr=3"):
        check_update(weights, 7, 0.5, 2.0, "lr=3")
    check_update([torch.nn.Parameter(torch.ones(2))], 7, 0.5, 2.0, "lr=3")  # finite: no error


def test_non_finite_gradients_name_the_step(tiny_path, tmp_path):
    class _InfGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * float("inf")

    trainer = _trainer(tiny_path, tmp_path, save_steps=1)
    loss_fn = trainer.loss

    def inf_grad_loss(model, batch):
        out = loss_fn(model, batch)
        out.loss_sum = _InfGrad.apply(out.loss_sum)
        return out

    trainer.loss = inf_grad_loss
    with pytest.raises(TrainingError, match=r"non-finite gradient norm \(\w+\) at step 1 with a finite loss"):
        trainer.train()
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.slow
def test_online_trainer_state_resumes_from_safetensors_and_json(tiny_path, tmp_path):
    """The KL controller (a trainer state registered with the engine) is in the checkpoint's JSON,
    and a resumed PPO run continues with the same coefficient and parameters as a straight run."""
    from verl_core.algorithms.ppo import PPOTrainer
    from verl_core.policies import LLMPolicy

    def ppo(out, callbacks=()):
        settings = dict(batch_size=8, mini_batch_size=8, ppo_epochs=1, max_steps=2, save_steps=1, max_new_tokens=8)
        settings.update(adaptive_kl=True, kl_target=0.01, kl_horizon=2, progress=False, logging_steps=1, seed=2)
        return PPOTrainer(
            policy=LLMPolicy.from_pretrained(str(tiny_path)), output_dir=str(out), callbacks=list(callbacks), **settings
        )

    straight = ppo(tmp_path / "straight")
    straight_history = straight.train().history
    with pytest.raises(KeyboardInterrupt):
        ppo(tmp_path / "resumed", [_Kill(at=1)]).train()
    saved = json.loads((latest_checkpoint(tmp_path / "resumed") / "training_state.json").read_text())
    assert "kl_controller" in dict(saved["dict"])
    resumed = ppo(tmp_path / "resumed")
    result = resumed.train()
    assert result.resumed_from_step == 1 and result.steps == 2
    assert result.history["kl_coef"] == straight_history["kl_coef"][1:]
    a, b = straight.engine.unwrapped.state_dict(), resumed.engine.unwrapped.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_partial_model_folders_of_dead_processes_are_removed(tiny_path, tmp_path):
    import os
    import subprocess
    import sys

    from verl_core.modeling.loading import load_causal_lm, load_tokenizer, save_pretrained_atomic

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead, live = tmp_path / f".model-{proc.pid}-abc", tmp_path / f".model-{os.getppid()}-def"
    for partial in (dead, live):
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"half")
    save_pretrained_atomic(load_causal_lm(tiny_path), load_tokenizer(tiny_path), tmp_path / "model")
    assert not dead.exists() and live.exists()  # a live writer's folder is left alone
    assert (tmp_path / "model" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model", live.name])
