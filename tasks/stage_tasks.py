"""One Prefect task per stage. Each is thin: ``execute`` does the work; the decorator
carries the cache policy, retries and result persistence.

Adding a stage = one more task here + its name in ``TASKS`` (variants of an existing
stage, e.g. a new policy-optimisation algorithm, need no new task).
"""
from __future__ import annotations

from prefect import task

from tasks.common import Inputs, cache_policy, execute
from verl_core.pipeline_config import PipelineConfig
from verl_core.stages import StageRecord

_COMMON = dict(persist_result=True, result_serializer="json", retries=1, retry_delay_seconds=2)


@task(name="sft", cache_policy=cache_policy("sft"), **_COMMON)
def sft_task(config: PipelineConfig, inputs: Inputs, parent_run_id: str | None = None) -> StageRecord:
    return execute("sft", config, inputs, parent_run_id)


@task(name="preference_data", cache_policy=cache_policy("preference_data"), **_COMMON)
def preference_data_task(config: PipelineConfig, inputs: Inputs, parent_run_id: str | None = None) -> StageRecord:
    return execute("preference_data", config, inputs, parent_run_id)


@task(name="reward_model", cache_policy=cache_policy("reward_model"), **_COMMON)
def reward_model_task(config: PipelineConfig, inputs: Inputs, parent_run_id: str | None = None) -> StageRecord:
    return execute("reward_model", config, inputs, parent_run_id)


@task(name="policy_optimisation", cache_policy=cache_policy("policy_optimisation"), **_COMMON)
def policy_optimisation_task(config: PipelineConfig, inputs: Inputs, parent_run_id: str | None = None) -> StageRecord:
    return execute("policy_optimisation", config, inputs, parent_run_id)


@task(name="evaluation", cache_policy=cache_policy("evaluation"), **_COMMON)
def evaluation_task(config: PipelineConfig, inputs: Inputs, parent_run_id: str | None = None) -> StageRecord:
    return execute("evaluation", config, inputs, parent_run_id)


TASKS = {
    "sft": sft_task,
    "preference_data": preference_data_task,
    "reward_model": reward_model_task,
    "policy_optimisation": policy_optimisation_task,
    "evaluation": evaluation_task,
}
