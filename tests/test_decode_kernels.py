"""The CPU decode kernels (skinny-matmul layout, grouped-query attention without repeats) compute what
transformers' own paths compute, and leave the model as it was."""

from __future__ import annotations

import contextlib

import pytest
import torch

from verl_core.rollout import hf_backend
from verl_core.rollout.contract import SamplingParams
from verl_core.rollout.decode_kernels import DECODE_SDPA, cpu_decode_kernels, decode_sdpa_attention, skinny_linear_forward
from verl_core.rollout.hf_backend import HFRolloutBackend


class _Grouped(torch.nn.Module):
    num_key_value_groups = 3


def test_grouped_decode_attention_equals_repeated_kv_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    b, kv_heads, groups, s, d = 4, 2, 3, 11, 8
    q = torch.randn(b, kv_heads * groups, 1, d)
    k, v = torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    mask[0, ..., :5] = False  # left padding of different lengths
    mask[2, ..., :1] = False
    ours, _ = decode_sdpa_attention(_Grouped(), q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(_Grouped(), q, k, v, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (b, 1, kv_heads * groups, d)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    # the padded keys are really masked: changing them changes nothing
    k2 = k.clone()
    k2[0, :, :5] = 100.0
    torch.testing.assert_close(decode_sdpa_attention(_Grouped(), q, k2, v, mask, scaling=0.3)[0], ours)


def test_skinny_linear_equals_linear_and_keeps_other_shapes():
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    one_position = torch.randn(5, 1, 24)
    torch.testing.assert_close(skinny_linear_forward(layer, one_position), layer(one_position), atol=1e-6, rtol=1e-5)
    many = torch.randn(5, 3, 24)
    assert torch.equal(skinny_linear_forward(layer, many), layer(many))


def _greedy(model, prompts):
    backend = HFRolloutBackend(model, eos_token_id=0, pad_token_id=1)
    return backend.generate(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=0.0), seed=0)


def test_generation_with_the_kernels_equals_generation_without(small_lm, monkeypatch):
    model = small_lm("llama", 97).eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]  # left padding of different lengths
    fast = _greedy(model, prompts)
    monkeypatch.setattr(hf_backend, "cpu_decode_kernels", lambda model: contextlib.nullcontext(False))
    plain = _greedy(model, prompts)
    assert torch.equal(fast.response_ids, plain.response_ids)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
    sampled = [
        HFRolloutBackend(model, 0, 1).generate(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=1.0), seed=3)
        for _ in range(2)
    ]
    assert torch.equal(sampled[0].response_ids, sampled[1].response_ids)


def test_the_model_is_restored_after_the_block(small_lm):
    model = small_lm("llama", 97)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with cpu_decode_kernels(model) as active:
        assert active
        assert model.config._attn_implementation == DECODE_SDPA
        assert all("forward" in vars(m) for m in linears)
        with cpu_decode_kernels(model) as nested:  # a nested block changes nothing and undoes nothing
            assert not nested
        assert model.config._attn_implementation == DECODE_SDPA
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in linears)
    x = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        inside_logits = None
        with cpu_decode_kernels(model):
            inside_logits = model(input_ids=x).logits  # a multi-position forward takes the usual path
        torch.testing.assert_close(model(input_ids=x).logits, inside_logits, atol=0, rtol=0)


def test_a_failing_forward_still_restores_the_model(small_lm):
    model = small_lm("llama", 97)
    with pytest.raises(RuntimeError, match="boom"):
        with cpu_decode_kernels(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_hf_generate_paths_give_the_same_answers_with_the_kernels(tiny_path, tok, monkeypatch):
    """``greedy_completions`` without a backend (and the judge's sampled answers) run transformers'
    ``generate`` inside the kernels: the same greedy text as without them (the tiny model: 3 heads, 1 KV head)."""
    from verl_core.modeling.loading import load_causal_lm
    from verl_core.rollout import greedy

    model = load_causal_lm(tiny_path, trainable=False)
    prompts = [tok("12+7=")["input_ids"], tok("3+4=")["input_ids"], tok("100+23=")["input_ids"]]
    fast = greedy.greedy_completions(model, tok, prompts, max_new_tokens=8)
    monkeypatch.setattr(greedy, "cpu_decode_kernels", lambda model: contextlib.nullcontext(False))
    assert greedy.greedy_completions(model, tok, prompts, max_new_tokens=8) == fast
