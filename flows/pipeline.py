"""Prefect flows: the RLHF pipeline, and one stage flow parametrised by the step it computes.

The flow parameter is the pydantic :class:`PipelineConfig` (the same object
``configs/default.yaml`` loads into), so the Prefect UI shows it as a form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from flows.reconcile import crash_runs_of_dead_processes, tag_this_flow_run
from tasks import task_for
from tasks.prefect_settings import project_logging, quiet_user_error_tracebacks
from tasks.stage_task import markdown_table, mlflow_link, publish_cached
from verl_core.pipeline import tracking
from verl_core.pipeline.config import PipelineConfig, PolicyAlgorithm
from verl_core.pipeline.form import FORM_KEYS, FROM_CONFIG, form_config
from verl_core.pipeline.preflight import preflight
from verl_core.pipeline.reconcile import end_runs_of_dead_processes
from verl_core.pipeline.records import PREVIOUS_ROUND, StageRecord
from verl_core.pipeline.registry import STAGE_ORDER, given_record, stage_enabled, stage_for
from verl_core.pipeline.workdir_lock import workdir_lock

StageName = Literal[STAGE_ORDER]  # type: ignore[valid-type]


class PipelineResult(BaseModel):
    """Records of every stage, how each was obtained (Completed / Cached / Given / Skipped) and the MLflow parent run."""

    records: dict[str, StageRecord | None] = Field(default_factory=dict)
    states: dict[str, str] = Field(default_factory=dict)
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    flow_run_id: str | None = None

    @property
    def evaluation_table(self) -> list[dict]:
        rec = self.records.get("evaluation")
        if rec is None:
            return []
        import json

        return json.loads((Path(rec.output_path) / "results.json").read_text())["table"]


class PipelineRun:
    """One run of (part of) the pipeline: the MLflow parent run and the records so far.

    ``stage(name)`` returns the stage's record: given by the config, or computed by its
    task after resolving the stage's inputs the same way (so a stage flow pulls in just
    the upstream it needs, from the cache when it was computed before).
    """

    def __init__(self, config: PipelineConfig, flow_name: str):
        self.config, self.flow_name = config, flow_name
        self.result = PipelineResult()
        self.stage_runs: dict[str, str] = {}  # this run's MLflow child per stage (cached ones too)

    def __enter__(self) -> PipelineRun:
        from prefect.runtime import flow_run

        self.result.flow_run_id = flow_run.id
        self.result.tracking_uri = tracking.configure(self.config)
        self.result.mlflow_run_id = tracking.start_pipeline_run(self.config, self.flow_name, flow_run.id)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        r = self.result
        tracking.finish_pipeline_run(self.config, r.mlflow_run_id, r.records, r.states, self.stage_runs, error=exc)
        if not exc_type:
            self._publish_summary()
        return False

    def stage(self, name: str) -> StageRecord | None:
        if name in self.result.records:
            return self.result.records[name]
        record, state = given_record(self.config, name), "Given"
        if record is None and not stage_enabled(self.config, name):
            state = "Skipped"
        elif record is None:
            spec = stage_for(self.config, name)
            inputs = {i: self.stage(i) for i in spec.input_names(self.config) + spec.optional}
            if spec.rounds is None:
                record, state = self._run_task(name, inputs)
            else:  # one task per round, each fed the previous round's record
                for k in range(1, spec.rounds(self.config) + 1):
                    record, state = self._run_task(name, {**inputs, PREVIOUS_ROUND: record}, round=k)
                    self.result.states[f"{name}/round{k}"] = state
        self.result.records[name], self.result.states[name] = record, state
        return record

    def _run_task(self, name: str, inputs: dict[str, StageRecord | None], round: int | None = None) -> tuple[StageRecord, str]:
        task = task_for(name, self.config, round)
        parent = self.result.mlflow_run_id
        state = task(name, self.config, inputs, parent_run_id=parent, round=round, return_state=True)
        record = state.result()  # re-raises the task's exception
        if state.is_completed() and state.name == "Cached" and not Path(record.output_path).exists():
            # The cache record outlived its output folder: compute it again.
            state = task.with_options(refresh_cache=True)(
                name, self.config, inputs, parent_run_id=parent, round=round, return_state=True
            )
            record = state.result()
        if state.name == "Cached":  # no task body ran: give this pipeline run its child run and artifacts
            self.stage_runs[name] = publish_cached(self.config, record, self.result.mlflow_run_id, self.result.flow_run_id)
        elif record.mlflow_run_id:
            self.stage_runs[name] = record.mlflow_run_id
        return record, state.name

    def _publish_summary(self) -> None:
        rows = [
            {
                "stage": k,
                "state": self.result.states[k],
                "MLflow run": mlflow_link(self.config, self.stage_runs.get(k)),
                "fingerprint": (r.fingerprint[:12] if r else ""),
                "output": (r.output_path if r else ""),
            }
            for k, r in self.result.records.items()
        ]
        parent = mlflow_link(self.config, self.result.mlflow_run_id)
        create_markdown_artifact(
            f"Pipeline run in MLflow: {parent}\n\n" + markdown_table(rows),
            key=f"{self.flow_name}-stages",
            description="stage states of this run",
        )


def run_pipeline(config: PipelineConfig, flow_name: str, until: str | None = None) -> PipelineResult:
    """Every step in registry order (or just ``until`` and what it needs).

    First, in seconds: the workdir and tracking URI are checked (``preflight``), the workdir is locked
    (one writer at a time), and runs a killed attempt left RUNNING are ended (MLflow and Prefect). A user's
    error is one readable line in the run's log (its traceback at DEBUG), wherever the flow runs."""
    quiet_user_error_tracebacks()
    project_logging()
    preflight(config)
    o = config.orchestration
    with workdir_lock(config.workdir_path, wait=o.busy_workdir == "wait", timeout=o.busy_wait_seconds):
        reconcile_killed_attempts(config)
        with PipelineRun(config, flow_name) as run:
            for name in (until,) if until is not None else STAGE_ORDER:
                run.stage(name)
    return run.result


def reconcile_killed_attempts(config: PipelineConfig) -> None:
    from prefect.runtime import flow_run

    if flow_run.id:
        tag_this_flow_run(flow_run.id)
    crash_runs_of_dead_processes()
    end_runs_of_dead_processes(config)


DEFAULT_CONFIG = PipelineConfig()


@flow(name="rlhf-pipeline")
def rlhf_pipeline(config: PipelineConfig = DEFAULT_CONFIG) -> PipelineResult:
    """SFT -> preference data -> reward model -> policy optimisation -> evaluation."""
    return run_pipeline(config, "rlhf-pipeline")


@flow(name="stage", flow_run_name="stage-{stage}")
def stage_flow(stage: StageName, config: PipelineConfig = DEFAULT_CONFIG) -> PipelineResult:
    """One step and whatever it needs that is neither given nor cached."""
    return run_pipeline(config, f"stage-{stage.replace('_', '-')}", until=stage)


Launcher = Literal[FROM_CONFIG, "local", "torchrun", "ray"]
FormAlgorithm = Literal[(FROM_CONFIG, *get_args(PolicyAlgorithm))]  # type: ignore[valid-type]


@flow(name="rlhf-pipeline")
def rlhf_pipeline_form(
    algorithm: FormAlgorithm = FROM_CONFIG,
    base_model: str = "",
    sft_data: str = "",
    preference_pairs: str = "",
    prompts: str = "",
    evaluation_data: str = "",
    sft_max_steps: int = 0,
    policy_max_steps: int = 0,
    launcher: Launcher = FROM_CONFIG,
    num_processes: int = 0,
    workdir: str = "",
    overrides: str = "",
    config_file: str = "",
) -> PipelineResult:
    """The pipeline from a deployment's form: the usual choices; anything else as `key=value` overrides.
    Every input left as it is (empty, 0, "from config file") keeps the config file's value.

    Args:
        algorithm: policy optimisation algorithm
        base_model: model folder, .gguf file, bundled:smollm2, or hf://org/name (empty: the embedded tiny model)
        sft_data: SFT rows file (prompt/completion); empty: the bundled task
        preference_pairs: preference pairs file (prompt/chosen/rejected) instead of generating them
        prompts: prompts file (prompt/ground_truth) for online algorithms; empty: the bundled task
        evaluation_data: held-out rows file; empty: the bundled task
        sft_max_steps: SFT optimizer steps (0: the config file's)
        policy_max_steps: the algorithm's steps, optimizer steps offline, rollout steps online (0: the config file's)
        launcher: where training stages run: in the worker's process, torchrun, or Ray
        num_processes: training processes per stage, torchrun / Ray (0: the config file's)
        workdir: folder for stage outputs, caches and the MLflow store (empty: the config file's)
        overrides: more settings as `verl-core run --set` takes them, `key=value` separated by `;` or new lines
        config_file: a YAML config the choices and overrides apply to (empty: configs/default.yaml)
    """
    choices = {k: v for k, v in locals().items() if k in FORM_KEYS}
    return run_pipeline(form_config(choices, overrides, config_file), "rlhf-pipeline")
