"""Every policy-optimisation algorithm and sample-and-score preference data as pipeline stages
(without Prefect): each trains from the SFT record into its stage folder and hands on a model."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_core.algorithms.registry import ALGORITHMS
from verl_core.data.fingerprint import fingerprint_path
from verl_core.modeling.loading import load_causal_lm
from verl_core.pipeline import StageRecord, load_pipeline_config, run_stage
from verl_core.pipeline.runner import run_all_rounds


def record(stage: str, path: Path) -> StageRecord:
    return StageRecord(stage=stage, output_path=str(path), fingerprint=fingerprint_path(path))


@pytest.fixture(scope="module")
def pairs_record(tmp_path_factory) -> StageRecord:
    cfg = load_pipeline_config(None, [f"workdir={tmp_path_factory.mktemp('pairs')}", "preference_data.num_prompts=16"])
    return run_stage(cfg, "preference_data", {}).record


def tiny_run(tmp: Path, algorithm: str) -> list[str]:
    common = ["max_steps=2", "progress=false", "save_steps=1"]
    kind = ALGORITHMS[algorithm].kind
    sizes = {
        "offline": ["batch_size=4"],
        # 16 samples: with 8, both groups of the 2 steps could all score 0 (no advantage, no update)
        "online": ["batch_size=16", "max_new_tokens=24", "mini_batch_size=8"],
        "rounds": ["batch_size=4", "rounds=2", "prompts_per_round=16"],
    }[kind]
    needs = {"distill": ["teacher_model=bundled:tiny"]}.get(algorithm, [])  # the base model teaches the SFT policy
    return [
        f"workdir={tmp}",
        f"policy_optimisation.algorithm={algorithm}",
        "policy_optimisation.prompts.limit=16",
        *(f"policy_optimisation.{algorithm}.{kv}" for kv in common + sizes + needs),
    ]


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))  # the registry: a new algorithm is tested here by itself
def test_each_registered_algorithm_runs_as_the_policy_stage_and_changes_the_sft_weights(
    algorithm, sft_path, pairs_record, tmp_path
):
    cfg = load_pipeline_config(None, tiny_run(tmp_path, algorithm))
    sft = record("sft", sft_path)
    result = run_all_rounds(cfg, "policy_optimisation", {"sft": sft, "preference_data": pairs_record})
    rec = result.record
    assert rec.stage == "policy_optimisation" and rec.variant == algorithm
    assert rec.round == (2 if ALGORITHMS[algorithm].kind == "rounds" else None)
    assert rec.extra["steps"] == 2 and not (Path(rec.output_path).parent / "checkpoints").exists()
    assert rec.fingerprint != sft.fingerprint
    before = dict(load_causal_lm(sft_path, trainable=False).named_parameters())
    after = dict(load_causal_lm(rec.output_path, trainable=False).named_parameters())
    assert any(not after[k].equal(before[k]) for k in before), "training did not change the policy"
    assert run_all_rounds(cfg, "policy_optimisation", {"sft": sft, "preference_data": pairs_record}).reused


def test_rounds_are_separate_stage_runs_keyed_on_the_previous_round(sft_path, tmp_path):
    from verl_core.config import ConfigError

    cfg = load_pipeline_config(None, tiny_run(tmp_path, "rft"))
    sft = record("sft", sft_path)
    with pytest.raises(ConfigError, match="runs in rounds"):
        run_stage(cfg, "policy_optimisation", {"sft": sft})
    first = run_stage(cfg, "policy_optimisation", {"sft": sft}, round=1).record
    with pytest.raises(ConfigError, match="needs the record of round 1"):
        run_stage(cfg, "policy_optimisation", {"sft": sft}, round=2)
    second = run_stage(cfg, "policy_optimisation", {"sft": sft, "previous_round": first}, round=2).record
    assert first.round == 1 and second.round == 2 and first.cache_key != second.cache_key
    assert Path(first.output_path).parent != Path(second.output_path).parent
    assert second.fingerprint != first.fingerprint  # round 2 trained on from round 1's policy


def test_online_stage_with_use_reward_model_requires_the_reward_model_record(tiny_path, tmp_path):
    from verl_core.config import ConfigError

    cfg = load_pipeline_config(None, tiny_run(tmp_path, "grpo") + ["policy_optimisation.use_reward_model=true"])
    with pytest.raises(ConfigError, match="reward_model"):
        run_stage(cfg, "policy_optimisation", {"sft": record("sft", tiny_path)})


def test_sample_and_score_stage_pairs_correct_over_wrong_answers_of_the_sft_policy(sft_path, tmp_path):
    cfg = load_pipeline_config(
        None,
        [
            f"workdir={tmp_path}",
            "preference_data.method=sample_and_score",
            "preference_data.num_prompts=32",
            "preference_data.sample_and_score.n_samples=4",
        ],
    )
    result = run_stage(cfg, "preference_data", {"sft": record("sft", sft_path)})
    from verl_core.pipeline.data import preference_rows_of

    pairs = preference_rows_of(result.record)
    assert result.record.variant == "sample_and_score" and result.record.metrics["pairs"] == len(pairs) > 0
    gt = {r["prompt"]: r["ground_truth"] for r in pairs}
    assert all(r["chosen_score"] > r["rejected_score"] for r in pairs)
    assert all(r["chosen"].strip().endswith(gt[r["prompt"]]) for r in pairs), "chosen must be the correct answer"
