"""Agentic RL as a pipeline setting: the environment picks every step's bundled data, unknown names are
refused before any stage starts, and the recipes (configs/agent.yaml, configs/gsm8k_tools.yaml) run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_core.config import ConfigError
from verl_core.pipeline import load_pipeline_config

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "sft.max_steps=3",
    "sft.data.limit=64",
    "policy_optimisation.grpo.max_steps=2",
    "policy_optimisation.grpo.batch_size=8",
    "policy_optimisation.grpo.mini_batch_size=8",
    "policy_optimisation.grpo.max_new_tokens=8",
    "evaluation.num_rows=4",
    "evaluation.max_new_tokens=8",
    "evaluation.include_base=false",
]


@pytest.mark.fast
def test_unknown_environment_or_tool_names_are_refused_by_the_config_naming_the_key():
    with pytest.raises(ConfigError, match=r"policy_optimisation\.grpo\.tools: .*unknown tool 'shell'"):
        load_pipeline_config(
            None, ["policy_optimisation.grpo.environment=calculator_arithmetic", "policy_optimisation.grpo.tools=[shell]"]
        )
    with pytest.raises(ConfigError, match=r"policy_optimisation\.ppo\.environment: .*unknown environment 'calc'"):
        load_pipeline_config(None, ["policy_optimisation.ppo.environment=calc"])


@pytest.mark.fast
def test_the_environment_selects_every_steps_bundled_data_and_so_their_cache_keys():
    from verl_core.agents import tasks
    from verl_core.pipeline.registry import stage_for

    plain = load_pipeline_config(None, ["policy_optimisation.algorithm=grpo"])
    agent = load_pipeline_config(ROOT / "configs" / "agent.yaml")
    assert agent.policy_optimisation.grpo.environment == "calculator_arithmetic"
    for step, rows in (("sft", tasks.sft_rows(3000)), ("evaluation", tasks.eval_rows(200))):
        assert stage_for(agent, step).bundled(agent) == rows
        assert stage_for(plain, step).bundled(plain) != rows
    assert stage_for(agent, "policy_optimisation").bundled(agent) == tasks.prompt_rows(256)


@pytest.mark.slow
def test_the_agent_recipe_runs_as_a_prefect_flow_tracked_in_mlflow_and_reruns_cached(prefect_harness, tmp_path):
    """configs/agent.yaml through the Prefect flow (the same tasks, cache keys, retries as any algorithm): episodes
    train, the evaluation writes trajectory tables, MLflow holds the agent metrics and the tables as artifacts of
    the stage runs, and a rerun of the same config is all cached."""
    from mlflow import MlflowClient

    from flows import rlhf_pipeline

    where = [f"workdir={tmp_path / 'work'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    config = load_pipeline_config(ROOT / "configs" / "agent.yaml", [*where, *SHORT])
    result = rlhf_pipeline(config)
    assert {result.states[s] for s in ("sft", "policy_optimisation", "evaluation")} == {"Completed"}
    records = result.records
    history = json.loads(Path(records["policy_optimisation"].extra["history"]).read_text())
    assert {"agent/turns_mean", "agent/tool_calls_per_episode", "agent/tool_errors_per_episode"} <= set(history)
    report = Path(records["evaluation"].output_path)
    metrics = json.loads((report / "results.json").read_text())["metrics"]
    assert {"accuracy/sft", "accuracy/final", "agent/turns_mean/final", "agent/tool_calls_per_episode/sft"} <= set(metrics)
    table = json.loads((report / "agent_trajectories_final.json").read_text())  # MLflow's table layout
    assert {"turns", "tool_calls", "reward", "transcript"} <= set(table["columns"]) and len(table["data"]) == 4

    client = MlflowClient(tracking_uri=config.tracking.uri)
    exp = client.get_experiment_by_name(config.tracking.experiment)
    stage_runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{result.mlflow_run_id}'")
    runs = {r.data.tags["verl_core.stage"]: r for r in stage_runs}
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    assert "agent/tool_calls_per_episode" in runs["policy_optimisation"].data.metrics
    assert "agent_trajectories_final.json" in {a.path for a in client.list_artifacts(runs["evaluation"].info.run_id)}
    evaluation = runs["evaluation"]
    traces = client.search_traces(locations=[exp.experiment_id], run_id=evaluation.info.run_id, max_results=100)
    kinds = {t.info.tags["verl_core.kind"] for t in traces}
    assert {"evaluation sft", "evaluation final"} <= kinds and all(any(s.name == "turn 1" for s in t.data.spans) for t in traces)

    again = rlhf_pipeline(config)
    assert {again.states[s] for s in ("sft", "policy_optimisation", "evaluation")} == {"Cached"}
    assert again.records["evaluation"] == records["evaluation"]


@pytest.mark.slow
def test_the_gsm8k_python_tool_recipe_runs_on_the_tiny_model(shared_data, tmp_path):
    from test_user_data import _run_pipeline

    gsm8k = str(shared_data / "gsm8k-test.jsonl")
    overrides = [f"{k}.path={gsm8k}" for k in ("sft.data", "policy_optimisation.prompts", "evaluation.data")]
    config = load_pipeline_config(
        ROOT / "configs" / "gsm8k_tools.yaml",
        [
            f"workdir={tmp_path}",
            *overrides,
            *SHORT,
            "sft.batch_size=8",
            "sft.max_length=640",
            "policy_optimisation.prompts.limit=8",
            "policy_optimisation.grpo.num_generations=4",
            "policy_optimisation.grpo.max_response_tokens=32",
        ],
    )
    assert config.policy_optimisation.grpo.environment == "python_math"
    records = _run_pipeline(config)
    assert records["policy_optimisation"].extra["steps"] == 2
    metrics = json.loads((Path(records["evaluation"].output_path) / "results.json").read_text())["metrics"]
    assert 0.0 <= metrics["accuracy/final"] <= 1.0 and "agent/turns_mean/final" in metrics


@pytest.mark.slow
@pytest.mark.exhaustive  # torchrun == in-process for online RL: tests/test_distributed_stages.py's grpo case
def test_agent_grpo_on_two_torchrun_processes_equals_the_in_process_run_with_the_same_micro_batches(tiny_path, tmp_path):
    """The policy-optimisation stage of configs/agent.yaml launched as a 2-process torchrun job: each process runs the
    episodes of its prompts (seeded per prompt, so the split changes no episode), the trainer gathers the global batch,
    and the update equals the in-process run taking the same two micro-batches (the launcher's guarantee,
    tests/test_distributed_stages.py), tools and masks included."""
    from safetensors.torch import load_file

    from verl_core.pipeline import run_stage
    from verl_core.pipeline.launch import run_stage_launched
    from verl_core.pipeline.plan import plan_stage
    from verl_core.pipeline.records import StageRecord
    from verl_core.pipeline.registry import base_model_record

    po = "policy_optimisation.grpo"
    # entropy bonus: a gradient on every policy token even where a 3-step SFT policy scores 0 everywhere
    sets = [*SHORT, f"{po}.seed_per_prompt=true", f"{po}.mixed_precision=no", f"{po}.max_steps=2", f"{po}.entropy_coef=0.01"]
    sets += ["sft.mixed_precision=no"]

    def config(name: str, *extra: str):
        where = [f"workdir={tmp_path / name}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"base_model={tiny_path}"]
        return load_pipeline_config(ROOT / "configs" / "agent.yaml", [*where, *sets, *extra])

    local_cfg = config("local", f"{po}.gradient_accumulation_steps=2")
    sft = run_stage(local_cfg, "sft", {"base": base_model_record(local_cfg)}).record
    given = StageRecord(stage="sft", output_path=sft.output_path, fingerprint=sft.fingerprint, given=True)
    local = run_stage(local_cfg, "policy_optimisation", {"sft": given}).record
    launched_cfg = config("torchrun", "launcher.kind=torchrun", "launcher.num_processes=2")
    launched = run_stage_launched(plan_stage(launched_cfg, "policy_optimisation", {"sft": given})).record
    start, a, b = (load_file(str(Path(r.output_path) / "model.safetensors")) for r in (sft, local, launched))
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"parameters differ by {worst}"
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-5  # the stage did update the policy
    for key in ("agent/tool_calls_per_episode", "agent/turns_mean", "reward/mean"):
        assert launched.metrics[key] == pytest.approx(local.metrics[key], abs=1e-6), key
