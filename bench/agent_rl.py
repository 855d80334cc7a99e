"""Agentic RL benchmark: does RL with the calculator tool raise held-out exact match on the bundled agent task?

    python bench/agent_rl.py                                  # SFT built here, seeds 0 1 2
    python bench/agent_rl.py --sft-path DIR --seeds 0 1 2 3 --eval-rows 200

Task: ``calculator_arithmetic`` (:mod:`verl_core.agents.tasks`, ``a * b ± c`` word problems). The SFT
policy (``tasks.SFT_RECIPE`` on ``tasks.sft_rows(3000)``: 30% tool episodes, 70% direct answers) is
scored with greedy episodes on ``tasks.eval_rows(--eval-rows)``; then, per seed, from that policy:

- ``grpo + calculator``, ``rloo + calculator``: ``tasks.RL_RECIPE`` (15 rollout steps of 16 prompts x 4
  episodes, lr 1e-4) with ``environment=calculator_arithmetic``, evaluated by greedy episodes;
- ``grpo, no tools``: the same run on the same prompts without the environment (a tool call is then
  the episode's last word and scores 0), evaluated by greedy single-turn answers.

Prints the table (mean, min, max over seeds and each seed's score) and exits 1 when the worst seed of a
tool run is below ``SFT + --target`` or below ``the best no-tool seed + --target``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENV = "calculator_arithmetic"


def build_sft(out: Path) -> Path:
    from verl_core.agents import tasks
    from verl_core.algorithms.sft import SFTTrainer
    from verl_core.bundled.tiny_model import tiny_model_path

    SFTTrainer(
        str(tiny_model_path()), train_dataset=tasks.sft_rows(3000), **tasks.SFT_RECIPE, mixed_precision="no",
        progress=False, logging_steps=100, output_dir=str(out),
    ).train()  # fmt: skip
    return out / "model"


def sft_accuracy(path: Path, rows: list[dict]) -> float:
    from verl_core.agents import AgentSettings, build_agent_loop, evaluate_episodes
    from verl_core.modeling.loading import load_causal_lm, load_tokenizer
    from verl_core.rollout.hf_backend import HFRolloutBackend

    model, tok = load_causal_lm(path, trainable=False), load_tokenizer(path)
    loop = build_agent_loop(AgentSettings(environment=ENV), tok, 48)
    return evaluate_episodes(HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id), loop, rows, "exact_match", 48)[0]


def rl_accuracy(path: Path, algorithm: str, tools: bool, seed: int, rows: list[dict]) -> tuple[float, float]:
    from verl_core.agents import tasks
    from verl_core.algorithms.grpo import GRPOTrainer, RLOOTrainer

    trainer_cls = {"grpo": GRPOTrainer, "rloo": RLOOTrainer}[algorithm]
    extra = dict(environment=ENV) if tools else dict(prompts=tasks.prompt_rows(512))
    t0 = time.perf_counter()
    result = trainer_cls(
        str(path), **tasks.RL_RECIPE, mixed_precision="no", progress=False, logging_steps=5, seed=seed, eval_prompts=rows, **extra
    ).train()
    return result.metrics["eval/accuracy"], time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-path", help="an SFT policy folder (default: build one with tasks.SFT_RECIPE)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-rows", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.5, help="least gain of the worst tool seed")
    args = parser.parse_args()

    import torch

    from verl_core.agents import tasks

    torch.set_num_threads(args.threads)
    rows = tasks.eval_rows(args.eval_rows)
    t0 = time.perf_counter()
    sft = Path(args.sft_path) if args.sft_path else build_sft(Path(tempfile.mkdtemp(prefix="agent-rl-")) / "sft")
    sft_seconds = time.perf_counter() - t0
    base = sft_accuracy(sft, rows)
    runs = {
        "grpo + calculator": ("grpo", True),
        "rloo + calculator": ("rloo", True),
        "grpo, no tools": ("grpo", False),
    }
    scores: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    for label, (algorithm, tools) in runs.items():
        for seed in args.seeds:
            acc, wall = rl_accuracy(sft, algorithm, tools, seed, rows)
            scores.setdefault(label, []).append(acc)
            seconds.setdefault(label, []).append(wall)
            print(f"{label} seed {seed}: {acc:.3f} ({wall:.0f} s)", flush=True)
    no_tools = max(scores["grpo, no tools"])
    origin = args.sft_path or f"built here in {sft_seconds:.0f} s"
    print(
        f"\nAgentic RL on {ENV}: held-out exact match of greedy episodes on {args.eval_rows} problems; SFT "
        f"{base:.3f} ({origin}); "
        f"seeds {' '.join(map(str, args.seeds))}; torch threads {args.threads}\n"
    )
    print("| run | mean | min | max | per seed | gain over SFT (worst seed) | wall s per run | verdict |")
    print("|---|---:|---:|---:|---|---:|---:|---|")
    print(f"| SFT policy | {base:.3f} | | | | | | |")
    failed = False
    for label, values in scores.items():
        worst = min(values)
        verdict = ""
        if label.endswith("calculator"):
            ok = worst >= base + args.target and worst >= no_tools + args.target
            failed |= not ok
            verdict = "PASS" if ok else f"FAIL (target: SFT + {args.target} and no tools + {args.target})"
        per_seed = " / ".join(f"{v:.3f}" for v in values)
        print(
            f"| {label} | {statistics.mean(values):.3f} | {worst:.3f} | {max(values):.3f} | {per_seed} | "
            f"{worst - base:+.3f} | {statistics.mean(seconds[label]):.0f} | {verdict} |"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
