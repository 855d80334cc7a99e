"""The fused LM head (verl_core.modeling.lm_head): the same log-probs, entropies and gradients as the
model's own logits, for every model family it is enabled for."""

from __future__ import annotations

import pytest
import torch

from verl_core.data import packing
from verl_core.modeling import forward, lm_head, packed_forward
from verl_core.modeling.logprobs import entropy_from_logits, selected_logprobs


def _reference(h, w, y, scale):
    z = (h @ w.t()) * scale
    return selected_logprobs(z, y), entropy_from_logits(z)


@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_fused_logprobs_entropies_and_gradients_equal_the_logits_path_across_chunks(monkeypatch, scale):
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 5 * 301)  # 5 rows per chunk: 23 rows -> 5 chunks, the last partial
    torch.manual_seed(0)
    h0, w0 = torch.randn(23, 16), torch.randn(301, 16) * 0.3
    y, g = torch.randint(0, 301, (23,)), torch.randn(23)
    results = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        lp, ent = lm_head.linear_logprobs(h, w, y, scale, with_entropy=True) if fused else _reference(h, w, y, scale)
        (lp * g).sum().backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not results[1][1].requires_grad


def test_fused_logprobs_pass_gradcheck_in_fp64():
    torch.manual_seed(0)
    h = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 6, 3, 3])
    assert torch.autograd.gradcheck(lambda h, w: lm_head.linear_logprobs(h, w, y, 0.5), (h, w))


@pytest.mark.parametrize("name", forward.FUSED_HEAD_MODELS)
def test_every_fused_model_family_gives_its_own_logits_log_probs_and_gradients(tok, pair_examples, small_lm, name):
    """Fails when a transformers release puts something between the last hidden state and the logits."""
    model = small_lm(name.removesuffix("ForCausalLM").lower(), len(tok))
    assert type(model).__name__ == name and forward.fused_head_skip_reason(model) is None
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    out = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(model.get_output_embeddings()(out.hidden_states[-1]), out.logits)
    lps, grads = [], []
    for fused in (False, True):
        model.zero_grad()
        batch = packing.collate_packed_pairs(pair_examples, tok.pad_token_id, fused_lm_head=fused)
        lp = packed_forward.model_token_logprobs(model, batch)[batch["loss_mask"].bool()]
        lp.sum().backward()
        lps.append(lp.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(lps[1], lps[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)


def test_a_head_with_a_bias_or_soft_capped_logits_is_not_fused(tiny_path):
    from verl_core.modeling.loading import load_causal_lm

    model = load_causal_lm(tiny_path)
    model.config.final_logit_softcapping = 30.0
    assert "soft-caps" in forward.fused_head_skip_reason(model)
    model.config.final_logit_softcapping = None
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size)
    assert "with a bias" in forward.fused_head_skip_reason(model)
