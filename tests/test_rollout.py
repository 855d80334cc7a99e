"""Rollout: EOS stop and masks, n-sample grouping, seeded reproducibility, exact log-probs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_core.rollout.contract import RolloutBackend, SamplingParams, position_ids_from_mask
from verl_core.rollout.hf_backend import HFRolloutBackend, _sample, filter_logits

EOS, PAD, VOCAB = 5, 0, 16


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset


class CountingLM(torch.nn.Module):
    """A scripted causal LM: the next token is (last token + 1) mod VOCAB with a huge margin."""

    def __init__(self):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True):
        nxt = (input_ids + 1) % VOCAB
        logits = torch.nn.functional.one_hot(nxt, VOCAB).float() * 100.0 + self.dummy
        return SimpleNamespace(logits=logits, get=lambda key: "cache")


def test_filter_logits_keeps_top_k_and_the_top_p_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is the first two tokens
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.4)).tolist() == [[False, True, True, True]]


@pytest.mark.parametrize("per_row_streams", [False, True])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.7)])
def test_sampled_tokens_follow_the_tempered_truncated_distribution(temperature, top_k, top_p, per_row_streams):
    """Token frequencies over 40k draws match softmax(logits / T) renormalised over the kept tokens
    (top-k / top-p), never a dropped token; the log-prob is the untruncated tempered one."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])).expand(40_000, 5).clone()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    gen = [torch.Generator().manual_seed(i) for i in range(len(logits))] if per_row_streams else torch.Generator().manual_seed(0)
    token, logp = _sample(logits, params, gen)
    tempered = torch.softmax(logits[0] / temperature, -1)
    kept = tempered * ~torch.isinf(filter_logits((logits[0] / temperature)[None], top_k, top_p))[0]
    expected = kept / kept.sum()
    freq = torch.bincount(token, minlength=5).double() / len(token)
    assert freq[expected == 0].sum() == 0 and token.max() < 4  # the zero-probability token is never drawn
    assert torch.allclose(freq, expected.double(), atol=0.01), (freq, expected)
    assert torch.allclose(logp, torch.log(tempered)[token], atol=1e-5)


def test_stops_at_eos_and_masks_up_to_and_including_it():
    backend = HFRolloutBackend(CountingLM(), eos_token_id=EOS, pad_token_id=PAD)
    out = backend.generate([[1, 2, 3], [9]], SamplingParams(max_new_tokens=4), seed=0)
    assert isinstance(backend, RolloutBackend)
    # row 0 continues 4, 5=EOS and stops; row 1 runs 10..13 and is cut by max_new_tokens
    assert out.response_ids.tolist() == [[4, 5, PAD, PAD], [10, 11, 12, 13]]
    assert out.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert out.finished.tolist() == [True, False]
    assert out.prompt_ids.tolist() == [[1, 2, 3], [PAD, PAD, 9]]
    assert out.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert out.response_lists() == [[4, 5], [10, 11, 12, 13]]
    assert torch.allclose(out.logprobs, torch.zeros_like(out.logprobs), atol=1e-6)


def test_generation_ends_early_when_every_row_has_stopped():
    backend = HFRolloutBackend(CountingLM(), eos_token_id=EOS, pad_token_id=PAD)
    out = backend.generate([[3], [2]], SamplingParams(max_new_tokens=10), seed=0)
    assert out.response_ids.tolist() == [[4, 5, PAD], [3, 4, 5]]
    assert out.finished.all()


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


@pytest.fixture(scope="module")
def tiny(tiny_path):
    from verl_core.modeling.loading import load_causal_lm, load_tokenizer

    torch.manual_seed(0)
    return load_causal_lm(tiny_path, trainable=False), load_tokenizer(tiny_path)


def _prompts(tok, n=3):
    from verl_core.bundled import arithmetic

    return [tok(r["prompt"])["input_ids"] for r in arithmetic.prompt_rows(n)]


def test_n_samples_per_prompt_are_grouped_and_keep_their_prompt(tiny):
    model, tok = tiny
    prompts = [p[:k] for p, k in zip(_prompts(tok), (20, 12, 16))]  # different lengths -> left padding
    out = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(
        prompts, SamplingParams(n=4, max_new_tokens=6), seed=1
    )
    assert len(out) == 12
    assert out.group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert out.prompt_lists() == [p for p in prompts for _ in range(4)]
    assert len({tuple(r) for r in out.response_lists()[:4]}) > 1  # the samples of one prompt differ


def test_same_seed_same_samples_other_seed_other_samples(tiny):
    model, tok = tiny
    backend = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id)
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50)
    a, b, c = (backend.generate(_prompts(tok), params, seed=s) for s in (7, 7, 8))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_fresh_forward_pass(tiny, temperature):
    from verl_core.modeling.logprobs import selected_logprobs

    model, tok = tiny
    prompts = [p[:k] for p, k in zip(_prompts(tok), (20, 11, 16))]
    out = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(
        prompts, SamplingParams(n=2, max_new_tokens=10, temperature=temperature), seed=3
    )
    with torch.no_grad():
        logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask, position_ids=out.position_ids).logits
    p = out.prompt_ids.shape[1]
    fresh = selected_logprobs(logits[:, p - 1 : -1] / temperature, out.response_ids)
    mask = out.response_mask.bool()
    assert (fresh - out.logprobs)[mask].abs().max() < 1e-4
    assert (out.logprobs[~mask] == 0).all()


def test_greedy_matches_hf_generate_and_does_not_depend_on_chunking(tiny):
    from verl_core.rollout.contract import decode_responses
    from verl_core.rollout.greedy import greedy_completions

    model, tok = tiny
    prompts = [p[:k] for p, k in zip(_prompts(tok, 5), (20, 11, 16, 9, 18))]
    backend = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id)
    whole = backend.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8), seed=0)
    chunked = backend.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, batch_size=2), seed=0)
    assert whole.response_lists() == chunked.response_lists()
    assert decode_responses(tok, whole) == greedy_completions(model, tok, prompts, max_new_tokens=8)
    # batches of 2 are taken in prompt-length order (9, 11 | 16, 18 | 20): the answers still come back by row
    assert greedy_completions(model, tok, prompts, max_new_tokens=8, batch_size=2) == decode_responses(tok, whole)


def test_greedy_restores_training_mode_when_generate_raises(tiny, monkeypatch):
    from verl_core.rollout.greedy import greedy_completions

    model, tok = tiny
    model.train()

    def fail(**_kwargs):
        raise RuntimeError("generate failed")

    monkeypatch.setattr(model, "generate", fail)
    with pytest.raises(RuntimeError, match="generate failed"):
        greedy_completions(model, tok, _prompts(tok, 2), max_new_tokens=4)
    assert model.training


def test_each_distinct_prompt_is_prefilled_once_and_split_groups_still_match(tiny):
    model, tok = tiny
    prompts = [p[:k] for p, k in zip(_prompts(tok), (20, 11, 16))]
    calls = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, inputs, _out: calls.append(tuple(inputs[0].shape)))
    backend = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id)
    try:
        whole = backend.generate(prompts, SamplingParams(temperature=0, n=4, max_new_tokens=5), seed=0)
        prefill_rows = calls[0][0]
        calls.clear()
        split = backend.generate(prompts, SamplingParams(temperature=0, n=4, max_new_tokens=5, batch_size=6), seed=0)
    finally:
        hook.remove()
    assert prefill_rows == 3  # not 12
    assert [c[0] for c in calls if c[1] > 1] == [2, 2]  # chunks of 6 rows: prompts {0, 1} and {1, 2}
    assert split.response_lists() == whole.response_lists()
