"""The stages with variants that train or sample from the SFT policy:
``preference_data:sample_and_score`` and ``policy_optimisation:<algorithm>``.

Registered into :data:`verl_core.stages.STAGES` on import (``verl_core.stages`` imports this
module last). No Prefect here.
"""
from __future__ import annotations

from verl_core import arithmetic
from verl_core.pipeline_config import OFFLINE_ALGORITHMS, ONLINE_ALGORITHMS, PipelineConfig
from verl_core.stages import (DatasetUse, StageContext, StageOutput, data_label, load_data, preference_rows_of,
                              register_stage, train_in_stage, train_offline)


# -- preference data sampled from the SFT policy --------------------------------------------
def _bundled_prompts(limit: int | None) -> list[dict]:
    return arithmetic.prompt_rows(limit or 256)


def _sample_prompts(cfg: PipelineConfig) -> list[dict]:
    c = cfg.preference_data
    rows = load_data(c.prompts, lambda limit: arithmetic.prompt_rows(limit or c.num_prompts))
    return rows[: c.num_prompts]


@register_stage("preference_data:sample_and_score", version="sample-1", inputs=("sft",),
                bundled=lambda cfg: _sample_prompts(cfg) if cfg.preference_data.prompts.path is None else None)
def sample_and_score_stage(ctx: StageContext) -> StageOutput:
    """Sample ``n_samples`` answers per prompt from the SFT policy, score them, pair best vs worst.

    Shards finished before an interruption are reused (same folder, same key), so a retried
    stage only samples what is missing.
    """
    from verl_core.data import load_rows
    from verl_core.preference_data import generate_preference_data

    c = ctx.section
    prompts = _sample_prompts(ctx.config)
    result = generate_preference_data(ctx.input_path("sft"), prompts, c.sample_and_score, ctx.output_dir / "data")
    pairs = load_rows(str(result.paths["pairs"])).to_list()
    if not pairs:
        raise ValueError(f"sample_and_score made no pairs from {len(prompts)} prompts (every prompt's samples tied); "
                         "raise preference_data.sample_and_score.n_samples or the sampling temperature")
    stats = {k: float(v) for k, v in result.stats.items() if isinstance(v, (int, float))}
    return StageOutput(output_path=ctx.output_dir / "data", metrics={"pairs": len(pairs), **stats},
                       datasets=[DatasetUse("prompts", prompts, "training", data_label(c.prompts, "prompts")),
                                 DatasetUse("preference-pairs", pairs, "output", str(result.paths["pairs"]))])


# -- policy optimisation --------------------------------------------------------------------
def _offline(algorithm: str):
    def stage(ctx: StageContext) -> StageOutput:
        from verl_core.algorithms import dpo, kto

        trainer_cls = {"dpo": dpo.DPOTrainer, "kto": kto.KTOTrainer, "simpo": dpo.SimPOTrainer, "orpo": dpo.ORPOTrainer}[algorithm]
        rows = preference_rows_of(ctx.inputs["preference_data"])
        # generated pairs carry scores and indices; the trainers read prompt/chosen/rejected only
        rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]
        source = ctx.inputs["preference_data"].output_path
        return train_offline(ctx, trainer_cls, getattr(ctx.section, algorithm), ctx.input_path("sft"), rows,
                             datasets=[DatasetUse(f"{algorithm}-train", rows, "training", source)])

    stage.__name__ = f"{algorithm}_stage"
    return stage


def _online_prompts(cfg: PipelineConfig) -> list[dict]:
    return load_data(cfg.policy_optimisation.prompts, _bundled_prompts)


def _online_inputs(cfg: PipelineConfig) -> tuple[str, ...]:
    return ("sft", "reward_model") if cfg.policy_optimisation.use_reward_model else ("sft",)


def _online(algorithm: str):
    def stage(ctx: StageContext) -> StageOutput:
        from verl_core.algorithms.grpo import GRPOTrainer, RLOOTrainer
        from verl_core.algorithms.ppo import PPOTrainer

        trainer_cls = {"ppo": PPOTrainer, "grpo": GRPOTrainer, "rloo": RLOOTrainer}[algorithm]
        prompts = _online_prompts(ctx.config)
        reward_model = ctx.input_path("reward_model") if ctx.section.use_reward_model else None
        return train_in_stage(
            ctx, trainer_cls, getattr(ctx.section, algorithm), source=f"policy_optimisation.{algorithm}",
            build=lambda config: trainer_cls(ctx.input_path("sft"), reward_model=reward_model, prompts=prompts,
                                             callbacks=ctx.callbacks, config=config),
            datasets=[DatasetUse(f"{algorithm}-prompts", prompts, "training", data_label(ctx.section.prompts, "prompts"))])

    stage.__name__ = f"{algorithm}_stage"
    return stage


for _name in OFFLINE_ALGORITHMS:
    register_stage(f"policy_optimisation:{_name}", version=f"{_name}-1", inputs=("sft", "preference_data"))(_offline(_name))
for _name in ONLINE_ALGORITHMS:
    register_stage(f"policy_optimisation:{_name}", version=f"{_name}-1", inputs=_online_inputs,
                   bundled=lambda cfg: _online_prompts(cfg) if cfg.policy_optimisation.prompts.path is None else None)(_online(_name))
