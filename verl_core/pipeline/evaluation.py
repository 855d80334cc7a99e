"""The evaluation stage: greedy held-out answers of the base, SFT and final policies, scored by a
rule (and the reward model when the pipeline has one); a table, a CSV, a plot, the model to register."""

from __future__ import annotations

import json
from pathlib import Path

from verl_core import arithmetic
from verl_core.pipeline.data import data_label, load_data
from verl_core.pipeline.records import DatasetUse, Stage, StageContext, StageOutput, Step
from verl_core.pipeline.report import plot_report, write_csv


def _bundled(cfg) -> list[dict] | None:
    c = cfg.evaluation
    return arithmetic.eval_rows(c.data.limit or c.num_rows)[: c.num_rows] if c.data.path is None else None


def score_policy(path: str, rows: list[dict], reward: str, max_new_tokens: int, reward_model: str | None) -> dict[str, float]:
    """Greedy answers of the policy at ``path``: mean rule reward, and mean reward-model score."""
    from verl_core.evaluation import answer_rewards
    from verl_core.models import load_causal_lm, load_tokenizer
    from verl_core.rewards.model import RewardModel

    texts, scores = answer_rewards(load_causal_lm(path, trainable=False), load_tokenizer(path), rows, reward, max_new_tokens)
    out = {"accuracy": sum(scores) / len(scores)}
    if reward_model is not None:
        out["reward_score"] = RewardModel.from_pretrained(reward_model).score([r["prompt"] for r in rows], texts).mean().item()
    return out


def evaluation_stage(ctx: StageContext) -> StageOutput:
    c = ctx.section
    rows = (_bundled(ctx.config) or load_data(c.data, None))[: c.num_rows]
    final = ctx.inputs.get("policy_optimisation") or ctx.inputs["sft"]
    policies = ([("base", ctx.inputs["base"])] if c.include_base else []) + [("sft", ctx.inputs["sft"]), ("final", final)]
    rm = ctx.inputs.get("reward_model")
    scored: dict[str, dict[str, float]] = {}
    table = []
    for label, rec in policies:
        if rec.fingerprint not in scored:
            scored[rec.fingerprint] = score_policy(
                rec.output_path, rows, c.reward, c.max_new_tokens, rm.output_path if rm else None
            )
        table.append({"policy": label, "stage": rec.stage, **scored[rec.fingerprint]})
    metrics = {f"{k}/{row['policy']}": row[k] for row in table for k in ("accuracy", "reward_score") if k in row}
    metrics["accuracy_gain"] = metrics["accuracy/final"] - metrics["accuracy/sft"]
    report = ctx.output_dir / "report"
    report.mkdir(exist_ok=True)
    (report / "results.json").write_text(json.dumps({"table": table, "metrics": metrics}, indent=2))
    write_csv(report / "evaluation.csv", table)
    curves = {
        r.stage: json.loads(Path(r.extra["history"]).read_text())
        for r in ctx.inputs.values()
        if r is not None and r.extra.get("history") and Path(r.extra["history"]).is_file()
    }
    plot = plot_report(table, curves, report / "accuracy.png")
    return StageOutput(
        output_path=report,
        metrics=metrics,
        tables={"evaluation": table},
        artifacts=[plot, report / "evaluation.csv", report / "results.json"],
        model_to_log=final.output_path,
        datasets=[DatasetUse("eval", rows, "evaluation", data_label(c.data, "eval"))],
        extra={"final_stage": final.stage, "final_path": final.output_path},
    )


STEP = Step(
    "evaluation",
    stages=[
        Stage(
            "evaluation",
            version="eval-1",
            fn=evaluation_stage,
            inputs=("base", "sft"),
            optional=("policy_optimisation", "reward_model"),
            bundled=_bundled,
        )
    ],
)
