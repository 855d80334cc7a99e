"""Teachers and judges in the pipeline: ``distill`` is a policy-optimisation choice like any other; a judge and
a reward service are reward sources like any other. Through the Prefect flow their metrics reach MLflow."""

from __future__ import annotations

import pytest

from verl_core.pipeline.config import load_pipeline_config

SHORT = [
    "sft.max_steps=20",
    "sft.batch_size=8",
    "sft.data.limit=64",
    "sft.mixed_precision=no",
    "policy_optimisation.prompts.limit=16",
]


@pytest.mark.fast
def test_distill_without_a_teacher_or_with_a_missing_one_fails_before_any_stage(tmp_path):
    from verl_core.config import ConfigError
    from verl_core.modeling.model_files import ModelLoadError
    from verl_core.pipeline.preflight import check_models

    base = [f"workdir={tmp_path}", "policy_optimisation.algorithm=distill"]
    with pytest.raises(ConfigError, match=r"policy_optimisation\.distill\.teacher_model: distill needs a teacher"):
        check_models(load_pipeline_config(None, base))
    missing = load_pipeline_config(None, [*base, f"policy_optimisation.distill.teacher_model={tmp_path / 'nope'}"])
    with pytest.raises(ModelLoadError, match=r"policy_optimisation\.distill\.teacher_model: "):
        check_models(missing)
    judged = load_pipeline_config(
        None, [f"workdir={tmp_path}", "policy_optimisation.algorithm=grpo", f"policy_optimisation.grpo.judge.model={tmp_path}/j"]
    )
    with pytest.raises(ModelLoadError, match=r"policy_optimisation\.grpo\.judge\.model: "):
        check_models(judged)


@pytest.mark.fast
def test_a_teacher_retrained_in_place_changes_the_stage_key(tmp_path, tiny_path):
    import shutil

    from verl_core.pipeline.keys import stage_key
    from verl_core.pipeline.registry import stage_for

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_path, teacher)
    cfg = load_pipeline_config(
        None, ["policy_optimisation.algorithm=distill", f"policy_optimisation.distill.teacher_model={teacher}"]
    )
    stage = stage_for(cfg, "policy_optimisation")
    before = stage_key(cfg, stage, {})
    (teacher / "config.json").write_text((teacher / "config.json").read_text() + " ")
    assert stage_key(cfg, stage, {}) != before


@pytest.mark.slow
def test_distillation_with_a_judge_and_a_reward_service_runs_as_a_prefect_flow_with_their_metrics_in_mlflow(
    prefect_harness, tmp_path, tiny_path
):
    from mlflow import MlflowClient

    from flows import stage_flow
    from verl_core.rewards.model import RewardSource
    from verl_core.rewards.serve import RewardHTTPServer

    service = RewardHTTPServer(RewardSource({"exact_match": 1.0}), "127.0.0.1", 0).start()
    try:
        algo = "policy_optimisation.distill"
        cfg = load_pipeline_config(
            None,
            [
                f"workdir={tmp_path}",
                f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                *SHORT,
                "policy_optimisation.algorithm=distill",
                f"{algo}.teacher_model={tiny_path}",  # the base model teaches the SFT policy: a gap to close
                f"{algo}.max_steps=3",
                f"{algo}.batch_size=8",
                f"{algo}.max_new_tokens=16",
                f"{algo}.mixed_precision=no",
                f"{algo}.judge.model={tiny_path}",
                f"{algo}.judge.yes_token=' more'",  # single tokens of the tiny vocabulary
                f"{algo}.judge.no_token=' left'",
                f"{algo}.remote.url={service.url}/score",
            ],
        )
        result = stage_flow("policy_optimisation", cfg)
    finally:
        service.close()
    assert result.states["policy_optimisation"] == "Completed"
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{result.mlflow_run_id}'")
    po = next(r for r in runs if r.data.tags["verl_core.stage"] == "policy_optimisation")
    metrics = po.data.metrics
    assert {"distill/reverse_kl", "distill/teacher_logp", "judge/mean", "judge/parse_errors", "remote/requests"} <= set(
        metrics
    ), sorted(metrics)
    assert metrics["remote/requests"] >= 1 and 0 <= metrics["judge/mean"] <= 1
    rollouts = client.search_traces(locations=[exp.experiment_id], run_id=po.info.run_id, max_results=50)
    assert rollouts and {t.info.tags["verl_core.kind"] for t in rollouts} == {"rollout"}
