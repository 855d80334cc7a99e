"""Training inside a stage: the stage section's settings become the trainer's config, the
stage folder its ``output_dir`` (so a retried stage resumes from its checkpoints)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from verl_core.data.errors import DataError
from verl_core.data.files import naming_source
from verl_core.pipeline.records import DatasetUse, StageContext, StageOutput


def train_in_stage(
    ctx: StageContext,
    trainer_cls: type,
    settings: BaseModel,
    build: Callable[[Any], Any],
    datasets: Sequence[DatasetUse] = (),
    source: str | None = None,
    rows_from: str | None = None,
) -> StageOutput:
    """Train into ``ctx.output_dir`` (resuming its checkpoints) and describe the result.

    ``settings``' fields that ``trainer_cls.config_cls`` knows become its config (a stage section
    also holds stage-only fields such as ``model_path``); ``build(config)`` makes the trainer.
    ``rows_from``: the file the training rows were read from, which a data error about a row then
    names with the row's line (as the Python API's loaders do).
    """
    cfg_cls = trainer_cls.config_cls
    values = {k: v for k, v in settings.model_dump().items() if k in cfg_cls.model_fields}
    values.update(output_dir=str(ctx.output_dir), resume=True)
    try:
        result = build(cfg_cls.from_dict(values, source=source or f"{ctx.name} settings")).train()
    except DataError as err:
        named = naming_source(err, rows_from)
        if named is err:
            raise
        raise named from None
    if not ctx.config.orchestration.keep_checkpoints:
        shutil.rmtree(ctx.output_dir / "checkpoints", ignore_errors=True)
    return StageOutput(
        output_path=Path(result.output_dir or ctx.output_dir),  # online trainers give None on ranks other than 0
        metrics=result.metrics,
        history=result.history,
        datasets=list(datasets),
        extra={"steps": result.steps, "resumed_from_step": result.resumed_from_step},
    )


def train_offline(
    ctx: StageContext,
    trainer_cls: type,
    settings: BaseModel,
    model: str,
    rows: list[dict],
    eval_rows: list[dict] | None = None,
    datasets: Sequence[DatasetUse] = (),
    source: str | None = None,
    rows_from: str | None = None,
) -> StageOutput:
    """:func:`train_in_stage` for a trainer that reads rows (SFT, reward model, DPO family, KTO)."""
    return train_in_stage(
        ctx,
        trainer_cls,
        settings,
        datasets=datasets,
        source=source,
        rows_from=rows_from,
        build=lambda config: trainer_cls(
            model, train_dataset=rows, eval_dataset=eval_rows or None, config=config, callbacks=ctx.callbacks
        ),
    )
