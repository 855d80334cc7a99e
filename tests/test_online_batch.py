"""Online RL over several processes, the parts that need no process group: per-prompt sampling
streams (a prompt's samples do not depend on the other prompts in the call, so splitting the
prompts over ranks draws the same samples) and each rank's share of a global mini-batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_core.algorithms.online_batch import gather_experience, minibatch_share, prompt_seeds
from verl_core.rollout.contract import SamplingParams
from verl_core.rollout.hf_backend import HFRolloutBackend

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def tiny(tiny_path):
    from verl_core.modeling.loading import load_causal_lm, load_tokenizer

    return load_causal_lm(tiny_path, trainable=False), load_tokenizer(tiny_path)


def test_per_prompt_seeds_draw_the_same_samples_whatever_the_other_prompts(tiny):
    from verl_core.bundled import arithmetic

    model, tok = tiny
    torch.set_num_threads(1)
    prompts = [tok(r["prompt"])["input_ids"] for r in arithmetic.prompt_rows(4)]
    backend = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id)
    params = SamplingParams(n=3, max_new_tokens=10, temperature=1.0)
    seeds = prompt_seeds(seed=5, step=2, first=0, count=4)
    whole = backend.generate(prompts, params, seed=seeds)  # one process: all 4 prompts
    halves = [backend.generate(prompts[i : i + 2], params, seed=seeds[i : i + 2]) for i in (0, 2)]  # 2 ranks
    assert whole.response_lists() == halves[0].response_lists() + halves[1].response_lists()
    split_logps = [row[m.bool()] for h in halves for row, m in zip(h.logprobs, h.response_mask)]
    whole_logps = [row[m.bool()] for row, m in zip(whole.logprobs, whole.response_mask)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole_logps, split_logps))
    assert len({tuple(r) for r in whole.response_lists()[:3]}) > 1  # a prompt's samples still differ
    with pytest.raises(ValueError, match="one seed per prompt"):
        backend.generate(prompts, params, seed=seeds[:3])


def test_each_rank_takes_its_slice_of_the_same_global_mini_batch():
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    ranks = [SimpleNamespace(num_processes=2, process_index=r) for r in (0, 1)]
    for k in range(2):
        shares = [minibatch_share(order, k, 8, acc) for acc in ranks]
        assert torch.equal(torch.cat(shares), order[k * 8 : (k + 1) * 8])
    alone = SimpleNamespace(num_processes=1, process_index=0)
    assert torch.equal(minibatch_share(order, 1, 8, alone), order[8:16])


def test_one_process_keeps_its_experience_as_it_is():
    exp = {"input_ids": torch.ones(2, 5, dtype=torch.long), "response_ids": torch.ones(2, 2, dtype=torch.long)}
    assert gather_experience(exp, SimpleNamespace(num_processes=1), pad_token_id=0) is exp
