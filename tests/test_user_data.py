"""Users' data in their own columns: the mapping, its errors, and the GSM8K / HH-RLHF recipes
(``configs/gsm8k.yaml``, ``configs/hh-rlhf.yaml``) run on the published files with the tiny model."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from verl_core.config import ConfigError
from verl_core.data import DataError
from verl_core.data.columns import map_columns
from verl_core.pipeline import load_pipeline_config, run_stage
from verl_core.pipeline.data import load_data, prompt_rows
from verl_core.pipeline.evaluation import judge_accuracy
from verl_core.pipeline.registry import STAGE_ORDER, given_record, stage_enabled, stage_for

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "Question: {question}\nAnswer:"


def test_columns_rename_fields_and_the_template_builds_the_prompt():
    rows = [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}]
    out = map_columns(rows, {"completion": "answer"}, TEMPLATE)
    assert out[0]["prompt"] == "Question: What is 2+2?\nAnswer:" and out[0]["completion"] == "2+2=4\n#### 4"
    assert map_columns(rows) is rows  # nothing to map: the rows as they are


def test_a_missing_column_names_the_config_key_the_row_and_the_columns_it_has():
    with pytest.raises(DataError, match=r"sft\.data\.columns: row 1 has no column 'answer'.*\['question'\]"):
        map_columns([{"question": "a", "answer": "b"}, {"question": "c"}], {"completion": "answer"}, where="sft.data")
    with pytest.raises(DataError, match=r"prompt_template: row 0 has no column 'query'"):
        map_columns([{"question": "a"}], None, "Q: {query}", where="evaluation.data")


def test_columns_are_checked_in_the_config():
    with pytest.raises(ConfigError, match="columns"):
        load_pipeline_config(None, ["sft.data.columns={completion: answer}"])  # no path: the bundled task
    with pytest.raises(ConfigError, match="answr"):
        load_pipeline_config(None, ["sft.data.path=x.jsonl", "sft.data.columns={answr: answer}"])


def _run_pipeline(config) -> dict:
    """Every enabled step in order through ``run_stage`` (no Prefect, no tracking)."""
    records = {"base": given_record(config, "base")}
    for name in STAGE_ORDER:
        if not stage_enabled(config, name):
            continue
        record = given_record(config, name)
        if record is None:
            spec = stage_for(config, name)
            inputs = {i: records.get(i) for i in spec.input_names(config) + spec.optional}
            record = run_stage(config, name, inputs).record
        records[name] = record
    return records


@pytest.mark.slow
def test_gsm8k_recipe_runs_sft_then_grpo_on_the_published_columns(shared_data, tmp_path):
    gsm8k = str(shared_data / "gsm8k-test.jsonl")
    config = load_pipeline_config(
        ROOT / "configs" / "gsm8k.yaml",
        [
            f"workdir={tmp_path}",
            f"sft.data.path={gsm8k}",
            f"policy_optimisation.prompts.path={gsm8k}",
            f"evaluation.data.path={gsm8k}",
            "sft.data.limit=64",
            "sft.max_steps=3",
            "sft.batch_size=8",
            "sft.max_length=640",  # GSM8K questions run to hundreds of tiny-tokenizer tokens (row 4: 376)
            "policy_optimisation.prompts.limit=16",
            "policy_optimisation.grpo.max_prompt_length=512",
            "evaluation.max_prompt_length=512",
            "policy_optimisation.grpo.max_steps=2",
            "policy_optimisation.grpo.batch_size=8",
            "policy_optimisation.grpo.mini_batch_size=8",
            "policy_optimisation.grpo.max_new_tokens=8",
            "evaluation.num_rows=4",
            "evaluation.max_new_tokens=8",
            "evaluation.include_base=false",
        ],
    )
    records = _run_pipeline(config)
    assert records["sft"].extra["steps"] == 3 and records["policy_optimisation"].extra["steps"] == 2
    # the strict gsm8k rule scored every rollout (the tiny model earns 0: it cannot solve GSM8K)
    history = json.loads(Path(records["policy_optimisation"].extra["history"]).read_text())
    assert [v for _, v in history["reward/mean"]] == [0.0, 0.0]  # a point per step on a short run
    results = json.loads((Path(records["evaluation"].output_path) / "results.json").read_text())
    assert 0.0 <= results["metrics"]["accuracy/final"] <= 1.0
    rows = [json.loads(line) for line in open(gsm8k)][:4]
    # the evaluation table's expected answers are GSM8K's "#### <number>", read through the columns mapping
    samples = json.loads((Path(records["evaluation"].output_path) / "final_answers.json").read_text())
    assert [s["expected"] for s in samples] == [r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in rows]
    assert samples[0]["prompt"] == TEMPLATE.format(question=rows[0]["question"])[-200:]


def _short_hh_rows(shared_data: Path, tmp_path: Path, n: int) -> Path:
    """The first ``n`` HH-RLHF pairs short enough for the tiny model's 256 positions, in the published format."""
    out = tmp_path / "hh-short.jsonl"
    with gzip.open(shared_data / "hh-rlhf-harmless-base-test.jsonl.gz", "rt") as src, open(out, "w") as dst:
        kept = 0
        for line in src:
            row = json.loads(line)
            if max(len(row["chosen"]), len(row["rejected"])) < 200 and kept < n:
                dst.write(line)
                kept += 1
    return out


@pytest.mark.slow
def test_hh_rlhf_recipe_runs_sft_reward_model_then_dpo_on_implicit_prompt_pairs(shared_data, tmp_path):
    hh = str(_short_hh_rows(shared_data, tmp_path, 48))
    config = load_pipeline_config(
        ROOT / "configs" / "hh-rlhf.yaml",
        [
            f"workdir={tmp_path / 'runs'}",
            f"sft.data.path={hh}",
            f"preference_data.path={hh}",
            f"evaluation.data.path={hh}",
            "sft.max_steps=3",
            "sft.batch_size=8",
            "sft.max_length=256",
            "reward_model.max_steps=3",
            "reward_model.batch_size=8",
            "policy_optimisation.dpo.max_steps=3",
            "policy_optimisation.dpo.batch_size=8",
            "evaluation.data.limit=4",
            "evaluation.max_new_tokens=8",
            "evaluation.include_base=false",
        ],
    )
    records = _run_pipeline(config)
    assert records["preference_data"].given and records["reward_model"].extra["steps"] == 3
    assert records["policy_optimisation"].extra["steps"] == 3
    assert records["policy_optimisation"].fingerprint != records["sft"].fingerprint
    metrics = json.loads((Path(records["evaluation"].output_path) / "results.json").read_text())["metrics"]
    assert {"reward_score/sft", "reward_score/final"} <= set(metrics) and "accuracy/final" not in metrics
    # the judge's own held-out accuracy; with every pair's answers swapped it is exactly the complement
    accuracy = metrics["reward_model_accuracy/held_out"]
    assert metrics["reward_model_accuracy/pairs"] == 4
    rows = prompt_rows(load_data(config.evaluation.data, None, "evaluation.data"))
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]
    rm = records["reward_model"].output_path
    assert judge_accuracy(rm, swapped, 4)["reward_model_accuracy/held_out"] == pytest.approx(1 - accuracy)
    # chat-rendered pairs (messages, as the real-model recipe reads them) are scored as the answers' text
    chat = prompt_rows(load_data(config.evaluation.data.model_copy(update={"chat": True}), None, "evaluation.data"))
    assert isinstance(chat[0]["chosen"], list)
    judged = judge_accuracy(rm, chat, 4)["reward_model_accuracy/held_out"]
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in chat]
    assert judge_accuracy(rm, swapped, 4)["reward_model_accuracy/held_out"] == pytest.approx(1 - judged)
