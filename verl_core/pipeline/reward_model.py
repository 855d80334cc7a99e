"""The reward-model stage: a Bradley–Terry model trained on the preference pairs, initialised
from the SFT policy (or the base model); the last ``eval_fraction`` of the pairs is held out."""

from __future__ import annotations

from verl_core.pipeline.data import preference_rows_of
from verl_core.pipeline.records import DatasetUse, Stage, StageContext, StageOutput, Step
from verl_core.pipeline.training import train_offline


def reward_model_stage(ctx: StageContext) -> StageOutput:
    from verl_core.algorithms.reward_model import RewardTrainer

    c = ctx.section
    rows = preference_rows_of(ctx.inputs["preference_data"], ctx.config.preference_data)
    n_eval = int(len(rows) * c.eval_fraction)
    train, held = (rows[:-n_eval], rows[-n_eval:]) if n_eval else (rows, [])
    source = ctx.inputs["preference_data"].output_path
    uses = [DatasetUse("rm-train", train, "training", source)] + (
        [DatasetUse("rm-eval", held, "evaluation", source)] if held else []
    )
    return train_offline(ctx, RewardTrainer, c, ctx.input_path(c.init_from), train, eval_rows=held, datasets=uses)


STEP = Step(
    "reward_model",
    given_field="model_path",
    enabled=lambda cfg: cfg.reward_model.enabled or cfg.reward_model.model_path is not None,
    stages=[
        Stage(
            "reward_model",
            version="rm-1",
            fn=reward_model_stage,
            inputs=lambda cfg: (cfg.reward_model.init_from, "preference_data"),
        )
    ],
)
