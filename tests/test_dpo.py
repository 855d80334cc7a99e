"""DPO-family trainer: step-0 values, precomputed vs on-the-fly reference, LoRA reference,
reference-free losses, the seed example, and bad rows. All on the tiny default model."""

from __future__ import annotations

import math

import pytest
import torch

from verl_core.algorithms.dpo import DPOTrainer, ORPOTrainer, SimPOTrainer
from verl_core.bundled import arithmetic
from verl_core.config import ConfigError
from verl_core.data import DataError
from verl_core.modeling.loading import LoraSettings, is_peft

LN2 = math.log(2.0)
QUIET = dict(progress=False, logging_steps=1)
DPO_METRICS = {
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
}


@pytest.fixture(scope="module")
def pairs() -> list[dict]:
    return arithmetic.preference_rows(arithmetic.train_problems(32))


def per_pair_loss(trainer, n: int = 8) -> float:
    out = trainer.loss(trainer.model, trainer.collate(trainer.train_examples[:n]))
    assert out.count == n
    return float(out.loss_sum) / out.count


def losses(result) -> list[float]:
    return [v for _, v in result.history["loss"]]


def test_dpo_sigmoid_loss_is_ln2_at_step0_and_step0_values_of_other_losses(tiny_path, pairs):
    trainer = DPOTrainer(str(tiny_path), train_dataset=pairs, max_steps=1, batch_size=8, **QUIET)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    assert abs(per_pair_loss(trainer) - LN2) < 1e-6
    # z = 0 when policy == reference: hinge relu(1) = 1, IPO (1/(2β))², robust ((1-ε)+(-ε))ln2/(1-2ε) = ln2.
    trainer.config = trainer.config.updated(loss_type="hinge")
    assert abs(per_pair_loss(trainer) - 1.0) < 1e-6
    trainer.config = trainer.config.updated(loss_type="ipo")
    assert abs(per_pair_loss(trainer) - (1 / (2 * 0.1)) ** 2) < 1e-4
    trainer.config = trainer.config.updated(loss_type="robust", label_smoothing=0.2)
    assert abs(per_pair_loss(trainer) - LN2) < 1e-6
    trainer.config = trainer.config.updated(loss_type="sigmoid", label_smoothing=0.0)
    result = trainer.train()  # the engine's step-1 loss is measured before the update
    assert abs(losses(result)[0] - LN2) < 1e-6
    assert DPO_METRICS <= set(result.history)


def test_precomputed_reference_gives_the_same_losses_as_on_the_fly(tiny_path, pairs):
    common = dict(train_dataset=pairs, eval_dataset=pairs[:8], max_steps=3, batch_size=8, learning_rate=1e-3, **QUIET)
    live = DPOTrainer(str(tiny_path), precompute_ref_logps=False, **common)
    assert live.ref_model is not None
    live_result = live.train()
    pre = DPOTrainer(str(tiny_path), precompute_ref_logps=True, **common)
    assert pre.ref_model is None  # the untouched starting policy is the reference: no copy is made
    pre_result = pre.train()
    assert pre.ref_model is None
    assert all("ref_logps" in e for e in pre.train_examples + pre.eval_examples)
    assert live.ref_model is not None
    got, want = losses(pre_result), losses(live_result)
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (got, want)
    assert got[-1] != got[0]  # the policy did move
    # the final evaluation ran after the reference was freed, from the precomputed values
    assert abs(pre_result.metrics["eval/loss"] - live_result.metrics["eval/loss"]) < 1e-6


def test_the_reference_pass_shows_its_progress_before_the_first_step(tiny_path, pairs, capsys, monkeypatch):
    from verl_core.train import progress

    monkeypatch.setattr(progress, "_logged", lambda: False)  # printed, not sent to a Prefect logger
    trainer = DPOTrainer(
        str(tiny_path), train_dataset=pairs, max_steps=1, batch_size=8, precompute_ref_logps=True, logging_steps=1
    )
    trainer.train()
    lines = capsys.readouterr().err.splitlines()
    ref = [i for i, line in enumerate(lines) if line.startswith("reference log-probs: 32/32 examples (100%)")]
    train = [i for i, line in enumerate(lines) if "1/1 steps" in line]
    assert ref and train and ref[0] < train[0], lines


@pytest.mark.slow
def test_precompute_frees_an_explicit_reference_model(tiny_path, pairs):
    trainer = DPOTrainer(
        str(tiny_path),
        ref_model=str(tiny_path),
        train_dataset=pairs,
        max_steps=1,
        batch_size=8,
        precompute_ref_logps=True,
        **QUIET,
    )
    assert trainer.ref_model is not None
    result = trainer.train()
    assert trainer.ref_model is None
    assert abs(losses(result)[0] - LN2) < 1e-6


@pytest.mark.slow
def test_lora_reference_is_the_adapter_disabled_policy_without_a_second_copy(tiny_path, pairs):
    trainer = DPOTrainer(
        str(tiny_path), lora=LoraSettings(r=4), train_dataset=pairs, max_steps=2, batch_size=8, learning_rate=1e-2, **QUIET
    )
    assert is_peft(trainer.model)
    assert trainer.ref_model is None
    result = trainer.train()
    assert result.steps == 2
    assert abs(losses(result)[0] - LN2) < 1e-6  # LoRA B starts at zero: policy == base
    assert trainer.ref_model is None
    # after training the adapters differ from the base, so the reference side is really adapter-free
    with torch.no_grad():
        assert abs(per_pair_loss(trainer) - LN2) > 1e-4


@pytest.mark.parametrize("cls, loss_type", [(SimPOTrainer, "simpo"), (ORPOTrainer, "orpo")])
def test_reference_free_losses_load_no_reference_model(tiny_path, pairs, cls, loss_type):
    trainer = cls(str(tiny_path), train_dataset=pairs, max_steps=1, batch_size=8, learning_rate=1e-3, **QUIET)
    assert trainer.config.loss_type == loss_type and not trainer.uses_reference
    assert trainer.ref_model is None
    result = trainer.train()
    assert DPO_METRICS <= set(result.history)
    assert math.isfinite(losses(result)[0])
    if loss_type == "orpo":
        assert {"nll", "log_odds_ratio"} <= set(result.history)
    with pytest.raises(ConfigError, match="reference-free"):
        cls(str(tiny_path), ref_model=str(tiny_path), train_dataset=pairs, **QUIET)


def _seed_example(DPOTrainer, tiny_path) -> None:
    """The seed's example with ``verl`` replaced by ``verl_core`` (the model is the embedded default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = [
        {"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
        for r in arithmetic.preference_rows(arithmetic.train_problems(16))
    ]
    result = DPOTrainer(model=model, tokenizer=tokenizer, train_dataset=rows, beta=0.1, learning_rate=5e-6).train()
    assert result.steps == 1 and abs(result.metrics["loss"] - LN2) < 1e-6
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # the object was trained in place


@pytest.mark.slow
def test_seed_example_runs_verbatim_from_the_package(tiny_path):
    from verl_core import DPOTrainer, KTOTrainer  # noqa: F401  (exported by verl_core/__init__.py)

    _seed_example(DPOTrainer, tiny_path)


@pytest.mark.slow
def test_seed_example_runs_with_a_model_object_and_tokenizer(tiny_path):
    _seed_example(DPOTrainer, tiny_path)


def test_pair_with_identical_chosen_and_rejected_is_rejected(tiny_path, pairs):
    bad = pairs[:3] + [{**pairs[3], "rejected": pairs[3]["chosen"]}]
    with pytest.raises(DataError, match="row 3: 'chosen' and 'rejected' are identical"):
        DPOTrainer(str(tiny_path), train_dataset=bad, **QUIET)


@pytest.mark.parametrize("field, value", [("chosen", ""), ("rejected", "   "), ("chosen", None)])
def test_empty_or_missing_completion_is_rejected(tiny_path, pairs, field, value):
    bad = pairs[:2] + [{**pairs[2], field: value}]
    with pytest.raises(DataError, match=f"row 2: (missing )?field '{field}'"):
        DPOTrainer(str(tiny_path), train_dataset=bad, **QUIET)


def test_lora_needs_a_model_path(tiny_path, pairs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_path), AutoTokenizer.from_pretrained(tiny_path)
    with pytest.raises(ConfigError, match="lora"):
        DPOTrainer(model, tokenizer, train_dataset=pairs, lora=LoraSettings(), **QUIET)
