"""The evaluation stage: greedy held-out answers of the base, SFT and final policies, scored by a
rule (and the reward model when the pipeline has one); a table, a CSV, a plot, the model to register.

With an agent environment (the chosen algorithm's ``environment``) the answers are greedy episodes
with its tools, and each policy's first episodes go to MLflow as a table artifact
(``agent_trajectories_<policy>.json``: turns, tool calls and results, errors, reward, transcript)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_core.bundled import arithmetic
from verl_core.pipeline.data import agent_environment, bundled_rows, data_label, load_data, prompt_rows, shaped_rows
from verl_core.pipeline.records import DatasetUse, Stage, StageContext, StageOutput, Step
from verl_core.pipeline.report import plot_report, write_csv
from verl_core.rollout.registry import RolloutConfig, build_rollout_backend, close_backend

log = logging.getLogger(__name__)
TRACE_SAMPLES = 8  # answers per evaluated policy written as MLflow traces (the Traces tab)


def _bundled(cfg) -> list[dict] | None:
    c = cfg.evaluation
    if c.data.path is not None:
        return None
    rows = bundled_rows(cfg, "eval_rows", c.data.limit or c.num_rows, arithmetic.eval_rows)[: c.num_rows]
    return shaped_rows(rows, c.data.chat, None, None, "evaluation.data")


@dataclass
class PolicyScores:
    """One policy's greedy answers to the held-out rows and what was measured on them."""

    metrics: dict[str, float]  # accuracy, reward_score, answer_tokens, agent/*
    answers: list[str]
    trajectory_columns: dict[str, list[Any]] | None  # agent episodes: the MLflow trajectory table
    trace_samples: list[dict]  # the first answers, written as MLflow traces
    reward_model_scores: list[float] | None  # per row: what the win rate compares


def score_policy(
    path: str,
    rows: list[dict],
    reward: str | None,
    max_new_tokens: int,
    reward_model: str | None,
    max_prompt_length: int = 256,
    rollout: RolloutConfig | None = None,
    agent=None,
) -> PolicyScores:
    """Greedy answers of the policy at ``path`` (sampled by the ``rollout`` backend, default hf): mean
    rule reward (``accuracy``), mean reward-model score (``reward_score``), and the answers. With
    ``agent`` (the algorithm section's :class:`~verl_core.agents.AgentSettings`), greedy episodes:
    the answers are the policy's text, and ``agent/*`` tool metrics and the trajectory table are added."""
    from verl_core.data import tokenize_prompts
    from verl_core.evaluation import answer_rewards
    from verl_core.modeling.loading import load_causal_lm, load_tokenizer
    from verl_core.rewards.model import RewardModel
    from verl_core.rollout.greedy import greedy_completions

    model, tok = load_causal_lm(path, trainable=False), load_tokenizer(path)
    backend = None
    if rollout is not None and not rollout.spec.shares_training_model:
        backend = build_rollout_backend(rollout, model, tok)
    out: dict[str, float] = {}
    scores: list[float | None] = [None] * len(rows)
    try:
        if agent is not None:
            return _score_episodes(model, tok, rows, reward, max_new_tokens, max_prompt_length, backend, agent)
        if reward is not None:
            texts, scores = answer_rewards(model, tok, rows, reward, max_new_tokens, max_prompt_length, backend)
            out["accuracy"] = sum(scores) / len(scores)
        else:
            examples = tokenize_prompts(rows, tok, max_prompt_length)
            texts = greedy_completions(model, tok, [e["prompt_ids"] for e in examples], max_new_tokens, backend=backend)
    finally:
        close_backend(backend)
    # length hacking shows here: a reward model's favourite answers are often just longer ones
    out["answer_tokens"] = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts) / max(len(texts), 1)
    rm_scores = None
    if reward_model is not None:
        rm_scores = RewardModel.from_pretrained(reward_model).score([r["prompt"] for r in rows], texts)
        out["reward_score"] = rm_scores.mean().item()
        scores = [s if s is not None else r for s, r in zip(scores, rm_scores.tolist())]
        rm_scores = rm_scores.tolist()
    samples = [
        {"prompt": row["prompt"], "completion": text, "reward": score, "ground_truth": row.get("ground_truth")}
        for row, text, score in list(zip(rows, texts, scores))[:TRACE_SAMPLES]
    ]
    return PolicyScores(out, texts, None, samples, rm_scores)


def _score_episodes(model, tok, rows, reward, max_new_tokens, max_prompt_length, backend, agent):
    from verl_core.agents import build_agent_loop, episode_metrics, episode_samples, evaluate_episodes, trajectory_table
    from verl_core.rollout.hf_backend import HFRolloutBackend

    loop = build_agent_loop(agent, tok, max_new_tokens)
    backend = backend or HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id)
    accuracy, scores, episodes = evaluate_episodes(
        backend, loop, rows, reward or "exact_match", max_new_tokens, max_prompt_length
    )
    texts = [tok.decode([t for t, m in zip(e.response, e.policy_mask) if m], skip_special_tokens=True) for e in episodes]
    out = {"accuracy": accuracy, **episode_metrics(episodes)}
    return PolicyScores(
        out, texts, trajectory_table(episodes, scores, tok), episode_samples(episodes, scores, tok, TRACE_SAMPLES), None
    )


def answer_samples(rows: list[dict], texts: list[str], reward: str | None, n: int = 20) -> list[dict]:
    """The first ``n`` answers of a policy beside the answer its reward's extractor reads in them."""
    from verl_core.rewards.gsm8k import ANSWER_EXTRACTORS, gsm8k_ground_truth

    extract = ANSWER_EXTRACTORS.get(reward or "")
    samples = []
    for row, text in list(zip(rows, texts))[:n]:
        sample = {"prompt": str(row["prompt"])[-200:], "completion": text[:300]}
        if extract is not None:
            sample["extracted"] = extract(text) or ""
            sample["expected"] = gsm8k_ground_truth(str(row.get("ground_truth", "")))
        samples.append(sample)
    return samples


def win_rate(final: list[float] | None, base: list[float] | None) -> dict[str, float]:
    """The reward model's win rate of the final policy's answers over the base model's, prompt by prompt
    (a tie counts one half), with a normal-approximation 95% interval over the prompts."""
    if not final or not base:
        return {}
    outcomes = [1.0 if f > b else 0.5 if f == b else 0.0 for f, b in zip(final, base)]
    n = len(outcomes)
    mean = sum(outcomes) / n
    half = 1.96 * (sum((o - mean) ** 2 for o in outcomes) / max(n - 1, 1) / n) ** 0.5
    return {
        "win_rate/final_vs_base": round(mean, 4),
        "win_rate/ci95_low": round(max(0.0, mean - half), 4),
        "win_rate/ci95_high": round(min(1.0, mean + half), 4),
        "win_rate/prompts": float(n),
    }


def _implicit_reward_accuracy(ctx: StageContext, rows: list[dict], final) -> dict[str, float]:
    """Held-out implicit-reward preference accuracy of a policy trained on pairs (DPO, KTO...): the share
    of held-out pairs where ``log π/π_ref`` is higher on the chosen answer than on the rejected one
    (``π_ref`` = the SFT policy, the trainers' reference), on the first ``implicit_reward_rows`` pairs."""
    from verl_core.algorithms.registry import ALGORITHMS
    from verl_core.evaluation import preference_margins
    from verl_core.modeling.loading import load_causal_lm, load_tokenizer

    algorithm = ALGORITHMS.get(ctx.config.policy_optimisation.algorithm)
    pairs = _held_out_pairs(rows, ctx.section.implicit_reward_rows)
    if not pairs or final.stage == "sft" or algorithm is None or algorithm.kind != "offline":
        return {}
    log.info("evaluation: implicit-reward accuracy of the final policy on %d held-out pairs", len(pairs))
    margins = []
    for path in (final.output_path, ctx.input_path("sft")):
        model, tok = load_causal_lm(path, trainable=False), load_tokenizer(path)
        margins.append(preference_margins(model, tok, _completions_only(pairs), batch_size=8, max_length=1024))
        del model
    return {"implicit_reward_accuracy/final": round(float((margins[0] > margins[1]).float().mean()), 4)}


def judge_accuracy(reward_model: str, rows: list[dict], n: int) -> dict[str, float]:
    """How far the win rate's judge can be trusted: the share of the first ``n`` held-out pairs of ``rows``
    on which the reward model at ``reward_model`` scores the chosen answer above the rejected one, read
    exactly as it reads the policies' answers (the prompt, then the answer alone)."""
    from verl_core.rewards.model import RewardModel

    pairs = _completions_only(_held_out_pairs(rows, n))
    if not pairs:
        return {}
    log.info("evaluation: the reward model's own accuracy on %d held-out pairs", len(pairs))
    judge = RewardModel.from_pretrained(reward_model)
    prompts = [p["prompt"] for p in pairs]
    chosen = judge.score(prompts, [_answer_text(p["chosen"]) for p in pairs])
    rejected = judge.score(prompts, [_answer_text(p["rejected"]) for p in pairs])
    return {
        "reward_model_accuracy/held_out": round(float((chosen > rejected).float().mean()), 4),
        "reward_model_accuracy/pairs": float(len(pairs)),
    }


def _held_out_pairs(rows: list[dict], n: int) -> list[dict]:
    """The first ``n`` evaluation rows that carry a chosen and a rejected answer."""
    return [r for r in rows if r.get("chosen") is not None and r.get("rejected") is not None][:n]


def _answer_text(answer: str | list[dict]) -> str:
    """A held-out answer as the text a policy would have written: a chat pair's answer is the assistant's
    message(s) after the prompt, which the reward model reads after the chat-rendered prompt."""
    return answer if isinstance(answer, str) else "\n\n".join(m["content"] for m in answer)


def _completions_only(pairs: list[dict]) -> list[dict]:
    """Pairs whose chosen/rejected hold only the answer after the prompt (as the trainers read them):
    an implicit-prompt pair (HH) repeats its prompt at the start of both."""
    out = []
    for r in pairs:
        p, n = r["prompt"], len(r["prompt"])
        if r["chosen"][:n] == p and r["rejected"][:n] == p:
            r = {"prompt": p, "chosen": r["chosen"][n:], "rejected": r["rejected"][n:]}
        out.append({k: r[k] for k in ("prompt", "chosen", "rejected")})
    return out


def evaluation_stage(ctx: StageContext) -> StageOutput:
    c = ctx.section
    rows = prompt_rows((_bundled(ctx.config) or load_data(c.data, None, "evaluation.data"))[: c.num_rows])
    final = ctx.inputs.get("policy_optimisation") or ctx.inputs["sft"]
    policies = ([("base", ctx.inputs["base"])] if c.include_base else []) + [("sft", ctx.inputs["sft"]), ("final", final)]
    rm = ctx.inputs.get("reward_model")
    agent = (
        getattr(ctx.config.policy_optimisation, ctx.config.policy_optimisation.algorithm)
        if agent_environment(ctx.config)
        else None
    )
    scored: dict[str, PolicyScores] = {}
    table, trajectories = [], []
    report = ctx.output_dir / "report"
    report.mkdir(exist_ok=True)
    for label, rec in policies:
        if rec.fingerprint not in scored:
            # a real model's evaluation takes minutes per policy: say what is being scored, then its numbers
            log.info("evaluation: greedy answers of the %s policy to %d held-out prompts", label, len(rows))
            started = time.perf_counter()
            scored[rec.fingerprint] = score_policy(
                rec.output_path,
                rows,
                c.reward,
                c.max_new_tokens,
                rm.output_path if rm else None,
                c.max_prompt_length,
                c.rollout,
                agent,
            )
            numbers = ", ".join(f"{k}={v:.4g}" for k, v in scored[rec.fingerprint].metrics.items() if isinstance(v, float))
            log.info("evaluation: %s policy scored in %.0f s: %s", label, time.perf_counter() - started, numbers)
        table.append({"policy": label, "stage": rec.stage, **scored[rec.fingerprint].metrics})
        if agent is not None:  # MLflow's table-artifact layout (what MlflowClient.log_table writes)
            columns = scored[rec.fingerprint].trajectory_columns
            path = report / f"agent_trajectories_{label}.json"
            path.write_text(json.dumps({"columns": list(columns), "data": [list(r) for r in zip(*columns.values())]}, indent=1))
            trajectories.append(path)
    metrics = {
        f"{k}/{row['policy']}": row[k]
        for row in table
        for k in row
        if k in ("accuracy", "reward_score", "answer_tokens") or k.startswith("agent/")
    }
    if c.include_base:
        metrics.update(
            win_rate(scored[final.fingerprint].reward_model_scores, scored[ctx.inputs["base"].fingerprint].reward_model_scores)
        )
    metrics.update(_implicit_reward_accuracy(ctx, rows, final))
    if rm is not None:
        metrics.update(judge_accuracy(rm.output_path, rows, c.implicit_reward_rows))
    if "accuracy/final" in metrics:
        metrics["accuracy_gain"] = round(metrics["accuracy/final"] - metrics["accuracy/sft"], 6)  # 0.08 - 0.06 shows as 0.02
    samples = answer_samples(rows, scored[final.fingerprint].answers, c.reward)
    traces = {f"evaluation {label}": scored[rec.fingerprint].trace_samples for label, rec in policies}
    (report / "results.json").write_text(json.dumps({"table": table, "metrics": metrics}, indent=2))
    (report / "final_answers.json").write_text(json.dumps(samples, indent=2))
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
        tables={"evaluation": table, "final_answers": samples},
        artifacts=[plot, report / "evaluation.csv", report / "results.json", report / "final_answers.json", *trajectories],
        model_to_log=final.output_path,
        datasets=[DatasetUse("eval", rows, "evaluation", data_label(c.data, "eval"))],
        traces=traces,
        extra={"final_stage": final.stage, "final_path": final.output_path},
    )


STEP = Step(
    "evaluation",
    stages=[
        Stage(
            "evaluation",
            version="eval-3",
            fn=evaluation_stage,
            inputs=("base", "sft"),
            optional=("policy_optimisation", "reward_model"),
            bundled=_bundled,
        )
    ],
)
