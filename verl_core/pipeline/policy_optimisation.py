"""The policy-optimisation stage: one variant per registered algorithm
(:data:`verl_core.algorithms.registry.ALGORITHMS`), all trained by the same two functions.

Offline algorithms train on the preference-data stage's pairs; online ones sample from the
configured prompts and score with their rules (plus the reward model when ``use_reward_model``).
"""

from __future__ import annotations

from verl_core import arithmetic
from verl_core.algorithms.registry import ALGORITHMS, Algorithm
from verl_core.data.errors import DataError
from verl_core.pipeline.data import data_label, load_data, preference_rows_of
from verl_core.pipeline.records import DatasetUse, Stage, StageContext, StageOutput, Step
from verl_core.pipeline.training import train_in_stage, train_offline

PAIR_FIELDS = ("prompt", "chosen", "rejected")
UNPAIRED_FIELDS = ("prompt", "completion", "label")
UNPAIRED_ALGORITHMS = ("kto",)  # trainers whose data may be unpaired (tokenize_unpaired)


def offline_rows(rows: list[dict], algorithm: str, source: str) -> list[dict]:
    """The fields ``algorithm`` trains on: pairs, or unpaired rows for an algorithm that reads them."""
    unpaired = bool(rows) and "chosen" not in rows[0] and "completion" in rows[0]
    if unpaired and algorithm not in UNPAIRED_ALGORITHMS:
        raise DataError(
            f"{source} holds unpaired rows (prompt/completion/label); {algorithm} needs pairs (prompt/chosen/rejected). "
            f"Unpaired data trains with: {', '.join(UNPAIRED_ALGORITHMS)}"
        )
    fields = UNPAIRED_FIELDS if unpaired else PAIR_FIELDS
    for i, row in enumerate(rows):
        missing = [k for k in fields if k not in row]
        if missing:
            raise DataError(f"{source} row {i}: missing field {missing[0]!r} (rows need {', '.join(fields)})")
    return [{k: r[k] for k in fields} for r in rows]


def _prompts(cfg) -> list[dict]:
    return load_data(cfg.policy_optimisation.prompts, lambda limit: arithmetic.prompt_rows(limit or 256))


def _offline(ctx: StageContext, algorithm: Algorithm) -> StageOutput:
    # generated pairs carry scores and indices; the trainers read prompt/chosen/rejected (or, for KTO,
    # unpaired prompt/completion/label) only
    source = ctx.inputs["preference_data"].output_path
    rows = offline_rows(preference_rows_of(ctx.inputs["preference_data"]), algorithm.name, source)
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
