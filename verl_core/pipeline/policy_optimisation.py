"""The policy-optimisation stage: one variant per registered algorithm
(:data:`verl_core.algorithms.registry.ALGORITHMS`), all trained by the same two functions.

Offline algorithms train on the preference-data stage's pairs; online ones sample from the
configured prompts and score with their rules (plus the reward model when ``use_reward_model``).
"""

from __future__ import annotations

from verl_core import arithmetic
from verl_core.algorithms.registry import ALGORITHMS, Algorithm
from verl_core.pipeline.data import data_label, load_data, preference_rows_of
from verl_core.pipeline.records import DatasetUse, Stage, StageContext, StageOutput, Step
from verl_core.pipeline.training import train_in_stage, train_offline

PAIR_FIELDS = ("prompt", "chosen", "rejected")


def _prompts(cfg) -> list[dict]:
    return load_data(
        cfg.policy_optimisation.prompts, lambda limit: arithmetic.prompt_rows(limit or 256), "policy_optimisation.prompts"
    )


def _offline(ctx: StageContext, algorithm: Algorithm) -> StageOutput:
    # generated pairs carry scores and indices; the trainers read prompt/chosen/rejected only
    # (no prompt: an implicit-prompt pair, split by the trainer's tokenizer)
    pairs = preference_rows_of(ctx.inputs["preference_data"], ctx.config.preference_data.columns)
    rows = [{k: r[k] for k in PAIR_FIELDS if r.get(k) is not None} for r in pairs]
    source = ctx.inputs["preference_data"].output_path
    return train_offline(
        ctx,
        algorithm.trainer,
        getattr(ctx.section, algorithm.name),
        ctx.input_path("sft"),
        rows,
        datasets=[DatasetUse(f"{algorithm.name}-train", rows, "training", source)],
        source=f"policy_optimisation.{algorithm.name}",
    )


def _online(ctx: StageContext, algorithm: Algorithm) -> StageOutput:
    prompts = _prompts(ctx.config)
    reward_model = ctx.input_path("reward_model") if ctx.section.use_reward_model else None
    return train_in_stage(
        ctx,
        algorithm.trainer,
        getattr(ctx.section, algorithm.name),
        source=f"policy_optimisation.{algorithm.name}",
        build=lambda config: algorithm.trainer(
            ctx.input_path("sft"), reward_model=reward_model, prompts=prompts, callbacks=ctx.callbacks, config=config
        ),
        datasets=[DatasetUse(f"{algorithm.name}-prompts", prompts, "training", data_label(ctx.section.prompts, "prompts"))],
    )


def _online_inputs(cfg) -> tuple[str, ...]:
    return ("sft", "reward_model") if cfg.policy_optimisation.use_reward_model else ("sft",)


def _stage(algorithm: Algorithm) -> Stage:
    train = _offline if algorithm.kind == "offline" else _online

    def stage(ctx: StageContext) -> StageOutput:
        return train(ctx, algorithm)

    if algorithm.kind == "offline":
        return Stage(
            f"policy_optimisation:{algorithm.name}", version=f"{algorithm.name}-1", fn=stage, inputs=("sft", "preference_data")
        )
    return Stage(
        f"policy_optimisation:{algorithm.name}",
        version=f"{algorithm.name}-1",
        fn=stage,
        inputs=_online_inputs,
        bundled=lambda cfg: _prompts(cfg) if cfg.policy_optimisation.prompts.path is None else None,
    )


STEP = Step(
    "policy_optimisation",
    given_field="model_path",
    selector="algorithm",
    enabled=lambda cfg: cfg.policy_optimisation.algorithm != "none" or cfg.policy_optimisation.model_path is not None,
    stages=[_stage(a) for a in ALGORITHMS.values()],
)
