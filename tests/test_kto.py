"""KTO trainer: step-0 loss, paired-data conversion, KL pairs, precomputation, the
cross-process KL reduction, label balance and bad rows. All on the tiny default model."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest

from verl_core.algorithms.kto import KTOTrainer, assign_kl_completions
from verl_core.bundled import arithmetic
from verl_core.data import DataError

QUIET = dict(progress=False, logging_steps=1)


@pytest.fixture(scope="module")
def pairs() -> list[dict]:
    return arithmetic.preference_rows(arithmetic.train_problems(16))


@pytest.fixture(scope="module")
def unpaired(pairs) -> list[dict]:
    return [
        {"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"} for r in pairs for key in ("chosen", "rejected")
    ]


def test_kto_loss_is_one_half_at_step0(tiny_path, unpaired):
    trainer = KTOTrainer(str(tiny_path), train_dataset=unpaired, max_steps=1, batch_size=8, **QUIET)
    out = trainer.loss(trainer.model, trainer.collate(trainer.train_examples[:8]))
    assert out.count == 8
    assert abs(float(out.loss_sum) / out.count - 0.5) < 1e-6
    assert out.metrics["kl"] == 0.0
    result = trainer.train()
    assert abs(result.history["loss"][0][1] - 0.5) < 1e-6
    assert {
        "kl",
        "count/desirable",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    } <= set(result.history)


def test_paired_rows_become_one_desirable_and_one_undesirable_row_each(tiny_path, pairs):
    trainer = KTOTrainer(str(tiny_path), train_dataset=pairs, max_steps=1, batch_size=8, **QUIET)
    labels = [e["label"] for e in trainer.train_examples]
    assert labels == [True, False] * len(pairs)
    assert trainer.train_examples[0]["prompt_ids"] == trainer.train_examples[1]["prompt_ids"]


def test_kl_completion_of_each_example_is_another_examples_completion():
    examples = [{"prompt_ids": [1, 2], "completion_ids": [100 + i, 7], "label": i % 2 == 0} for i in range(9)]
    assign_kl_completions(examples, seed=3, max_length=3)
    partners = [e["kl_completion_ids"][0] - 100 for e in examples]
    assert sorted(partners) == list(range(9))  # each completion serves as a KL completion exactly once
    assert all(p != i for i, p in enumerate(partners))  # never the example's own completion
    assert all(len(e["kl_completion_ids"]) == 1 for e in examples)  # cut so that prompt + KL completion fits max_length
    with pytest.raises(DataError, match="at least 2 rows"):
        assign_kl_completions(examples[:1], seed=0, max_length=8)


def test_kto_precomputed_reference_gives_the_same_losses_as_on_the_fly(tiny_path, pairs):
    common = dict(train_dataset=pairs, max_steps=3, batch_size=8, learning_rate=1e-3, **QUIET)
    live = KTOTrainer(str(tiny_path), precompute_ref_logps=False, **common).train()
    trainer = KTOTrainer(str(tiny_path), precompute_ref_logps=True, **common)
    pre = trainer.train()
    assert trainer.ref_model is None
    for key in ("loss", "kl"):
        got, want = [v for _, v in pre.history[key]], [v for _, v in live.history[key]]
        # the same sums in other batchings: float rounding only (1.9e-6 on an AVX2 EPYC host after 3 steps at lr 1e-3)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (key, got, want)


def test_kl_reference_point_is_averaged_across_processes(tiny_path, unpaired):
    """With several processes z0 goes through ``accelerator.reduce(z0, "mean")`` before the clamp."""
    trainer = KTOTrainer(str(tiny_path), train_dataset=unpaired, max_steps=1, batch_size=8, **QUIET)
    calls = []

    def reduce(tensor, reduction):
        calls.append(reduction)
        return tensor * 0 + 3.0  # as if the other processes' estimates averaged to 3

    trainer.engine = SimpleNamespace(
        accelerator=SimpleNamespace(num_processes=2, reduce=reduce, autocast=contextlib.nullcontext, unwrap_model=lambda m: m)
    )
    out = trainer.loss(trainer.model, trainer.collate(trainer.train_examples[:8]))
    assert calls == ["mean"] and out.metrics["kl"] == 3.0
    # r = 0, z0 = 3, β = 0.1: desirable 1-σ(-0.3), undesirable 1-σ(0.3); the batch alternates labels
    expected = ((1 - 1 / (1 + math.exp(0.3))) + (1 - 1 / (1 + math.exp(-0.3)))) / 2
    assert abs(float(out.loss_sum) / out.count - expected) < 1e-6


def test_all_desirable_batch_trains_and_reports_nan_for_the_absent_class(tiny_path, unpaired):
    """Documented handling: the loss is per row, so a one-class batch is fine; absent-class metrics are NaN."""
    trainer = KTOTrainer(str(tiny_path), train_dataset=unpaired, max_steps=1, batch_size=8, **QUIET)
    desirable = [e for e in trainer.train_examples if e["label"]][:4]
    out = trainer.loss(trainer.model, trainer.collate(desirable))
    assert abs(float(out.loss_sum) / out.count - 0.5) < 1e-6
    out.loss_sum.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())
    assert out.metrics["count/desirable"] == 1.0 and math.isfinite(out.metrics["rewards/chosen"])
    assert math.isnan(out.metrics["rewards/rejected"]) and math.isnan(out.metrics["logps/rejected"])
    assert math.isnan(out.metrics["rewards/margins"])


@pytest.mark.parametrize("label, name", [(True, "desirable"), (False, "undesirable")])
def test_single_label_dataset_is_rejected_with_advice(tiny_path, unpaired, label, name):
    rows = [r for r in unpaired if r["label"] is label]
    with pytest.raises(DataError, match=f"only {name} .*needs both labels"):
        KTOTrainer(str(tiny_path), train_dataset=rows, **QUIET)


def test_single_label_eval_dataset_is_allowed(tiny_path, unpaired):
    trainer = KTOTrainer(str(tiny_path), train_dataset=unpaired, eval_dataset=[r for r in unpaired if r["label"]][:4], **QUIET)
    assert all(e["label"] for e in trainer.eval_examples)


def test_missing_label_is_rejected(tiny_path, unpaired):
    rows = unpaired[:3] + [{"prompt": unpaired[3]["prompt"], "completion": unpaired[3]["completion"]}]
    with pytest.raises(DataError, match="row 3: missing field 'label'"):
        KTOTrainer(str(tiny_path), train_dataset=rows, **QUIET)


def test_empty_completion_is_rejected(tiny_path, unpaired):
    rows = unpaired[:2] + [{**unpaired[2], "completion": " "}]
    with pytest.raises(DataError, match="row 2: field 'completion' is empty"):
        KTOTrainer(str(tiny_path), train_dataset=rows, **QUIET)


@pytest.mark.slow
def test_unpaired_rows_train_kto_through_the_pipeline_stage(tiny_path, tmp_path):
    """KTO reads unpaired rows given as the preference data (issue 18: KeyError 'chosen' before);
    a pairs-only algorithm refuses them naming the file."""
    import json

    from verl_core.data.fingerprint import fingerprint_path
    from verl_core.pipeline import StageRecord, load_pipeline_config, run_stage

    rows = [{"prompt": f"Q: {i}+1=", "completion": f" {i + 1 if i % 2 else i}", "label": bool(i % 2)} for i in range(8)]
    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    inputs = {
        "sft": StageRecord(stage="sft", output_path=str(tiny_path), fingerprint=fingerprint_path(tiny_path)),
        "preference_data": StageRecord(stage="preference_data", output_path=str(data), fingerprint=fingerprint_path(data)),
    }
    sets = [f"workdir={tmp_path / 'w'}", "policy_optimisation.kto.max_steps=2", "policy_optimisation.kto.batch_size=4"]
    sets += ["policy_optimisation.kto.progress=false"]
    result = run_stage(load_pipeline_config(None, [*sets, "policy_optimisation.algorithm=kto"]), "policy_optimisation", inputs)
    assert result.record.extra["steps"] == 2
    with pytest.raises(DataError, match=r"unpaired\.jsonl holds unpaired rows .* dpo needs pairs"):
        run_stage(load_pipeline_config(None, [*sets, "policy_optimisation.algorithm=dpo"]), "policy_optimisation", inputs)
