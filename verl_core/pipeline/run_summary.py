"""What one pipeline run looks like in MLflow's runs table: its name, a short set of key params
and the headline metrics, so that two runs compare side by side in one table.

The full resolved config is the parent run's ``config.yaml`` artifact; only the settings people
compare runs by are params. Headline metrics keep the evaluation stage's names (``accuracy/sft``,
``accuracy/final``, ``accuracy_gain``, ``reward_score/final``) so that the parent and the
evaluation run chart the same series.
"""

from __future__ import annotations

import os
import time

from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.data import data_label
from verl_core.pipeline.records import StageRecord

PIPELINE_FLOW = "rlhf-pipeline"
# metrics of a stage's record that the parent run repeats, as (stage, metric) -> parent name
HEADLINE = {
    ("evaluation", "accuracy/base"): "accuracy/base",
    ("evaluation", "accuracy/sft"): "accuracy/sft",
    ("evaluation", "accuracy/final"): "accuracy/final",
    ("evaluation", "accuracy_gain"): "accuracy_gain",
    ("evaluation", "reward_score/sft"): "reward_score/sft",
    ("evaluation", "reward_score/final"): "reward_score/final",
    ("evaluation", "win_rate/final_vs_base"): "win_rate/final_vs_base",
    ("evaluation", "implicit_reward_accuracy/final"): "implicit_reward_accuracy/final",
    ("evaluation", "reward_model_accuracy/held_out"): "reward_model_accuracy/held_out",
    ("reward_model", "eval/accuracy"): "reward_model/eval_accuracy",
}


def pipeline_run_name(config: PipelineConfig, flow_name: str, now: float | None = None) -> str:
    """``rlhf/ppo 2026-12-03 08:10`` (``... stage-sft`` for a one-stage flow), local time."""
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(now))
    suffix = "" if flow_name == PIPELINE_FLOW else f" {flow_name}"
    return f"{config.name}/{config.policy_optimisation.algorithm}{suffix} {stamp}"


def key_params(config: PipelineConfig) -> dict[str, str]:
    """Base model, algorithm, data, steps and learning rates: the columns runs are compared by."""
    sft, po, rm = config.sft, config.policy_optimisation, config.reward_model
    params = {
        "base_model": config.base_model or "embedded tiny model",
        "algorithm": po.algorithm,
        "sft.data": f"given model {sft.model_path}" if sft.model_path else data_label(sft.data, "sft"),
        "sft.max_steps": sft.max_steps,
        "sft.learning_rate": sft.learning_rate,
        "preference_data": config.preference_data.path or config.preference_data.method,
        "reward_model": rm.model_path or ("trained" if rm.enabled else "off"),
        "evaluation.data": data_label(config.evaluation.data, "eval"),
        "evaluation.reward": config.evaluation.reward,
    }
    if po.model_path:
        params["policy.model_path"] = po.model_path
    elif po.algorithm != "none":
        algo = getattr(po, po.algorithm)
        params["policy.max_steps"] = algo.max_steps
        params["policy.learning_rate"] = algo.learning_rate
        params["policy.data"] = data_label(po.prompts, "prompts") if hasattr(algo, "num_generations") else "preference pairs"
    return {k: "" if v is None else str(v) for k, v in params.items()}


def headline_metrics(records: dict[str, StageRecord | None]) -> dict[str, float]:
    """The metrics the parent run repeats from its stages' records."""
    out = {}
    for (stage, metric), name in HEADLINE.items():
        rec = records.get(stage)
        if rec is not None and metric in rec.metrics:
            out[name] = rec.metrics[metric]
    return out


def comparison_lines(metrics: dict[str, float]) -> list[str]:
    """The evaluation's comparisons as sentences for the end of a run (the per-policy table shows the rest)."""
    lines = []
    if "win_rate/final_vs_base" in metrics:
        lines.append(
            f"win rate of the final policy over the base model (reward model, {metrics['win_rate/prompts']:.0f} prompts): "
            f"{metrics['win_rate/final_vs_base']:.3f} (95% interval {metrics['win_rate/ci95_low']:.3f}"
            f"-{metrics['win_rate/ci95_high']:.3f})"
        )
    if "reward_model_accuracy/held_out" in metrics:
        lines.append(
            f"the reward model's own accuracy on {metrics['reward_model_accuracy/pairs']:.0f} held-out pairs: "
            f"{metrics['reward_model_accuracy/held_out']:.3f}"
        )
    if "implicit_reward_accuracy/final" in metrics:
        lines.append(f"held-out implicit-reward accuracy of the final policy: {metrics['implicit_reward_accuracy/final']:.3f}")
    if "accuracy_gain" in metrics:
        lines.append(f"accuracy gain of the final policy over the SFT policy: {metrics['accuracy_gain']:+.3f}")
    return lines


def prefect_flow_run_url(flow_run_id: str | None) -> str | None:
    """The flow run's page in the Prefect UI, when a Prefect server is configured (``PREFECT_UI_URL``
    or ``PREFECT_API_URL``); None with the temporary local API, which has no UI that outlives the run."""
    ui = os.environ.get("PREFECT_UI_URL") or os.environ.get("PREFECT_API_URL", "").rstrip("/").removesuffix("/api")
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui and flow_run_id else None
