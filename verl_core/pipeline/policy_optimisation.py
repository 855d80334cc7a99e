"""The policy-optimisation stage: one variant per registered algorithm
(:data:`verl_core.algorithms.registry.ALGORITHMS`), trained by one function per kind.

Offline algorithms train on the preference-data stage's pairs; online ones sample from the
configured prompts and score with their rules (plus the reward model when ``use_reward_model``);
rounds algorithms (iterative DPO, RFT) run each round of generate -> score -> train as its own
stage run, from the previous round's policy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from verl_core.algorithms.registry import ALGORITHMS, Algorithm
from verl_core.bundled import arithmetic
from verl_core.data.errors import DataError
from verl_core.pipeline.data import bundled_rows, data_label, load_data, preference_rows_of
from verl_core.pipeline.records import PREVIOUS_ROUND, DatasetUse, Stage, StageContext, StageOutput, Step
from verl_core.pipeline.training import train_in_stage, train_offline
from verl_core.train.checkpoints import CHECKPOINTS_DIR

PAIR_FIELDS = ("prompt", "chosen", "rejected")
UNPAIRED_FIELDS = ("prompt", "completion", "label")


def offline_rows(rows: list[dict], algorithm: str, source: str) -> list[dict]:
    """The fields ``algorithm`` trains on: pairs, or unpaired rows for an algorithm that reads them."""
    unpaired = bool(rows) and "chosen" not in rows[0] and "completion" in rows[0]
    readers = [a.name for a in ALGORITHMS.values() if a.reads_unpaired]
    if unpaired and algorithm not in readers:
        raise DataError(
            f"{source} holds unpaired rows (prompt/completion/label); {algorithm} needs pairs (prompt/chosen/rejected). "
            f"Unpaired data trains with: {', '.join(readers)}"
        )
    fields = UNPAIRED_FIELDS if unpaired else PAIR_FIELDS
    for i, row in enumerate(rows):
        missing = [k for k in fields if k not in row and k != "prompt"]  # no prompt: implicit in the pair
        if missing:
            raise DataError(f"{source} row {i}: missing field {missing[0]!r} (rows need {', '.join(fields)})")
    return [{k: r[k] for k in fields if r.get(k) is not None} for r in rows]


def _prompts(cfg) -> list[dict]:
    def bundled(limit):
        return bundled_rows(cfg, "prompt_rows", limit or 256, arithmetic.prompt_rows)

    return load_data(cfg.policy_optimisation.prompts, bundled, "policy_optimisation.prompts")


def _offline(ctx: StageContext, algorithm: Algorithm) -> StageOutput:
    # generated pairs carry scores and indices; the trainers read prompt/chosen/rejected (or, for KTO,
    # unpaired prompt/completion/label) only (no prompt: an implicit-prompt pair, split by the trainer's tokenizer)
    source = ctx.inputs["preference_data"].output_path
    rows = offline_rows(preference_rows_of(ctx.inputs["preference_data"], ctx.config.preference_data), algorithm.name, source)
    return train_offline(
        ctx,
        algorithm.trainer,
        getattr(ctx.section, algorithm.name),
        ctx.input_path("sft"),
        rows,
        datasets=[DatasetUse(f"{algorithm.name}-train", rows, "training", source)],
        source=f"policy_optimisation.{algorithm.name}",
        rows_from=ctx.config.preference_data.path if ctx.inputs["preference_data"].given else None,
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
        rows_from=ctx.section.prompts.path,
    )


def _rounds(ctx: StageContext, algorithm: Algorithm) -> StageOutput:
    """One round of a rounds algorithm: from the previous round's policy (round 1: the SFT policy)."""
    from verl_core.algorithms.rounds import run_round

    section = getattr(ctx.section, algorithm.name)
    values = {k: v for k, v in section.model_dump().items() if k in algorithm.config_cls.model_fields}
    config = algorithm.config_cls.from_dict(values, source=f"policy_optimisation.{algorithm.name}")
    previous = ctx.inputs.get(PREVIOUS_ROUND)
    policy = previous.output_path if previous else ctx.input_path("sft")
    reward_model = ctx.input_path("reward_model") if ctx.section.use_reward_model else None
    prompts = _prompts(ctx.config)
    result = run_round(config, policy, ctx.input_path("sft"), prompts, ctx.round, ctx.output_dir, reward_model, ctx.callbacks)
    if not ctx.config.orchestration.keep_checkpoints:
        shutil.rmtree(ctx.output_dir / CHECKPOINTS_DIR, ignore_errors=True)
    return StageOutput(
        output_path=Path(result.output_dir),
        metrics=result.metrics,
        history=result.history,
        datasets=[DatasetUse(f"{algorithm.name}-prompts", prompts, "training", data_label(ctx.section.prompts, "prompts"))],
        extra={"steps": result.steps, "resumed_from_step": result.resumed_from_step, "round": ctx.round},
    )


def _online_inputs(cfg) -> tuple[str, ...]:
    return ("sft", "reward_model") if cfg.policy_optimisation.use_reward_model else ("sft",)


TRAIN = {"offline": _offline, "online": _online, "rounds": _rounds}


def _stage(algorithm: Algorithm) -> Stage:
    train = TRAIN[algorithm.kind]

    def stage(ctx: StageContext) -> StageOutput:
        return train(ctx, algorithm)

    name, version = f"policy_optimisation:{algorithm.name}", f"{algorithm.name}-1"
    if algorithm.kind == "offline":
        return Stage(name, version=version, fn=stage, inputs=("sft", "preference_data"))
    return Stage(
        name,
        version=version,
        fn=stage,
        inputs=_online_inputs,
        bundled=lambda cfg: _prompts(cfg) if cfg.policy_optimisation.prompts.path is None else None,
        rounds=(lambda cfg: getattr(cfg.policy_optimisation, algorithm.name).rounds) if algorithm.kind == "rounds" else None,
    )


STEP = Step(
    "policy_optimisation",
    given_field="model_path",
    selector="algorithm",
    enabled=lambda cfg: cfg.policy_optimisation.algorithm != "none" or cfg.policy_optimisation.model_path is not None,
    stages=[_stage(a) for a in ALGORITHMS.values()],
)
