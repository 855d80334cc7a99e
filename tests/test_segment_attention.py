"""Per-sequence attention of packed batches (verl_core.modeling.segment_attention) computes what the
row's block-diagonal causal mask computes: the attention itself, and a packed model's log-probs and
gradients; it stays out of batches and models it does not apply to."""

from __future__ import annotations

import pytest
import torch

from verl_core.bundled import arithmetic
from verl_core.data import packing, tokenize_sft
from verl_core.modeling import packed_forward, segment_attention
from verl_core.modeling.loading import load_causal_lm


def test_spans_are_the_runs_of_each_segment_id_without_row_padding():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 3, 0, 0, 0]])
    assert segment_attention.segment_spans(seg) == [[(0, 3), (3, 5)], [(0, 7)], [(0, 1), (1, 2), (2, 4)]]


def test_the_attention_equals_masked_sdpa_and_gives_zeros_at_row_padding():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    torch.manual_seed(0)
    seg = torch.tensor([[1] * 9 + [2] * 6 + [0] * 3, [1] * 4 + [2] * 5 + [3] * 9])
    batch = {"segment_ids": seg, "branch_ids": torch.zeros_like(seg)}
    q = torch.randn(2, 6, 18, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 18, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = packed_forward.packed_attention_mask(batch)
    want, _ = sdpa_attention_forward(Attention(), q, k, v, mask, scaling=0.3)
    spans = segment_attention.segment_spans(seg)
    got, _ = segment_attention.segment_sdpa_attention(Attention(), q, k, v, mask, scaling=0.3, packed_spans=spans)
    real = seg > 0
    torch.testing.assert_close(got[real], want[real], rtol=1e-12, atol=1e-12)
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))
    grads = torch.autograd.grad((got[real] ** 2).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want[real] ** 2).sum(), (q, k, v))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    plain, _ = segment_attention.segment_sdpa_attention(Attention(), q, k, v, mask, scaling=0.3)  # no spans: sdpa
    torch.testing.assert_close(plain, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def packed_sft(tok):
    examples = tokenize_sft(arithmetic.sft_rows(12), tok, 128)
    batch = packing.collate_packed_sft(examples, tok.pad_token_id, row_capacity=80)
    assert len(segment_attention.segment_spans(batch["segment_ids"])[0]) > 1  # rows hold several sequences
    return batch


def _model(path):
    model = load_causal_lm(path).eval()
    model.config._attn_implementation = "sdpa"
    return model


def test_a_packed_models_logprobs_and_gradients_equal_the_masked_forward(tiny_path, packed_sft, monkeypatch):
    model = _model(tiny_path)
    assert segment_attention.applies(model, packed_sft)
    switched = []
    original = type(model).set_attn_implementation
    monkeypatch.setattr(type(model), "set_attn_implementation", lambda m, name: (switched.append(name), original(m, name))[1])
    mask = packed_forward.packed_attention_mask(packed_sft)
    ids, positions = packed_sft["input_ids"], packed_sft["position_ids"]
    want = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    got = packed_forward.packed_forward(model, packed_sft).logits
    assert switched == [segment_attention.SEGMENT_SDPA, "sdpa"]  # per sequence inside the call, sdpa again after it
    real = packed_sft["segment_ids"] > 0
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    params = [p for p in model.parameters() if p.requires_grad]
    g_want = torch.autograd.grad(want[real].logsumexp(-1).sum(), params)
    g_got = torch.autograd.grad(got[real].logsumexp(-1).sum(), params)
    for g, w in zip(g_got, g_want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_it_stays_out_of_shared_prompts_checkpointing_and_other_attention(tiny_path, tok, packed_sft):
    model = _model(tiny_path)
    pairs = [{"prompt_ids": [5, 6], "chosen_ids": [7, 2], "rejected_ids": [8, 9, 2]}]
    assert not segment_attention.applies(model, packing.collate_packed_pairs(pairs, pad_id=0, share_prompt=True))
    assert segment_attention.applies(model, packing.collate_packed_pairs(pairs, pad_id=0, share_prompt=False))
    model.gradient_checkpointing_enable()
    assert not segment_attention.applies(model, packed_sft)
    eager = _model(tiny_path)
    eager.config._attn_implementation = "eager"
    assert not segment_attention.applies(eager, packed_sft)
    with segment_attention.segment_attention(eager, packed_sft) as extra:
        assert extra == {}
