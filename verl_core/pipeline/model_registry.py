"""The registered policy: each evaluated policy becomes a version of ``tracking.registered_model_name``
linked to the run that trained it, and the alias ``champion`` moves to it only when it beats the
current champion on the held-out evaluation.

A version's source is the policy's model folder among the training run's artifacts (``model/``,
logged when ``tracking.log_stage_models``), else the local folder. Load the champion with
``mlflow.artifacts.download_artifacts("models:/<name>@champion")`` and
``AutoModelForCausalLM.from_pretrained`` on the folder it returns.
"""

from __future__ import annotations

from pathlib import Path

from verl_core.pipeline import tracking
from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.records import StageRecord
from verl_core.pipeline.registration import KEY_TAG, registered_version

CHAMPION = "champion"
SCORE_TAG, METRIC_TAG = "heldout_score", "heldout_metric"


def heldout_score(metrics: dict[str, float]) -> tuple[str, float] | None:
    """The evaluation's score of the final policy: rule accuracy, else the reward-model score."""
    for name in ("accuracy/final", "reward_score/final"):
        if name in metrics:
            return name, float(metrics[name])
    return None


def register_policy(
    config: PipelineConfig,
    final: StageRecord,
    eval_metrics: dict[str, float],
    eval_run_id: str,
    parent_run_id: str | None = None,
    cache_key: str | None = None,
) -> tuple[str, bool] | None:
    """Register ``final`` (the evaluated policy); returns (version, became champion), or None when
    registration is off (``tracking.registered_model_name: null``).

    Once per evaluation output (``cache_key``, the evaluation stage's key, set as a version tag when
    the version is created): a rerun after a kill during registration finds that version instead of
    registering a second one, and finishes what the killed attempt did not (alias, run tag)."""
    name = config.tracking.registered_model_name
    if not name:
        return None
    c = tracking.client(config)
    train_run = final.mlflow_run_id if final.mlflow_run_id and tracking.run_exists(config, final.mlflow_run_id) else None
    if train_run and tracking.MODEL_ARTIFACT in {a.path for a in c.list_artifacts(train_run)}:
        source = f"{c.get_run(train_run).info.artifact_uri}/{tracking.MODEL_ARTIFACT}"
    else:
        source = Path(final.output_path).resolve().as_uri()
    score = heldout_score(eval_metrics)
    tags = {
        "algorithm": final.variant or final.stage,
        "stage": final.stage,
        "fingerprint": final.fingerprint,
        "evaluation_run_id": eval_run_id,
        "pipeline_run_id": parent_run_id or "",
        "pipeline": config.name,
        "base_model": config.base_model or "embedded tiny model",
    }
    if score is not None:
        tags.update({METRIC_TAG: score[0], SCORE_TAG: f"{score[1]:.4f}"})
    try:
        c.get_registered_model(name)
    except Exception:
        c.create_registered_model(name, description=f"Policies trained by the verl_core pipeline `{config.name}`")
    sft = eval_metrics.get(score[0].replace("/final", "/sft")) if score else None
    description = f"{final.variant or final.stage} policy" + (f", held-out {score[0]} = {score[1]:.3f}" if score else "")
    description += f" (SFT policy: {sft:.3f})" if sft is not None else ""
    if cache_key:
        tags[KEY_TAG] = cache_key
    version = registered_version(c, name, cache_key) if cache_key else None
    if version is None:
        version = c.create_model_version(
            name, source, run_id=train_run, tags={k: v for k, v in tags.items() if v}, description=description
        ).version
    c.set_tag(eval_run_id, "verl_core.registered_version", str(version))
    champion = _is_better_than_champion(c, name, score)
    if champion:
        c.set_registered_model_alias(name, CHAMPION, version)
    return str(version), champion


def _is_better_than_champion(c, name: str, score: tuple[str, float] | None) -> bool:
    """No champion yet, or one scored on the same metric with a lower score (a tie keeps the old one)."""
    try:
        current = c.get_model_version_by_alias(name, CHAMPION)
    except Exception:
        return score is not None
    if score is None or current.tags.get(METRIC_TAG) != score[0]:
        return False
    return score[1] > float(current.tags.get(SCORE_TAG, "-inf"))
