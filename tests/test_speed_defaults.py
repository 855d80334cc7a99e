"""Fast by default: every trainer built with default arguments takes the fast path and says so;
where a path cannot apply it falls back, trains, and logs why; small datasets train."""

from __future__ import annotations

import logging

import pytest
import torch

from verl_core.algorithms.registry import ALGORITHMS
from verl_core.algorithms.reward_model import RewardTrainer
from verl_core.algorithms.sft import SFTTrainer
from verl_core.bundled import arithmetic
from verl_core.modeling.loading import load_causal_lm, load_tokenizer

QUIET = dict(progress=False, logging_steps=1)


def _offline_data(name: str) -> list[dict]:
    return arithmetic.sft_rows(16) if name == "sft" else arithmetic.preference_rows(arithmetic.train_problems(16))


def _trainer(name: str, model, **kw):
    if name == "sft":
        return SFTTrainer(model, train_dataset=_offline_data(name), **kw)
    if name == "reward_model":
        return RewardTrainer(model, train_dataset=_offline_data(name), **kw)
    a = ALGORITHMS[name]
    if a.kind == "offline":
        return a.trainer(model, train_dataset=_offline_data(name), **kw)
    if name == "distill":
        kw.setdefault("teacher_model", model)  # any teacher with the student's tokenizer
    return a.trainer(model, prompts=arithmetic.prompt_rows(8), batch_size=8, num_generations=4, **kw)


# rounds algorithms (iterative_dpo, rft) train with the DPO and SFT trainers tested here
@pytest.mark.parametrize("name", ["sft", "reward_model", *(n for n, a in ALGORITHMS.items() if a.kind != "rounds")])
def test_default_arguments_take_the_fast_path(tiny_path, name):
    trainer = _trainer(name, str(tiny_path))
    f = trainer.speed_features
    assert f["chunked_logprobs"]
    if name == "ppo":  # the trainers without a packed path: said, not hidden
        assert not f["packing"] and "value head" in f["fallbacks"]["packing"]
        assert not f["fused_lm_head"] and "value model" in f["fallbacks"]["fused_lm_head"]
        return
    if name == "distill":
        assert not f["packing"] and "padded batches" in f["fallbacks"]["packing"] and f["fused_lm_head"], f
        return
    assert ("fused_lm_head" not in f) if name == "reward_model" else f["fused_lm_head"], f  # a reward model has no LM head
    assert f["packing"] and f["prune_last_layer"] and f["fallbacks"] == {}, f
    if name in ("reward_model", "dpo", "kto", "simpo", "orpo"):
        assert f["share_prompt"]
    if name in ("dpo", "kto"):  # one epoch over 16 rows at batch 16: precomputing costs nothing extra
        assert f["precompute_ref_logps"] and trainer.ref_model is None


def test_default_run_reports_its_speed_features_first(tiny_path, caplog):
    from verl_core.train.callbacks import Callback

    class Params(Callback):
        def on_train_begin(self, params):
            self.params = params

    seen = Params()
    with caplog.at_level(logging.INFO, logger="verl_core"):
        SFTTrainer(
            str(tiny_path), train_dataset=arithmetic.sft_rows(16), batch_size=8, max_steps=1, callbacks=[seen], **QUIET
        ).train()
    assert any("packing=on" in r.getMessage() and "prune_last_layer=on" in r.getMessage() for r in caplog.records)
    assert seen.params["speed/packing"] is True and seen.params["speed/prune_last_layer"] is True


def test_precompute_auto_scores_on_the_fly_when_the_run_reads_part_of_the_data(tiny_path):
    from verl_core import DPOTrainer

    pairs = arithmetic.preference_rows(arithmetic.train_problems(64))
    partial = DPOTrainer(str(tiny_path), train_dataset=pairs, batch_size=8, max_steps=2, **QUIET)  # reads 16 of 64
    assert not partial.speed_features["precompute_ref_logps"] and partial.ref_model is not None
    full = DPOTrainer(str(tiny_path), train_dataset=pairs, batch_size=8, num_epochs=1, **QUIET)
    assert full.speed_features["precompute_ref_logps"] and full.ref_model is None


@pytest.fixture()
def custom_attention():
    """An attention implementation packing does not know (it is plain SDPA under another name)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("my_attention", sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register("my_attention", sdpa_mask)
    return "my_attention"


def test_an_attention_without_packed_masks_falls_back_to_padded_rows_and_trains(tiny_path, custom_attention, caplog):
    model = load_causal_lm(tiny_path)
    model.set_attn_implementation(custom_attention)
    with caplog.at_level(logging.INFO, logger="verl_core"):
        trainer = SFTTrainer(
            model,
            load_tokenizer(tiny_path),
            train_dataset=arithmetic.sft_rows(16),
            batch_size=8,
            max_steps=3,
            learning_rate=3e-3,
            **QUIET,
        )
    assert not trainer.config.packing and "my_attention" in trainer.speed_features["fallbacks"]["packing"]
    assert [r for r in caplog.records if "packing is off" in r.getMessage()]
    assert "packed_index" not in trainer.collate(trainer.train_examples[:2])
    losses = [v for _, v in trainer.train().history["loss"]]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_a_model_family_pruning_does_not_know_runs_its_last_layer_in_full_and_trains(tiny_path, monkeypatch, caplog):
    from verl_core import DPOTrainer
    from verl_core.modeling import forward

    monkeypatch.setattr(forward, "PRUNABLE_LAYERS", ())
    with caplog.at_level(logging.INFO, logger="verl_core"):
        trainer = DPOTrainer(str(tiny_path), train_dataset=_offline_data("dpo"), batch_size=8, max_steps=2, **QUIET)
    f = trainer.speed_features
    assert f["packing"] and not f["prune_last_layer"] and "LlamaDecoderLayer" in f["fallbacks"]["prune_last_layer"]
    assert [r for r in caplog.records if "prune_last_layer is off" in r.getMessage()]
    assert len(trainer.train().history["loss"]) == 2


def test_each_speed_feature_has_a_switch_that_turns_it_off(tiny_path):
    from verl_core import DPOTrainer

    trainer = DPOTrainer(str(tiny_path), train_dataset=_offline_data("dpo"), packing=False, precompute_ref_logps=False)
    assert not trainer.speed_features["packing"] and not trainer.speed_features["precompute_ref_logps"]
    assert trainer.speed_features["fallbacks"] == {}  # turned off by the user: no fallback to report
    kept = DPOTrainer(str(tiny_path), train_dataset=_offline_data("dpo"), share_prompt=False, prune_last_layer=False)
    assert kept.speed_features["packing"] and not kept.speed_features["share_prompt"]
    assert not kept.speed_features["prune_last_layer"]


def test_the_seeds_one_row_dpo_example_runs_verbatim(tiny_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core import DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    with caplog.at_level(logging.WARNING, logger="verl_core"):
        trainer = DPOTrainer(
            model=model,
            tokenizer=tokenizer,
            train_dataset=[
                {
                    "prompt": "解释一下机器学习",
                    "chosen": "机器学习是人工智能的一个分支，让计算机从数据中学习规律。",
                    "rejected": "不知道。",
                }
            ],
            beta=0.1,
            learning_rate=1e-4,
            batch_size=16,
            shrink_batch_to_data=True,
            num_epochs=1,
        )
    assert [r for r in caplog.records if "fewer than batch_size 16" in r.getMessage()]
    result = trainer.train()
    assert result.steps == 1 and abs(result.metrics["loss"] - 0.6931) < 1e-3


def test_fewer_rows_than_batch_size_train_on_what_there_is(tiny_path):
    trainer = SFTTrainer(
        str(tiny_path),
        train_dataset=arithmetic.sft_rows(5),
        batch_size=16,
        shrink_batch_to_data=True,
        gradient_accumulation_steps=2,
        max_steps=2,
        **QUIET,
    )
    assert trainer.config.batch_size == 4 and trainer.config.gradient_accumulation_steps == 2
    assert trainer.train().steps == 2


def test_a_model_whose_head_is_not_a_plain_linear_layer_takes_log_probs_from_its_logits_and_trains(tiny_path, caplog):
    from verl_core import GRPOTrainer
    from verl_core.policies import LLMPolicy

    model = load_causal_lm(tiny_path)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with caplog.at_level(logging.INFO, logger="verl_core"):
        rows = arithmetic.sft_rows(16)
        sft = SFTTrainer(model, load_tokenizer(tiny_path), train_dataset=rows, batch_size=8, max_steps=2, **QUIET)
        policy = LLMPolicy(model, load_tokenizer(tiny_path))
        grpo = GRPOTrainer(policy, prompts=arithmetic.prompt_rows(4), batch_size=4, num_generations=2, max_steps=1, **QUIET)
    for trainer in (sft, grpo):
        f = trainer.speed_features
        assert f["packing"] and not f["fused_lm_head"] and "with a bias" in f["fallbacks"]["fused_lm_head"], f
    assert [r for r in caplog.records if "fused_lm_head is off" in r.getMessage()]
    assert len(sft.train().history["loss"]) == 2
    assert torch.isfinite(torch.tensor(grpo.train().history["policy/loss"][0][1]))


def test_fused_lm_head_has_a_switch(tiny_path):
    off = SFTTrainer(str(tiny_path), train_dataset=arithmetic.sft_rows(16), fused_lm_head=False)
    assert not off.speed_features["fused_lm_head"] and off.speed_features["fallbacks"] == {}
    assert not bool(off.collate(off.train_examples[:2])["fused_lm_head"])


def test_fewer_rows_than_batch_size_is_an_error_naming_both_unless_allowed(tiny_path):
    from verl_core.errors import TrainingError

    with pytest.raises(TrainingError, match="the dataset has 1 rows, fewer than batch_size 16: .*shrink_batch_to_data"):
        SFTTrainer(str(tiny_path), train_dataset=arithmetic.sft_rows(1), batch_size=16, max_steps=1, **QUIET)
