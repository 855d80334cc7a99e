"""Real chat models pad with their EOS (SmolLM2, Qwen, Llama 3 instruct: pad = eos = ``<|im_end|>``). Told apart by
position, the EOS a completion ends with is still trained, and a reward model still reads it: padded, packed and
``RewardModel.score`` read the same token. The tiny model, its pad set to its EOS, stands for them here;
tests/test_real_model.py checks the same on SmolLM2 itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from verl_core.data import collate_pairs, collate_sft, tokenize_pairs, tokenize_sft
from verl_core.modeling.loading import load_reward_model, load_tokenizer

ROWS = [
    {"prompt": "Question: What is 2 + 3?\nAnswer:", "chosen": " 5", "rejected": " 7 or maybe 6, hard to say"},
    {"prompt": "Q: 4 + 4?", "chosen": " 8", "rejected": " 9"},
]


@pytest.fixture(scope="module")
def pad_is_eos(tiny_path, tmp_path_factory):
    """The tiny model and tokenizer with pad = EOS, as a folder."""
    folder = tmp_path_factory.mktemp("pad-is-eos") / "model"
    shutil.copytree(tiny_path, folder)
    tok = load_tokenizer(folder)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["pad_token_id"] = tok.eos_token_id
    (folder / "config.json").write_text(json.dumps(config))
    assert load_tokenizer(folder).pad_token_id == load_tokenizer(folder).eos_token_id
    return folder


@pytest.mark.fast
def test_sft_trains_the_eos_that_ends_each_completion_and_nothing_after_it(pad_is_eos):
    tok = load_tokenizer(pad_is_eos)
    examples = tokenize_sft([{"prompt": r["prompt"], "completion": r["chosen"]} for r in ROWS], tok)
    batch = collate_sft(examples, tok.pad_token_id)
    for row, ex in enumerate(examples):
        n = len(ex["prompt_ids"]) + len(ex["completion_ids"])
        assert ex["completion_ids"][-1] == tok.eos_token_id
        assert batch["loss_mask"][row, n - 1] == 1 and batch["input_ids"][row, n - 1] == tok.eos_token_id
        assert batch["loss_mask"][row, n:].sum() == 0 and batch["attention_mask"][row, n:].sum() == 0  # pads: same id, no loss


@pytest.mark.fast
def test_the_reward_model_reads_the_completions_eos_padded_packed_and_when_scoring(pad_is_eos):
    from verl_core.data.packing import collate_packed_pairs
    from verl_core.modeling.packed_forward import pair_rewards
    from verl_core.rewards.model import RewardModel

    torch.manual_seed(0)
    model = load_reward_model(pad_is_eos, trainable=False)
    tok = load_tokenizer(pad_is_eos)
    examples = tokenize_pairs(ROWS, tok)
    padded = pair_rewards(model, collate_pairs(examples, tok.pad_token_id))
    packed = pair_rewards(model, collate_packed_pairs(examples, tok.pad_token_id))
    for a, b in zip(padded, packed):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    # by hand: the score head at the EOS of each unpadded sequence
    by_hand = []
    for ex in examples:
        ids = torch.tensor([ex["prompt_ids"] + ex["chosen_ids"]])
        assert ids[0, -1] == tok.eos_token_id
        hidden = model.model(input_ids=ids).last_hidden_state
        by_hand.append(model.score(hidden)[0, -1, 0])
    torch.testing.assert_close(padded[0], torch.stack(by_hand).float(), rtol=1e-4, atol=1e-5)

    scored = RewardModel(model, tok).score([r["prompt"] for r in ROWS], [r["chosen"] for r in ROWS])
    torch.testing.assert_close(scored, padded[0], rtol=1e-4, atol=1e-5)
