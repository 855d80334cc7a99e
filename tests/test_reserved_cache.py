"""The reserved KV cache holds what transformers' growing cache holds, appends in place, and changes
no sampled token."""

from __future__ import annotations

import pytest
import torch

from verl_core.rollout import hf_backend
from verl_core.rollout.contract import SamplingParams
from verl_core.rollout.hf_backend import HFRolloutBackend
from verl_core.rollout.reserved_cache import reserved_cache


def _pair(b: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, n, 4, generator=g), torch.randn(b, 2, n, 4, generator=g)


@pytest.fixture()
def llama(small_lm):
    return small_lm("llama", 50).eval()


def test_updates_equal_concatenation_and_append_in_place(llama):
    from transformers.cache_utils import DynamicLayer

    ours, theirs = reserved_cache(llama, reserve=3).layers[0], DynamicLayer()
    data = None
    for step, n in enumerate([5, 1, 1, 1, 1, 2]):  # a prefill, 3 steps inside the reserve, then past it
        k, v = _pair(3, n, step)
        got, want = ours.update(k, v), theirs.update(k, v)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert ours.get_seq_length() == theirs.get_seq_length()
        if step == 1:
            data = ours._k.data_ptr()
        if step in (2, 3):  # within the reserve: written in place, no new buffer
            assert ours._k.data_ptr() == data
    assert ours._k.data_ptr() != data  # 5 + 4 positions outgrew the 5 + 3 reserved: a larger buffer, same contents
    assert ours.get_seq_length() == 11


def test_row_selection_crop_and_reorder_keep_the_buffer_consistent(llama):
    from transformers.cache_utils import DynamicLayer

    ours, theirs = reserved_cache(llama, reserve=4).layers[0], DynamicLayer()
    for layer in (ours, theirs):
        layer.update(*_pair(3, 4, 0))
        layer.batch_select_indices(torch.tensor([2, 0, 0, 1]))
        layer.update(*_pair(4, 1, 1))
        layer.crop(-1)
        layer.reorder_cache(torch.tensor([3, 2, 1, 0]))
        layer.update(*_pair(4, 2, 2))
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert ours.keys.data_ptr() == ours._k.data_ptr()  # still a view of the buffer that later steps write into


def test_models_with_other_layer_kinds_keep_their_own_cache(small_lm):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mistral",
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
    )
    assert reserved_cache(AutoModelForCausalLM.from_config(config), reserve=8) is None
    assert reserved_cache(torch.nn.Linear(2, 2), reserve=8) is None  # no config at all
    assert reserved_cache(small_lm("llama", 50), reserve=8) is not None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_backend_samples_the_same_tokens_with_either_cache(tiny_path, tok, monkeypatch, temperature):
    """Greedy and seeded sampling of the tiny model, prompts of different lengths with 2 samples each
    (the shared prefill's rows copied): the same tokens and log-probs as with transformers' cache."""
    from verl_core.modeling.loading import load_causal_lm

    model = load_causal_lm(tiny_path, trainable=False)
    prompts = [tok("12+7=")["input_ids"], tok("3+4=")["input_ids"], tok("100+23=")["input_ids"]]
    params = SamplingParams(n=2, max_new_tokens=12, temperature=temperature)

    def sample():
        return HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, params, seed=7)

    used = []
    monkeypatch.setattr(hf_backend, "reserved_cache", lambda m, r: used.append(r) or reserved_cache(m, r))
    ours = sample()
    assert used == [12]
    monkeypatch.setattr(hf_backend, "reserved_cache", lambda m, r: None)
    theirs = sample()
    assert torch.equal(ours.response_ids, theirs.response_ids)
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)


def test_greedy_completions_through_generate_are_the_same_with_either_cache(tiny_path, tok, monkeypatch):
    """Evaluation's and the judge's path (transformers' ``generate``) takes the reserved cache too."""
    from verl_core.modeling.loading import load_causal_lm
    from verl_core.rollout import greedy

    model = load_causal_lm(tiny_path, trainable=False)
    prompts = [tok("12+7=")["input_ids"], tok("3+4=")["input_ids"], tok("100+23=")["input_ids"]]
    used = []
    monkeypatch.setattr(greedy, "reserved_cache", lambda m, r: used.append(r) or reserved_cache(m, r))
    ours = greedy.greedy_completions(model, tok, prompts, max_new_tokens=10, batch_size=2)
    assert used == [10, 10]  # one cache per batch
    monkeypatch.setattr(greedy, "reserved_cache", lambda m, r: None)
    assert greedy.greedy_completions(model, tok, prompts, max_new_tokens=10, batch_size=2) == ours
