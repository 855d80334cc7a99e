"""The preference-data stage, two variants: the bundled task's pairs, or pairs sampled from the
SFT policy and scored (``sample_and_score``)."""

from __future__ import annotations

import json

from verl_core.bundled import arithmetic
from verl_core.config import ConfigError
from verl_core.pipeline.data import data_label, load_data
from verl_core.pipeline.records import DatasetUse, Stage, StageContext, StageOutput, Step


def _bundled_pairs(cfg) -> list[dict]:
    c = cfg.preference_data
    return arithmetic.preference_rows(arithmetic.prompt_problems(c.num_prompts), seed=c.seed)


def bundled_stage(ctx: StageContext) -> StageOutput:
    rows = _bundled_pairs(ctx.config)
    data = ctx.output_dir / "data"
    data.mkdir(exist_ok=True)
    with open(data / "pairs.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return StageOutput(
        output_path=data,
        metrics={"pairs": len(rows)},
        datasets=[DatasetUse("preference-pairs", rows, "output", "bundled:arithmetic/pairs")],
    )


def _prompts(cfg) -> list[dict]:
    c = cfg.preference_data
    return load_data(c.prompts, lambda limit: arithmetic.prompt_rows(limit or c.num_prompts), "preference_data.prompts")[
        : c.num_prompts
    ]


def sample_and_score_stage(ctx: StageContext) -> StageOutput:
    """Sample ``n_samples`` answers per prompt from the SFT policy, score them, pair best vs worst.

    Shards finished before an interruption are reused (same folder, same key), so a retried
    stage only samples what is missing.
    """
    from verl_core.data import load_rows
    from verl_core.preference_data import generate_preference_data

    c = ctx.section
    prompts = _prompts(ctx.config)
    result = generate_preference_data(ctx.input_path("sft"), prompts, c.sample_and_score, ctx.output_dir / "data")
    pairs = load_rows(str(result.paths["pairs"])).to_list()
    if not pairs:
        raise ConfigError(
            f"sample_and_score made no pairs from {len(prompts)} prompts (every prompt's samples tied); "
            "raise preference_data.sample_and_score.n_samples or the sampling temperature"
        )
    stats = {k: float(v) for k, v in result.stats.items() if isinstance(v, (int, float))}
    return StageOutput(
        output_path=ctx.output_dir / "data",
        metrics={"pairs": len(pairs), **stats},
        datasets=[
            DatasetUse("prompts", prompts, "training", data_label(c.prompts, "prompts")),
            DatasetUse("preference-pairs", pairs, "output", str(result.paths["pairs"])),
        ],
    )


STEP = Step(
    "preference_data",
    given_field="path",
    selector="method",
    stages=[
        Stage("preference_data:bundled", version="pairs-1", fn=bundled_stage, bundled=_bundled_pairs),
        Stage(
            "preference_data:sample_and_score",
            version="sample-1",
            fn=sample_and_score_stage,
            inputs=("sft",),
            bundled=lambda cfg: _prompts(cfg) if cfg.preference_data.prompts.path is None else None,
        ),
    ],
)
