"""Loading, validation and tokenization of every row format, on the tiny tokenizer and real data."""

from __future__ import annotations

import gzip
import json
import os

import datasets
import pytest

from verl_core.data import (
    DataError,
    collate_pairs,
    collate_sft,
    load_rows,
    tokenize_pairs,
    tokenize_prompts,
    tokenize_sft,
    tokenize_unpaired,
)
from verl_core.data.formats import split_implicit_prompt
from verl_core.modeling.loading import load_tokenizer

ROWS = [
    {"prompt": "Question: 1 + 2?\nAnswer:", "completion": " 3\n#### 3"},
    {"prompt": "Question: 2 + 2?\nAnswer:", "completion": " 4\n#### 4"},
]


@pytest.fixture(scope="module")
def tok(tiny_path):
    return load_tokenizer(tiny_path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "disk", "list", "dataset"])
def test_every_source_loads_the_same_rows(kind, tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    source = {
        "jsonl": lambda: ds.to_json(tmp_path / "d.jsonl") and tmp_path / "d.jsonl",
        "json": lambda: (tmp_path / "d.json").write_text(json.dumps(ROWS)) and tmp_path / "d.json",
        "parquet": lambda: ds.to_parquet(tmp_path / "d.parquet") and tmp_path / "d.parquet",
        "csv": lambda: ds.to_csv(tmp_path / "d.csv", index=False) and tmp_path / "d.csv",
        "disk": lambda: ds.save_to_disk(tmp_path / "d") or tmp_path / "d",
        "list": lambda: ROWS,
        "dataset": lambda: ds,
    }[kind]()
    assert list(load_rows(source)) == ROWS


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="empty"):
        load_rows([])
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="unknown file type"):
        load_rows(tmp_path / "x.txt")
    with pytest.raises(DataError, match="row 1: expected a dict"):
        load_rows([{"a": 1}, "oops"])
    with pytest.raises(DataError, match="does not exist: someone/some-dataset .*hf://"):
        load_rows("someone/some-dataset")  # a bare org/name is a local path unless hub ids are allowed
    with pytest.raises(DataError, match="hub downloads are off"):
        load_rows("hf://someone/some-dataset")


def test_sft_masks_only_completion_tokens(tok):
    ex = tokenize_sft(ROWS, tok)
    batch = collate_sft(ex, tok.pad_token_id)
    for i, e in enumerate(ex):
        n_p, n_c = len(e["prompt_ids"]), len(e["completion_ids"])
        assert batch["loss_mask"][i, :n_p].sum() == 0
        assert batch["loss_mask"][i, n_p : n_p + n_c].sum() == n_c
        assert batch["loss_mask"][i, n_p + n_c :].sum() == 0
        assert e["completion_ids"][-1] == tok.eos_token_id
    assert tok.decode(ex[0]["completion_ids"], skip_special_tokens=True) == ROWS[0]["completion"]


def test_sft_text_and_conversational_rows(tok):
    text = tokenize_sft([{"text": "hello there"}], tok)[0]
    assert text["prompt_ids"] == [] and text["completion_ids"][-1] == tok.eos_token_id
    conv = tokenize_sft([{"messages": [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "3"}]}], tok)[0]
    assert tok.decode(conv["prompt_ids"]) == "<|user|>\n1 + 2?<|end|>\n<|assistant|>\n"
    assert tok.decode(conv["completion_ids"]) == "3<|end|>"  # the template's newline after EOS is never sampled
    pc = tokenize_sft(
        [{"prompt": [{"role": "user", "content": "1 + 2?"}], "completion": [{"role": "assistant", "content": "3"}]}], tok
    )[0]
    assert pc == conv


def test_a_conversation_keeps_every_turns_eos_and_ends_at_its_last(tok):
    dialogue = [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": "Let me think."},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "3"},
    ]
    conv = tokenize_sft([{"prompt": dialogue[:1], "completion": dialogue[1:]}], tok)[0]
    assert tok.decode(conv["completion_ids"]) == "Let me think.<|end|>\n<|user|>\nAnd?<|end|>\n<|assistant|>\n3<|end|>"


def test_a_conversation_without_a_chat_template_names_the_row_and_what_to_do(tok, tmp_path):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 2
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"chat\.jsonl.*row 0.*needs a tokenizer with a chat_template.*has none: give text rows"):
        tokenize_sft(str(path), plain)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "q"}, "row 0: missing field 'completion'"),
        ({"prompt": "q", "completion": 3}, "row 0: field 'completion' must be a string or a list of messages, got int"),
        ({"prompt": "q", "completion": "   "}, "row 0: field 'completion' is empty"),
        ({"question": "q"}, "needs 'text', 'prompt'\\+'completion' or 'messages'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "must end with an assistant message"),
        ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}, "both be strings or both be message lists"),
    ],
)
def test_malformed_sft_rows_raise_naming_row_and_field(tok, row, message):
    with pytest.raises(DataError, match=message):
        tokenize_sft([row], tok)


def test_long_prompt_raises_or_is_dropped(tok):
    rows = [{"prompt": "Question: " + "1 + " * 60 + "1?", "completion": " 61"}, ROWS[0]]
    with pytest.raises(DataError, match="row 0: prompt is \\d+ tokens, longer than max_prompt_length 31"):
        tokenize_sft(rows, tok, max_length=32)
    kept = tokenize_sft(rows, tok, max_length=32, on_long_prompt="drop")
    assert len(kept) == 1


def test_completion_is_truncated_to_max_length(tok):
    ex = tokenize_sft([{"prompt": "Q:", "completion": " 1 2 3 4 5 6 7 8 9 1 2 3 4 5 6 7 8 9"}], tok, max_length=10)[0]
    assert len(ex["prompt_ids"]) + len(ex["completion_ids"]) == 10


def test_preference_rows_and_identical_pair(tok):
    ex = tokenize_pairs([{"prompt": "Q:", "chosen": " 3", "rejected": " 4"}], tok)
    batch = collate_pairs(ex, tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 2
    with pytest.raises(DataError, match="row 0: 'chosen' and 'rejected' are identical"):
        tokenize_pairs([{"prompt": "Q:", "chosen": " 3", "rejected": " 3"}], tok)
    with pytest.raises(DataError, match="row 0: missing field 'rejected'"):
        tokenize_pairs([{"prompt": "Q:", "chosen": " 3"}], tok)


def test_hh_rlhf_implicit_prompt_split_on_real_data(tok, shared_data):
    with gzip.open(shared_data / "hh-rlhf-harmless-base-test.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(200), f)]
    usable = []
    for i, row in enumerate(rows):
        try:
            prompt, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"], i)
        except DataError as err:  # the real data has a few empty replies (e.g. row 86)
            assert "has nothing after the shared prompt" in str(err)
            assert min(len(row["chosen"].rstrip()), len(row["rejected"].rstrip())) == len(
                os.path.commonprefix([row["chosen"], row["rejected"]]).rstrip()
            )
            continue
        assert prompt.startswith("\n\nHuman:") and prompt.endswith("\n\nAssistant:")
        assert prompt + chosen == row["chosen"] and prompt + rejected == row["rejected"]
        usable.append(row)
    ex = tokenize_pairs(usable, tok, max_length=1024, on_long_prompt="drop")
    assert len(ex) > 150
    assert all(e["chosen_ids"] != e["rejected_ids"] for e in ex)


def test_gsm8k_rows_become_prompts_with_ground_truth(tok, shared_data):
    from verl_core.rewards.rules import extract_gsm8k_answer

    rows = [json.loads(line) for line in (shared_data / "gsm8k-test.jsonl").read_text().splitlines()[:50]]
    prompts = tokenize_prompts(
        [{"prompt": r["question"], "ground_truth": extract_gsm8k_answer(r["answer"])} for r in rows], tok, max_prompt_length=512
    )
    assert len(prompts) == 50 and all(p["ground_truth"] for p in prompts)


def test_unpaired_rows_labels_and_conversion(tok):
    ex = tokenize_unpaired([{"prompt": "Q:", "chosen": " 3", "rejected": " 4"}], tok)
    assert [e["label"] for e in ex] == [True, False]
    with pytest.raises(DataError, match="row 0: missing field 'label'"):
        tokenize_unpaired([{"prompt": "Q:", "completion": " 3"}], tok)
    with pytest.raises(DataError, match="field 'label' must be true or false"):
        tokenize_unpaired([{"prompt": "Q:", "completion": " 3", "label": "yes"}], tok)


def test_csv_keeps_text_as_text_and_reads_labels_as_booleans(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('prompt,completion,label\n"Q: 1+1=",2,true\n"Q: say ""hi""",007,FALSE\n')
    rows = load_rows(str(path)).to_list()
    assert rows == [
        {"prompt": "Q: 1+1=", "completion": "2", "label": True},
        {"prompt": 'Q: say "hi"', "completion": "007", "label": False},
    ]


@pytest.mark.slow
def test_a_row_longer_than_the_models_context_window_is_named_before_training(tiny_path, tmp_path):
    import shutil

    from verl_core.algorithms.grpo import GRPOTrainer
    from verl_core.algorithms.sft import SFTTrainer

    short = tmp_path / "short-context"
    shutil.copytree(tiny_path, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (short / "config.json").write_text(json.dumps(config))
    rows = [{"prompt": "Question: 1 + 2?\nAnswer:", "completion": " 3"}, {"prompt": "Q: " + "very " * 40, "completion": " 4"}]
    with pytest.raises(DataError, match=r"row 1: \d+ tokens, longer than the context window of .*short-context \(32 tokens"):
        SFTTrainer(str(short), train_dataset=rows, batch_size=2, max_steps=1)
    prompts = [{"prompt": "Question: 1 + 2?\nAnswer:", "ground_truth": "3"}] * 2
    with pytest.raises(DataError, match=r"row 0: \d+ tokens \+ 24 to generate, longer than the context window"):
        GRPOTrainer(str(short), prompts=prompts, batch_size=4, num_generations=2, max_new_tokens=24, max_steps=1)
