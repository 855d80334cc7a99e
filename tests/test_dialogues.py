"""Chat rendering of text rows, unusable pairs, and the held-out split by prompt (verl_core.data.dialogues),
and the pipeline's data sources reading them (chat / holdout / drop_unusable_pairs / limit)."""

import gzip
import json

import pytest

from verl_core.data.dialogues import as_chat, hh_messages, holdout_part, usable_pairs

pytestmark = pytest.mark.fast

HH = "\n\nHuman: hi there\n\nAssistant: hello!\n\nHuman: a pen prank?\n\nAssistant: no."


def test_an_hh_transcript_becomes_its_turns_and_a_waiting_prompt_drops_its_empty_answer():
    assert hh_messages(HH) == [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "a pen prank?"},
        {"role": "assistant", "content": "no."},
    ]
    assert hh_messages("\n\nHuman: q?\n\nAssistant:") == [{"role": "user", "content": "q?"}]
    assert hh_messages("What is 2 + 2?") is None
    assert hh_messages("preamble\n\nHuman: q\n\nAssistant: a") is None


def test_as_chat_wraps_plain_prompts_and_answers_and_keeps_lists():
    rows = as_chat([{"prompt": "2+2?", "completion": "4", "ground_truth": "4"}, {"prompt": [{"role": "user", "content": "x"}]}])
    assert rows[0] == {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "completion": [{"role": "assistant", "content": "4"}],
        "ground_truth": "4",
    }
    assert rows[1]["prompt"] == [{"role": "user", "content": "x"}]
    with pytest.raises(Exception, match=r"where: row 0 field 'prompt' is int"):
        as_chat([{"prompt": 3}], where="where")


def test_unusable_pairs_are_named_and_the_rest_kept():
    rows = as_chat(
        [
            {"chosen": HH, "rejected": HH.replace("no.", "sure, here is one")},
            {"chosen": "\n\nHuman: q\n\nAssistant: ", "rejected": "\n\nHuman: q\n\nAssistant: a"},  # empty chosen
            {"prompt": "p", "chosen": "same", "rejected": "same"},
            {"prompt": "not a pair"},
        ]
    )
    kept, dropped = usable_pairs(rows)
    assert dropped == [1, 2] and [r.get("prompt") for r in kept][1] == [{"role": "user", "content": "not a pair"}]


def test_the_holdout_split_is_deterministic_disjoint_by_prompt_and_covers_every_row():
    rows = [{"prompt": f"q{i % 50}", "ground_truth": str(i)} for i in range(400)]  # each prompt 8 times
    train, held = holdout_part(rows, 0.25, "train"), holdout_part(rows, 0.25, "held_out")
    assert len(train) + len(held) == 400 and 0.1 < len(held) / 400 < 0.4
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert holdout_part(list(reversed(rows)), 0.25, "held_out") == list(reversed(held))  # order-free membership
    assert holdout_part(rows, 0.25, "held_out", seed=1) != held
    with pytest.raises(ValueError, match="fraction"):
        holdout_part(rows, 1.0, "train")


def _hh_file(tmp_path, n=60):
    path = tmp_path / "hh.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(n):
            prompt = f"\n\nHuman: question {i}?\n\nAssistant:"
            chosen = prompt + (" " if i == 7 else f" a kind answer {i}")  # row 7: an empty chosen answer
            f.write(json.dumps({"chosen": chosen, "rejected": prompt + f" a rude answer {i}"}) + "\n")
    return path


def test_the_pipelines_train_and_held_out_sources_never_share_a_prompt_and_the_given_pairs_key_follows_the_part(tmp_path):
    from verl_core.pipeline.config import load_pipeline_config
    from verl_core.pipeline.data import load_data, preference_rows_of, prompt_rows
    from verl_core.pipeline.registry import given_record

    path = str(_hh_file(tmp_path))
    part = {"fraction": 0.3, "part": "train"}
    cfg = load_pipeline_config(
        None,
        {
            "preference_data": {"path": path, "chat": True, "holdout": part, "drop_unusable_pairs": True, "limit": 20},
            "evaluation": {
                "data": {"path": path, "chat": True, "holdout": {**part, "part": "held_out"}, "drop_unusable_pairs": True}
            },
        },
    )
    pairs = prompt_rows(preference_rows_of(given_record(cfg, "preference_data"), cfg.preference_data))
    held = prompt_rows(load_data(cfg.evaluation.data, None, "evaluation.data"))
    assert len(pairs) == 20 and held and all(isinstance(r["prompt"], list) for r in pairs + held)
    assert not {json.dumps(r["prompt"]) for r in pairs} & {json.dumps(r["prompt"]) for r in held}
    texts = [m["content"] for r in pairs + held for m in r["prompt"]]
    assert "question 7?" not in texts  # the unusable pair is gone from both parts

    other = load_pipeline_config(None, {"preference_data": {"path": path, "chat": True, "holdout": {**part, "part": "held_out"}}})
    assert given_record(other, "preference_data").fingerprint != given_record(cfg, "preference_data").fingerprint

    strict = load_pipeline_config(None, {"preference_data": {"path": path}})
    from verl_core.data import DataError, tokenize_pairs

    with pytest.raises(DataError, match="row 7: field 'chosen' has nothing after the shared prompt"):
        tokenize_pairs(preference_rows_of(given_record(strict, "preference_data"), strict.preference_data), _Tok())


class _Tok:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1] * len(text.split())}


def test_holdout_needs_a_path():
    from verl_core.config import ConfigError
    from verl_core.pipeline.config import load_pipeline_config

    with pytest.raises((ConfigError, ValueError), match="holdout apply to your data"):
        load_pipeline_config(None, {"evaluation": {"data": {"holdout": {"fraction": 0.2, "part": "train"}}}})
