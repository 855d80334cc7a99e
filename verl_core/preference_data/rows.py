"""Pairs, unpaired (KTO) and best-of-n rows from scored samples, and the reward statistics (pure Python)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from verl_core.preference_data.config import OUTPUT_KINDS, PreferenceDataConfig


def _as_completion(prompt: Any, text: str) -> Any:
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def build_rows(samples: list[dict], config: PreferenceDataConfig) -> tuple[dict[str, list[dict]], dict[str, int], dict[str, Any]]:
    """Pairs, unpaired (KTO) and best-of-n rows from shard records (grouped by ``prompt_index``, in order)."""
    groups: dict[int, list[dict]] = {}
    for s in samples:
        groups.setdefault(s["prompt_index"], []).append(s)
    rows: dict[str, list[dict]] = {k: [] for k in OUTPUT_KINDS}
    counts = dict(
        prompts=len(groups),
        samples=len(samples),
        blank_completions=0,
        duplicate_completions=0,
        truncated_completions=sum(not s["finished"] for s in samples),
        prompts_all_tie=0,
        prompts_below_margin=0,
        prompts_with_pairs=0,
    )
    all_tie: list[int] = []
    for index, group in groups.items():
        prompt, truth = group[0]["prompt"], group[0]["ground_truth"]
        base = {"prompt_index": index, "ground_truth": truth}
        if len({s["score"] for s in group}) == 1:
            all_tie.append(index)
        seen: set[str] = set()
        usable = []
        for s in group:
            if not s["completion"].strip():
                counts["blank_completions"] += 1
            elif s["completion"] in seen:
                counts["duplicate_completions"] += 1
            else:
                seen.add(s["completion"])
                usable.append(s)
        ranked = sorted(usable, key=lambda s: (-s["score"], -_tie_key(s, config), s["sample_index"]))
        pairs = _pairs(ranked, config)
        if pairs:
            counts["prompts_with_pairs"] += 1
        elif len({s["score"] for s in ranked}) > 1:
            counts["prompts_below_margin"] += 1
        for c, r in pairs:
            rows["pairs"].append(
                {
                    "prompt": prompt,
                    "chosen": _as_completion(prompt, c["completion"]),
                    "rejected": _as_completion(prompt, r["completion"]),
                    "chosen_score": c["score"],
                    "rejected_score": r["score"],
                    **base,
                }
            )
        mean = statistics.fmean(s["score"] for s in ranked) if ranked else 0.0
        for s in sorted(usable, key=lambda s: s["sample_index"]):
            if config.kto_labelling == "threshold":
                label: bool | None = s["score"] >= config.kto_threshold
            else:
                label = True if s["score"] > mean else False if s["score"] < mean else None
            if label is not None:
                rows["unpaired"].append(
                    {
                        "prompt": prompt,
                        "completion": _as_completion(prompt, s["completion"]),
                        "label": label,
                        "score": s["score"],
                        **base,
                    }
                )
        if ranked and (config.best_of_n_min_score is None or ranked[0]["score"] >= config.best_of_n_min_score):
            rows["best_of_n"].append(
                {
                    "prompt": prompt,
                    "completion": _as_completion(prompt, ranked[0]["completion"]),
                    "score": ranked[0]["score"],
                    **base,
                }
            )
    counts["prompts_all_tie"] = len(all_tie)
    counts.update({k: len(v) for k, v in rows.items()})
    counts["unpaired_desirable"] = sum(r["label"] for r in rows["unpaired"])
    counts["unpaired_undesirable"] = counts["unpaired"] - counts["unpaired_desirable"]
    stats = _reward_stats(samples, groups)
    stats.update(all_tie_prompts=len(all_tie), all_tie_prompt_indices=all_tie)
    return rows, counts, stats


def _tie_key(sample: dict, config: PreferenceDataConfig) -> float:
    """Among equal scores: the sequence log-prob (``tie_break="logprob"``), else nothing (sample order decides)."""
    return float(sample.get("logprob", 0.0)) if config.tie_break == "logprob" else 0.0


def _pairs(ranked: list[dict], config: PreferenceDataConfig) -> list[tuple[dict, dict]]:
    """(chosen, rejected) pairs of one prompt's usable samples, ``ranked`` best first."""
    if len(ranked) < 2:
        return []

    def ok(c: dict, r: dict) -> bool:
        gap = c["score"] - r["score"]
        return gap > 0 and gap >= config.min_margin

    if config.pairing == "best_worst":
        worst = min(ranked, key=lambda s: (s["score"], _tie_key(s, config), s["sample_index"]))
        return [(ranked[0], worst)] if ok(ranked[0], worst) else []
    found = [(c, r) for i, c in enumerate(ranked) for r in ranked[i + 1 :] if ok(c, r)]
    found.sort(key=lambda p: (-(p[0]["score"] - p[1]["score"]), p[0]["sample_index"], p[1]["sample_index"]))
    return found[: config.max_pairs_per_prompt] if config.max_pairs_per_prompt else found


def _mean_std(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values), "max": max(values)}


def _reward_stats(samples: list[dict], groups: dict[int, list[dict]]) -> dict[str, Any]:
    """Mean / population std / min / max of the total reward and each component, and of per-prompt bests."""
    names = sorted({n for s in samples for n in s["components"]})
    return {
        "reward": _mean_std([s["score"] for s in samples]),
        "components": {n: _mean_std([s["components"][n] for s in samples if n in s["components"]]) for n in names},
        "best_of_n_reward": _mean_std([max(s["score"] for s in g) for g in groups.values()]),
        "within_prompt_std": statistics.fmean(statistics.pstdev([s["score"] for s in g]) for g in groups.values())
        if groups
        else 0.0,
    }
