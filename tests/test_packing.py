"""Padding-free packing (verl_core.modeling.packed_forward) computes exactly what the padded layout computes.

Losses and per-sequence log-probs are compared in fp32 against the padded path within 1e-5
(absolute on losses, relative on summed log-probs of ~40 tokens), and in fp64 within 1e-9,
which shows the two layouts are the same computation up to float rounding.
"""

from __future__ import annotations

import pytest
import torch

from verl_core.bundled import arithmetic
from verl_core.data import (
    collate_pairs,
    collate_sequences,
    collate_sft,
    packing,
    tokenize_prompts,
    tokenize_sft,
    tokenize_unpaired,
)
from verl_core.losses.preference import dpo_loss, sequence_logps
from verl_core.modeling import forward, packed_forward
from verl_core.modeling.loading import load_causal_lm, load_reward_model, load_tokenizer
from verl_core.modeling.packed_forward import model_token_logprobs, pair_rewards


@pytest.fixture(scope="module")
def sft_examples(tok):
    no_prompt = tokenize_sft([{"text": "Ann has 3 cups."}], tok, 128)  # a row with no prompt
    return tokenize_sft(arithmetic.sft_rows(12), tok, 128) + no_prompt


def _model(path, impl="sdpa", dtype=torch.float32):
    model = load_causal_lm(path)
    model.config._attn_implementation = impl
    return model.to(dtype).eval()


def _sft_loss(logps, batch):
    mask = batch["loss_mask"].to(logps.dtype)
    return -(logps * mask).sum() / mask.sum()


# -- layout -----------------------------------------------------------------------------------
def test_layout_matches_the_docstring_example():
    examples = [{"prompt_ids": [5, 6], "completion_ids": [7, 2]}, {"prompt_ids": [5], "completion_ids": [8, 9, 2]}]
    b = packing.collate_packed_sft(examples, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 2, 5, 8, 9, 2]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert b["segment_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 2]]
    assert b["branch_ids"].tolist() == [[0, 0, 1, 1, 0, 1, 1, 1]]
    assert b["packed_index"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    padded = collate_sft(examples, pad_id=0)
    assert torch.equal(b["loss_mask"], padded["loss_mask"])
    assert "attention_mask" not in b  # unaware code fails loudly instead of misreading packed rows


def test_shared_prompt_layout_and_mask():
    examples = [{"prompt_ids": [5, 6], "chosen_ids": [7, 2], "rejected_ids": [8, 9, 2]}]
    b = packing.collate_packed_pairs(examples, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 2, 8, 9, 2]]  # one copy of the prompt
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 2, 3, 4]]  # rejected restarts after the prompt
    assert b["packed_index"].tolist() == [[0, 1, 2, 3, -1], [0, 1, 4, 5, 6]]
    assert torch.equal(b["loss_mask"], collate_pairs(examples, 0)["loss_mask"])
    mask = packed_forward.packed_attention_mask(b)[0, 0]
    sees = {q: [k for k in range(7) if mask[q, k]] for q in range(7)}
    assert sees[1] == [0, 1] and sees[3] == [0, 1, 2, 3]
    assert sees[4] == [0, 1, 4] and sees[6] == [0, 1, 4, 5, 6]  # rejected never sees chosen
    additive = packed_forward.packed_attention_mask(b, torch.float32)[0, 0]
    assert additive[6, 2] == torch.finfo(torch.float32).min and additive[6, 5] == 0


def test_row_capacity_packs_first_fit_and_pads_rows_that_only_see_themselves():
    examples = [{"prompt_ids": [1] * 3, "completion_ids": [2] * n} for n in (5, 1, 4, 2)]  # sizes 8, 4, 7, 5
    b = packing.collate_packed_sft(examples, pad_id=0, row_capacity=13)
    assert b["input_ids"].shape == (2, 13)
    assert packing.packing_stats(b)["computed_tokens"] == 24 and packing.packing_stats(b)["logical_tokens"] == 24
    mask = packed_forward.packed_attention_mask(b)[:, 0]
    pad = b["segment_ids"] == 0
    assert bool(pad.any())
    for r, c in pad.nonzero().tolist():
        assert mask[r, c].nonzero().flatten().tolist() == [c]
    with pytest.raises(ValueError, match="one entry per prompt"):
        packing.collate_packed([[1]], [[[2]], [[3], [4]]], 0)


def test_row_capacity_longest_never_widens_a_row_beyond_the_longest_unit():
    examples = [{"prompt_ids": [1] * 3, "completion_ids": [2] * n} for n in (9, 1, 2, 6, 3)]  # sizes 12, 4, 5, 9, 6
    b = packing.collate_packed_sft(examples, pad_id=0, row_capacity="longest")
    assert b["input_ids"].shape[1] == 12  # short units share rows: 12 | 9 (+ nothing) | ...
    assert b["input_ids"].shape[0] < len(examples)
    with pytest.raises(ValueError, match="longest"):
        packing.collate_packed_sft(examples, pad_id=0, row_capacity="widest")


# -- equal results ----------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("capacity", [None, 80])
def test_packed_sft_loss_and_gradients_equal_padded(tiny_path, tok, sft_examples, impl, capacity):
    model = _model(tiny_path, impl)
    padded = collate_sft(sft_examples, tok.pad_token_id)
    packed = packing.collate_packed_sft(sft_examples, tok.pad_token_id, row_capacity=capacity)
    assert packing.packing_stats(packed)["computed_tokens"] < padded["input_ids"].numel()
    loss_pad = _sft_loss(model_token_logprobs(model, padded), padded)
    grads_pad = torch.autograd.grad(loss_pad, list(model.parameters()))
    loss_packed = _sft_loss(packed_forward.packed_token_logprobs(model, packed), packed)
    grads_packed = torch.autograd.grad(loss_packed, list(model.parameters()))
    assert abs(loss_pad.item() - loss_packed.item()) < 1e-5
    for gp, gq in zip(grads_pad, grads_packed):
        torch.testing.assert_close(gq, gp, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_dpo_pair_logps_and_loss_equal_padded(tiny_path, tok, pair_examples, share_prompt, impl):
    model = _model(tiny_path, impl)
    padded = collate_pairs(pair_examples, tok.pad_token_id)
    packed = packing.collate_packed_pairs(pair_examples, tok.pad_token_id, share_prompt=share_prompt, row_capacity=150)
    if share_prompt:  # the prompt and the completions' common beginning are computed once per pair
        stats = packing.packing_stats(packed)
        common = [
            next((i for i, (a, b) in enumerate(zip(e["chosen_ids"], e["rejected_ids"])) if a != b), 0) for e in pair_examples
        ]
        assert sum(common) > 0  # " 8 + 3 = 11" vs " 8 + 3 = 20": these pairs share their first tokens
        assert stats["computed_tokens"] == stats["logical_tokens"] - sum(
            len(e["prompt_ids"]) + c for e, c in zip(pair_examples, common)
        )
    with torch.no_grad():
        ref = sequence_logps(model_token_logprobs(model, padded), padded["loss_mask"]) - 0.5
    s_pad = sequence_logps(model_token_logprobs(model, padded), padded["loss_mask"])
    s_packed = sequence_logps(packed_forward.packed_token_logprobs(model, packed), packed["loss_mask"])
    torch.testing.assert_close(s_packed, s_pad, rtol=1e-5, atol=1e-5)
    n = len(pair_examples)
    loss_pad = dpo_loss(s_pad[:n], s_pad[n:], ref[:n], ref[n:], 0.1).losses.mean()
    loss_packed = dpo_loss(s_packed[:n], s_packed[n:], ref[:n], ref[n:], 0.1).losses.mean()
    assert abs(loss_pad.item() - loss_packed.item()) < 1e-5
    g_pad = torch.autograd.grad(loss_pad, [model.model.embed_tokens.weight])[0]
    g_packed = torch.autograd.grad(loss_packed, [model.model.embed_tokens.weight])[0]
    torch.testing.assert_close(g_packed, g_pad, rtol=1e-4, atol=1e-7)


def test_packed_pair_logps_are_the_same_computation_in_fp64(tiny_path, tok, pair_examples):
    model = _model(tiny_path, "sdpa", torch.float64)
    padded = collate_pairs(pair_examples, tok.pad_token_id)
    packed = packing.collate_packed_pairs(pair_examples, tok.pad_token_id)
    with torch.no_grad():
        s_pad = sequence_logps(model_token_logprobs(model, padded), padded["loss_mask"])
        s_packed = sequence_logps(packed_forward.packed_token_logprobs(model, packed), packed["loss_mask"])
    assert (s_pad - s_packed).abs().max().item() < 1e-9


def test_packed_kto_rows_equal_padded(tiny_path, tok):
    from verl_core.algorithms.kto import assign_kl_completions

    rows = [
        {"prompt": r["prompt"], "completion": r["chosen"], "label": i % 2 == 0}
        for i, r in enumerate(arithmetic.preference_rows(arithmetic.train_problems(8)))
    ]
    examples = assign_kl_completions(tokenize_unpaired(rows, tok, 128), seed=0, max_length=128)
    model = _model(tiny_path)
    prompts = [e["prompt_ids"] for e in examples]
    packed = packing.collate_packed_kto(examples, tok.pad_token_id)
    assert packed["labels"].tolist() == [e["label"] for e in examples]
    for field, rows in (("completion_ids", packed), ("kl_completion_ids", packed["kl"])):  # target rows, KL rows
        padded = collate_sequences(prompts, [e[field] for e in examples], tok.pad_token_id)
        with torch.no_grad():
            s_pad = sequence_logps(model_token_logprobs(model, padded), padded["loss_mask"])
            s_packed = sequence_logps(packed_forward.packed_token_logprobs(model, rows), rows["loss_mask"])
        torch.testing.assert_close(s_packed, s_pad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_packed_reward_scores_equal_padded(tiny_path, tok, pair_examples, share_prompt):
    torch.manual_seed(0)
    rm = load_reward_model(tiny_path).eval()
    padded = collate_pairs(pair_examples, tok.pad_token_id)
    packed = packing.collate_packed_pairs(pair_examples, tok.pad_token_id, share_prompt=share_prompt)
    seen = _mlp_rows(rm)
    c_pad, r_pad = pair_rewards(rm, padded)
    c_packed, r_packed = packed_forward.packed_pair_rewards(rm, packed)
    assert seen[1] == 2 * len(pair_examples)  # the pruned last layer: each sequence's last token only
    torch.testing.assert_close(c_packed, c_pad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r_packed, r_pad, rtol=1e-5, atol=1e-5)
    grad_pad = torch.autograd.grad(-(c_pad - r_pad).sigmoid().log().mean(), [rm.score.weight])[0]
    grad_packed = torch.autograd.grad(-(c_packed - r_packed).sigmoid().log().mean(), [rm.score.weight])[0]
    torch.testing.assert_close(grad_packed, grad_pad, rtol=1e-4, atol=1e-6)  # fp32 sums in another order


def test_model_token_logprobs_and_entropies_of_packed_batches_also_without_logits_to_keep(tiny_path, tok, sft_examples):
    model = _model(tiny_path)

    class NoLogitsToKeep(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)

    padded = collate_sft(sft_examples, tok.pad_token_id)
    packed = packing.collate_packed_sft(sft_examples, tok.pad_token_id)
    with torch.no_grad():
        lp_pad, ent_pad = model_token_logprobs(model, padded, with_entropy=True)
        lp_packed, ent_packed = model_token_logprobs(model, packed, with_entropy=True)
        no_logits_to_keep = packed_forward.packed_token_logprobs(NoLogitsToKeep(model), packed)
    need = padded["loss_mask"].bool().clone()
    need[:, 0] = False
    torch.testing.assert_close(lp_packed[need], lp_pad[need], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_packed[need], ent_pad[need], rtol=1e-5, atol=1e-5)
    assert bool((lp_packed[~need] == 0).all()) and abs(_sft_loss(lp_packed, packed) - _sft_loss(no_logits_to_keep, packed)) < 1e-6


def test_flash_attention_gets_no_mask_and_refuses_shared_prompts_a_custom_sdpa_kernel_gets_sdpas(tiny_path, tok, pair_examples):
    model = _model(tiny_path)
    model.config._attn_implementation = "flash_attention_2"
    assert not packed_forward.supports_shared_prompt(model)
    assert forward.can_prune_last_layer(model)  # pruning never touches the attention kernel
    shared = packing.collate_packed_pairs(pair_examples, tok.pad_token_id, share_prompt=True)
    with pytest.raises(ValueError, match="share_prompt=False"):
        packed_forward.packed_forward(model, shared)
    seen = {}
    model.forward = lambda **kw: seen.update(kw)  # no flash-attn kernel on CPU: check the call only
    packed_forward.packed_forward(model, packing.collate_packed_pairs(pair_examples, tok.pad_token_id, share_prompt=False))
    assert seen["attention_mask"] is None and seen["position_ids"] is not None
    model.config._attn_implementation = "sdpa_fp32_cpu"  # as bench/fp32_attention.py registers one
    packed_forward.packed_forward(model, shared)
    assert seen["attention_mask"].dtype == torch.bool and packed_forward.supports_shared_prompt(model)


def test_packed_response_logprobs_share_each_prompt_and_equal_the_padded_ones(tiny_path, tok):
    from verl_core.modeling.forward import response_logprobs
    from verl_core.rollout.contract import SamplingParams
    from verl_core.rollout.hf_backend import HFRolloutBackend

    model = _model(tiny_path)
    prompts = [e["prompt_ids"] for e in tokenize_prompts(arithmetic.prompt_rows(4), tok, 64)]
    rollout = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(
        prompts, SamplingParams(max_new_tokens=10, n=3), seed=0
    )
    seen = _mlp_rows(model)
    batch = rollout.training_inputs()
    batch = {k: v[torch.randperm(12, generator=torch.Generator().manual_seed(0))] for k, v in batch.items()}  # groups split up
    batch["response_mask"][0, 3:] = 0  # an early stop
    mask = batch["response_mask"].bool()
    lp_pad, ent_pad = response_logprobs(model, batch, scale=1 / 0.7, with_entropy=True)
    lp_shared, ent_shared = packed_forward.packed_response_logprobs(
        model, batch, tok.pad_token_id, scale=1 / 0.7, with_entropy=True
    )
    torch.testing.assert_close(lp_shared[mask], lp_pad[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_shared[mask], ent_pad[mask], rtol=1e-5, atol=1e-5)
    assert not lp_shared[~mask].any() and not ent_pad[~mask].any()
    assert seen[1] <= int(mask.sum()) < seen[0]  # the pruned last layer: only where a response token is predicted
    g_pad = torch.autograd.grad(lp_pad[mask].sum(), [model.model.embed_tokens.weight])[0]
    g_shared = torch.autograd.grad(lp_shared[mask].sum(), [model.model.embed_tokens.weight])[0]
    torch.testing.assert_close(g_shared, g_pad, rtol=1e-4, atol=1e-5)  # fp32 sums in another order: 1.2e-6 seen


# -- through the trainers (the packing=True switch) ------------------------------------------------
def _losses(result):
    return [v for _, v in result.history["loss"]]


def _common(tiny_path, rows, **extra):
    return dict(
        model=str(tiny_path),
        train_dataset=rows,
        max_steps=3,
        batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        progress=False,
        **extra,
    )


@pytest.mark.parametrize("row_tokens, checkpointing", [("longest", False), (100, True)])
def test_sft_trainer_packed_losses_equal_padded(tiny_path, row_tokens, checkpointing):
    from verl_core.algorithms.sft import SFTTrainer

    # with gradient checkpointing the pruned last layer is not checkpointed (its recompute would run
    # after the pruning hooks are removed), so the gradients stay exact
    common = _common(tiny_path, arithmetic.sft_rows(32), gradient_checkpointing=checkpointing)
    padded = _losses(SFTTrainer(**common, packing=False).train())
    trainer = SFTTrainer(**common, packing_row_tokens=row_tokens)  # packing is the default
    assert packing.is_packed(trainer.collate(trainer.train_examples[:8]))
    packed = _losses(trainer.train())
    assert max(abs(a - b) for a, b in zip(padded, packed)) < 1e-5, (padded, packed)


def test_dpo_trainer_packed_with_precomputed_reference_equals_padded_on_the_fly(tiny_path):
    from verl_core.algorithms.dpo import DPOTrainer

    common = _common(tiny_path, arithmetic.preference_rows(arithmetic.train_problems(32)))
    padded = _losses(DPOTrainer(**common, packing=False, precompute_ref_logps=False).train())
    packed = _losses(DPOTrainer(**common, precompute_ref_logps=True).train())
    assert max(abs(a - b) for a, b in zip(padded, packed)) < 1e-5, (padded, packed)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_reward_and_kto_trainers_packed_equal_padded(tiny_path, share_prompt):
    from verl_core.algorithms.kto import KTOTrainer
    from verl_core.algorithms.reward_model import RewardTrainer

    pairs = arithmetic.preference_rows(arithmetic.train_problems(32))
    for cls in (RewardTrainer, KTOTrainer):
        common = _common(tiny_path, pairs)
        padded = _losses(cls(**common, packing=False).train())
        packed = _losses(cls(**common, share_prompt=share_prompt).train())
        assert max(abs(a - b) for a, b in zip(padded, packed)) < 1e-5, (cls.__name__, padded, packed)


def test_grpo_trainer_shared_prompt_update_equals_padded(tiny_path):
    from verl_core.algorithms.grpo import GRPOTrainer

    common = dict(
        policy=str(tiny_path),
        prompts=arithmetic.prompt_rows(16),
        max_steps=2,
        batch_size=16,
        num_generations=4,
        mini_batch_size=8,
        ppo_epochs=1,
        max_new_tokens=8,
        learning_rate=1e-3,
        kl_coef=0.05,
        seed=0,
        logging_steps=1,
        progress=False,
        reward_fns=[lambda completions, truths: [len(c) / 10 for c in completions]],
    )
    from verl_core.train.callbacks import Callback

    class Updates(Callback, list):  # records every optimizer step's metrics
        def on_update(self, step, metrics):
            self.append(metrics)

    updates = [Updates(), Updates()]
    runs = [GRPOTrainer(**common, packing=flag, callbacks=[u]) for flag, u in zip((False, True), updates)]
    for trainer in runs:
        trainer.train()
    keys = ("loss", "policy/approx_kl", "policy/kl_loss")
    assert len(updates[0]) == len(updates[1]) == 4  # 2 rollout steps × 2 mini-batches
    for a, b in zip(*updates):
        for k in keys:
            assert abs(a[k] - b[k]) < 1e-5, (k, a[k], b[k])


def test_flash_attention_falls_back_to_packing_without_shared_prompts(tiny_path):
    from verl_core.algorithms.dpo import DPOTrainer

    model = load_causal_lm(tiny_path)
    model.config._attn_implementation = "flash_attention_2"
    trainer = DPOTrainer(
        model=model,
        tokenizer=load_tokenizer(tiny_path),
        train_dataset=arithmetic.preference_rows(arithmetic.train_problems(4)),
        batch_size=4,
    )
    assert trainer.config.packing and not trainer.config.share_prompt
    assert "flash_attention_2" in trainer.speed_features["fallbacks"]["share_prompt"]


# -- the last decoder layer only where the loss reads ----------------------------------------------
def _mlp_rows(model):
    """Rows the last layer's MLP computes per call (hooked inside it: the MLP's own hooks are pruning's)."""
    seen = []
    model.model.layers[-1].mlp.down_proj.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0][..., 0].numel()))
    return seen


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_pruned_last_layer_gives_the_full_layers_logprobs_and_gradients(tiny_path, tok, pair_examples, impl):
    model = _model(tiny_path, impl).train()
    assert forward.can_prune_last_layer(model)
    layer, layer_forward = model.model.layers[-1], type(model.model.layers[-1]).forward
    seen = _mlp_rows(model)
    results = []
    for prune in (False, True):
        batch = packing.collate_packed_pairs(pair_examples, tok.pad_token_id, row_capacity=100, prune_last_layer=prune)
        lp = sequence_logps(model_token_logprobs(model, batch), batch["loss_mask"])
        grads = torch.autograd.grad(lp.sum(), [p for p in model.parameters()], allow_unused=True)
        results.append((lp.detach(), grads))
    assert seen[1] < 0.7 * seen[0]  # the prompts' positions (but their last) are skipped
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for g_full, g_pruned in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g_pruned, g_full, rtol=1e-4, atol=1e-5)
    for hooked in (layer.self_attn.o_proj, layer.mlp):  # pruning leaves no hook behind, and patches nothing
        assert not hooked._forward_pre_hooks and not hooked._forward_hooks
    assert "forward" not in vars(layer) and type(layer).forward is layer_forward


@pytest.mark.parametrize("layer", forward.PRUNABLE_LAYERS)
def test_every_prunable_layer_gives_the_full_layers_logprobs(tok, pair_examples, small_lm, layer):
    """Fails when a transformers release changes what a known decoder layer does after o_proj."""
    model = small_lm(layer.removesuffix("DecoderLayer").lower(), len(tok)).eval()
    assert type(model.model.layers[-1]).__name__ == layer and forward.can_prune_last_layer(model)
    seen, lps = _mlp_rows(model), []
    for prune in (False, True):
        batch = packing.collate_packed_pairs(pair_examples, tok.pad_token_id, prune_last_layer=prune)
        with torch.no_grad():
            lps.append(model_token_logprobs(model, batch)[batch["loss_mask"].bool()])
    torch.testing.assert_close(lps[1], lps[0], rtol=1e-5, atol=1e-5)
    assert seen[1] < 0.7 * seen[0]


def test_pruning_is_skipped_with_one_log_line_per_reason(tiny_path, monkeypatch, caplog):
    model, keep = _model(tiny_path), torch.ones(1, 4, dtype=torch.bool)
    monkeypatch.setattr(forward, "_logged_reasons", set())
    for name, value in (("PRUNABLE_LAYERS", ()), ("TESTED_TRANSFORMERS_MAJOR", (0, 0))):
        with monkeypatch.context() as patch, caplog.at_level("INFO", logger="verl_core"):
            patch.setattr(forward, name, value)
            assert not forward.can_prune_last_layer(model)
            for _ in range(2):
                with forward.last_layer_only_at(model, keep) as pruned:
                    assert not pruned
    logged = [r.getMessage() for r in caplog.records if "pruning skipped" in r.getMessage()]
    assert len(logged) == 2 and "LlamaDecoderLayer" in logged[0] and "transformers" in logged[1], logged
