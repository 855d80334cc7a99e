"""What a pipeline run looks like in MLflow and what a deployment stores: fast checks without servers."""

from __future__ import annotations

import time

from verl_core.pipeline import PipelineConfig, StageRecord, load_pipeline_config
from verl_core.pipeline.keys import section_for_key
from verl_core.pipeline.run_summary import comparison_lines, headline_metrics, key_params, pipeline_run_name, prefect_flow_run_url
from verl_core.train.precision import resolve_mixed_precision


def test_parent_run_name_says_pipeline_algorithm_and_time():
    cfg = load_pipeline_config(None, ["policy_optimisation.algorithm=grpo"])
    now = time.mktime((2026, 12, 3, 8, 10, 0, 0, 0, -1))
    assert pipeline_run_name(cfg, "rlhf-pipeline", now) == "rlhf/grpo 2026-12-03 08:10"
    assert pipeline_run_name(cfg, "stage-sft", now) == "rlhf/grpo stage-sft 2026-12-03 08:10"


def test_key_params_are_a_short_comparable_set():
    ppo, dpo = key_params(PipelineConfig()), key_params(load_pipeline_config(None, ["policy_optimisation.algorithm=dpo"]))
    assert ppo.keys() == dpo.keys() and len(ppo) <= 15
    assert ppo["algorithm"] == "ppo" and ppo["policy.max_steps"] == "40" and ppo["sft.max_steps"] == "900"
    assert dpo["policy.data"] == "preference pairs" and ppo["policy.data"] == "bundled:arithmetic/prompts"


def test_headline_metrics_come_from_the_stage_records():
    evaluation = StageRecord(
        stage="evaluation", output_path="/x", fingerprint="f", metrics={"accuracy/sft": 0.5, "accuracy/final": 0.6, "x": 1.0}
    )
    rm = StageRecord(stage="reward_model", output_path="/y", fingerprint="g", metrics={"eval/accuracy": 0.9, "loss": 0.3})
    assert headline_metrics({"evaluation": evaluation, "reward_model": rm, "sft": None}) == {
        "accuracy/sft": 0.5,
        "accuracy/final": 0.6,
        "reward_model/eval_accuracy": 0.9,
    }


def test_comparisons_read_as_sentences_with_the_interval_and_only_when_measured():
    hh = {
        "win_rate/final_vs_base": 0.59,
        "win_rate/ci95_low": 0.522,
        "win_rate/ci95_high": 0.658,
        "win_rate/prompts": 200.0,
        "reward_model_accuracy/held_out": 0.61,
        "reward_model_accuracy/pairs": 100.0,
        "implicit_reward_accuracy/final": 0.63,
    }
    assert comparison_lines(hh) == [
        "win rate of the final policy over the base model (reward model, 200 prompts): 0.590 (95% interval 0.522-0.658)",
        "the reward model's own accuracy on 100 held-out pairs: 0.610",
        "held-out implicit-reward accuracy of the final policy: 0.630",
    ]
    assert comparison_lines({"accuracy/final": 0.6, "accuracy_gain": 0.1}) == [
        "accuracy gain of the final policy over the SFT policy: +0.100"
    ]
    assert comparison_lines({"accuracy/final": 0.6}) == []


def test_prefect_link_only_with_a_server(monkeypatch):
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert prefect_flow_run_url("abc") is None
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert prefect_flow_run_url("abc") == "http://127.0.0.1:4200/runs/flow-run/abc"


def test_the_pipeline_config_keeps_auto_and_the_cache_key_resolves_it():
    cfg = PipelineConfig()
    dumped = cfg.model_dump(mode="json")  # what a Prefect deployment stores as the parameter's default
    assert dumped["sft"]["mixed_precision"] == "auto" and dumped["policy_optimisation"]["ppo"]["mixed_precision"] == "auto"
    assert section_for_key(cfg, "sft")["mixed_precision"] == resolve_mixed_precision("auto")
    from verl_core.algorithms.sft import SFTConfig

    assert SFTConfig(mixed_precision="auto").mixed_precision == resolve_mixed_precision("auto")  # trainers resolve


def test_the_flow_parameter_schema_default_keeps_auto():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import rlhf_pipeline

    schema = parameter_schema(rlhf_pipeline.fn).model_dump()
    assert schema["properties"]["config"]["default"]["sft"]["mixed_precision"] == "auto"
