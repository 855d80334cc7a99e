"""What stages hand each other and what they are made of: records, outputs, the context a
stage function runs in, and the description of a stage (:class:`Stage`).

A stage returns a small, serialisable :class:`StageRecord`, never a live model: the folder it
wrote, a content fingerprint, its headline metrics and its MLflow run id. That is what makes
Prefect caching cheap and any stage runnable alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from verl_core.config import ConfigError
from verl_core.train.callbacks import Callback

RECORD_FILE = "record.json"
PREVIOUS_ROUND = "previous_round"  # the input name of round k - 1's record, in a stage that runs in rounds
HISTORY_FILE = "history.json"


class StageRecord(BaseModel):
    """What a stage hands downstream: where its output is and what it contains."""

    stage: str
    output_path: str
    fingerprint: str
    metrics: dict[str, float] = Field(default_factory=dict)
    mlflow_run_id: str | None = None
    variant: str | None = None
    cache_key: str | None = None
    given: bool = Field(False, description="output supplied by the config, not computed")
    round: int | None = Field(None, description="which round of a step that runs in rounds (1-based)")
    extra: dict[str, Any] = Field(default_factory=dict)


@dataclass
class DatasetUse:
    """A dataset a stage read or wrote, for tracking (MLflow dataset inputs)."""

    name: str
    rows: list[dict]
    context: str  # "training" | "evaluation" | "output"
    source: str


@dataclass
class StageOutput:
    """What a stage function returns; ``run_stage`` turns it into a :class:`StageRecord`."""

    output_path: Path
    metrics: dict[str, float] = field(default_factory=dict)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    datasets: list[DatasetUse] = field(default_factory=list)
    artifacts: list[Path] = field(default_factory=list)
    tables: dict[str, list[dict]] = field(default_factory=dict)
    traces: dict[str, list[dict]] = field(default_factory=dict)  # kind -> samples (verl_core.train.traces)
    model_to_log: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageResult:
    record: StageRecord
    output: StageOutput
    reused: bool = False  # a complete output with the same key was already on disk


@dataclass
class StageContext:
    """What a stage function gets: the config, its inputs' records, its folder, the callbacks."""

    config: Any  # PipelineConfig
    name: str
    variant: str | None
    inputs: dict[str, StageRecord]
    output_dir: Path
    callbacks: list[Callback]
    round: int | None = None  # 1-based, for a stage that runs in rounds

    @property
    def section(self) -> Any:
        return getattr(self.config, self.name)

    def input_path(self, name: str) -> str:
        if self.inputs.get(name) is None:
            raise ConfigError(f"stage {self.name!r} needs the output of {name!r}, which is missing")
        return self.inputs[name].output_path


Inputs = tuple[str, ...] | Callable[[Any], tuple[str, ...]]


@dataclass(frozen=True)
class Stage:
    """One way of computing a pipeline step: ``"sft"``, or a variant like ``"policy_optimisation:dpo"``.

    ``inputs``: upstream steps whose records it needs (a tuple, or a function of the config);
    ``optional``: upstream steps it uses when present; ``bundled``: config -> the built-in rows
    it reads, if any (their content enters the cache key, so a change of the bundled task reruns
    it). ``rounds``: config -> how many rounds the stage runs in (None: one plain run); round
    ``k > 1`` gets round ``k - 1``'s record as its input ``"previous_round"``, and each round is
    its own cached, retryable unit. Bump ``version`` when the stage computes something different.
    """

    name: str
    version: str
    fn: Callable[[StageContext], StageOutput]
    inputs: Inputs = ()
    optional: tuple[str, ...] = ()
    bundled: Callable[[Any], list[dict] | None] | None = None
    rounds: Callable[[Any], int] | None = None

    def input_names(self, config: Any) -> tuple[str, ...]:
        return self.inputs(config) if callable(self.inputs) else self.inputs

    @property
    def step(self) -> str:
        """The pipeline step this stage computes (``policy_optimisation`` for ``policy_optimisation:dpo``)."""
        return self.name.split(":")[0]


@dataclass(frozen=True)
class Step:
    """A step of the pipeline (one Prefect task, one stage flow): its section of the config,
    the field that names a given output instead (``sft.model_path``), the selector of its
    variants (``policy_optimisation.algorithm``) and whether the pipeline has it at all."""

    name: str
    given_field: str | None = None
    selector: str | None = None
    enabled: Callable[[Any], bool] = field(default=lambda config: True)
    stages: Sequence[Stage] = ()
