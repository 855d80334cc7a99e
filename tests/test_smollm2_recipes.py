"""The two real-model recipes (configs/smollm2-hh.yaml, configs/smollm2-math.yaml) read what they claim: the
bundled real model, chat-rendered rows, held-out prompts disjoint from the training prompts and at least 200
of them. Their end-to-end runs (about 21 and 30-71 minutes here) are recorded in bench/RESULTS.md."""

import json
from pathlib import Path

import pytest

from verl_core.pipeline.config import load_pipeline_config
from verl_core.pipeline.data import load_data, preference_rows_of, prompt_rows
from verl_core.pipeline.evaluation import _bundled as evaluation_rows
from verl_core.pipeline.policy_optimisation import _prompts as online_prompts
from verl_core.pipeline.registry import given_record

pytestmark = pytest.mark.fast
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"


def _prompts(rows):
    return {json.dumps(r["prompt"], sort_keys=True) for r in rows}


@pytest.mark.skipif(not DATA.is_file(), reason="needs ../shared/data")
def test_the_hh_recipe_trains_and_evaluates_on_disjoint_chat_rendered_dialogues(monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)  # the recipe's data path is relative to the repository
    cfg = load_pipeline_config(CONFIGS / "smollm2-hh.yaml")
    assert cfg.base_model == cfg.sft.model_path == "bundled:smollm2"
    pairs = prompt_rows(preference_rows_of(given_record(cfg, "preference_data"), cfg.preference_data))
    held = prompt_rows(load_data(cfg.evaluation.data, None, "evaluation.data"))[: cfg.evaluation.num_rows]
    assert len(pairs) == cfg.preference_data.limit == 800 and len(held) == cfg.evaluation.num_rows >= 200
    assert all(isinstance(r["prompt"], list) and r["prompt"][-1]["role"] == "user" for r in pairs + held)
    assert not _prompts(pairs) & _prompts(held)
    assert cfg.evaluation.reward is None and cfg.reward_model.enabled and cfg.evaluation.implicit_reward_rows >= 100


def test_the_math_recipe_asks_the_bundled_problems_through_the_chat_template_and_holds_200_out():
    cfg = load_pipeline_config(CONFIGS / "smollm2-math.yaml")
    assert cfg.base_model == "bundled:smollm2" and cfg.policy_optimisation.algorithm == "grpo"
    train, held = online_prompts(cfg), evaluation_rows(cfg)
    assert len(held) == 200 and len(train) == cfg.policy_optimisation.prompts.limit
    assert all(r["prompt"] == [{"role": "user", "content": r["prompt"][0]["content"]}] for r in train + held)
    assert not _prompts(train) & _prompts(held)
    assert cfg.evaluation.reward == "numeric_match" and cfg.policy_optimisation.grpo.reward_rules == {"numeric_match": 1.0}
