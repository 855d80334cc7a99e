"""The SFT stage: the base model trained on prompt/completion rows (bundled arithmetic by default)."""

from __future__ import annotations

from verl_core.bundled import arithmetic
from verl_core.pipeline.data import bundled_rows, data_label, load_data, shaped_rows
from verl_core.pipeline.records import DatasetUse, Stage, StageContext, StageOutput, Step
from verl_core.pipeline.training import train_offline


def _bundled(cfg) -> list[dict] | None:
    if cfg.sft.data.path is not None:
        return None
    rows = bundled_rows(cfg, "sft_rows", cfg.sft.data.limit or 2000, arithmetic.sft_rows)
    return shaped_rows(rows, cfg.sft.data.chat, None, None, "sft.data")


def sft_stage(ctx: StageContext) -> StageOutput:
    from verl_core.algorithms.sft import SFTTrainer

    c = ctx.section
    rows = _bundled(ctx.config) or load_data(c.data, None, where="sft.data")
    return train_offline(
        ctx,
        SFTTrainer,
        c,
        ctx.input_path("base"),
        rows,
        datasets=[DatasetUse("sft-train", rows, "training", data_label(c.data, "sft"))],
        rows_from=c.data.path,
    )


STEP = Step(
    "sft", given_field="model_path", stages=[Stage("sft", version="sft-1", fn=sft_stage, inputs=("base",), bundled=_bundled)]
)
