"""Asynchronous RL benchmark: GRPO with rollout workers apart from the trainer vs the synchronous loop.

    python bench/async_rl.py                                  # SFT base built here, seeds 0,1,2, 200 steps
    python bench/async_rl.py --sft-path DIR --seeds 0 --steps 60

For each seed and mode (``sync``: ``async_rollout.max_staleness=0``, today's loop with torch's default
threads; ``async1`` and ``async2``: max_staleness 1 and 2 with the async defaults: one worker process
with one torch thread, the trainer with one, the worker's sampled log-probs as the old ones, the
trainer sampling in-process while the worker starts) a fresh copy of the SFT policy of the bundled
arithmetic task is trained with GRPO for the same number of updates and the same seed, then scored
with greedy exact match on held-out problems. The recipe is GRPOConfig's defaults (64 samples = 8
prompts x 8, one update per step, no KL) at lr 1e-4 and 24 new tokens; ``--shape group`` takes
bench/online_rl.py's GROUP shape instead (128 samples, 2 epochs x 2 mini-batches = 4 updates per step).
Reported per mode: wall seconds of ``train()`` (worker start-up included), samples per second
(``batch_size * steps / wall``), the same after step 1, final held-out accuracy (mean and range over
seeds), mean staleness and the steps the trainer sampled itself while the worker started.

Exit 1 when async at staleness 1 is below ``--speedup`` (default 1.3) times the synchronous
samples/s, or its mean accuracy is more than ``--reward-tolerance`` below the synchronous one
(0.05 = 10 of 200 held-out problems, about the standard error of one 200-row accuracy at 0.5 plus
the seed spread measured here).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from online_rl import GROUP, add_base_arguments, prepare_base  # noqa: E402

MODES = {"sync": 0, "async1": 1, "async2": 2}
COMMON = dict(learning_rate=1e-4, mixed_precision="auto", max_new_tokens=24, progress=False, logging_steps=1)
SHAPES = {
    "defaults": dict(COMMON),  # GRPOConfig's batch_size 64, num_generations 8, one update per step
    "group": dict(GROUP, **COMMON),
}


def run(mode: str, base: Path, seed: int, steps: int, eval_rows: list[dict], shape: dict, threads: int) -> dict[str, float]:
    import torch

    from verl_core.algorithms.grpo import GRPOTrainer
    from verl_core.bundled import arithmetic
    from verl_core.evaluation import answer_accuracy
    from verl_core.policies import LLMPolicy
    from verl_core.train.callbacks import Callback

    class Staleness(Callback):
        values: list[float] = []
        first_step_end = 0.0
        in_process = 0.0

        def on_log(self, step, metrics):
            if "async/staleness" in metrics:
                self.values.append(metrics["async/staleness"])
                self.in_process = metrics.get("async/in_process_steps", 0.0)

        def on_step_end(self, step):
            if step == 1:
                self.first_step_end = time.perf_counter()

    seen = Staleness()
    seen.values = []
    torch.set_num_threads(threads)  # the synchronous loop's; the async path sets its own (async_rollout.*_threads)
    policy = LLMPolicy.from_pretrained(base)
    settings = {**shape, "seed": seed, "max_steps": steps, "async_rollout": {"max_staleness": MODES[mode]}}
    trainer = GRPOTrainer(policy=policy, prompts=arithmetic.prompt_rows(2048), callbacks=[seen], **settings)
    start = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - start
    torch.set_num_threads(threads)
    batch_size = trainer.config.batch_size
    accuracy = answer_accuracy(trainer.policy_lm(trainer.engine.unwrapped), trainer.policy.tokenizer, eval_rows)
    return {
        "wall": wall,
        "samples_per_s": batch_size * result.steps / wall,
        # steps 2..N only: without the worker's start-up (spawn, imports, building its copy: ~5-10 s here)
        "steady_samples_per_s": batch_size * (result.steps - 1) / (start + wall - seen.first_step_end),
        "accuracy": accuracy,
        "staleness": sum(seen.values) / len(seen.values) if seen.values else 0.0,
        "updates": float(trainer.engine.optimizer_steps),
        "in_process": seen.in_process,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_base_arguments(parser, threads=len(os.sched_getaffinity(0)))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--modes", default="sync,async1,async2", help=f"comma-separated, from {sorted(MODES)}")
    parser.add_argument("--steps", type=int, default=200, help="rollout steps (one update each; --shape group: 4)")
    parser.add_argument("--eval-rows", type=int, default=200)
    parser.add_argument("--shape", default="defaults", choices=sorted(SHAPES), help="the GRPO recipe's batch shape")
    parser.add_argument("--speedup", type=float, default=1.3, help="async1 samples/s over sync, at least")
    parser.add_argument("--reward-tolerance", type=float, default=0.05)
    args = parser.parse_args(argv)

    _, base = prepare_base(args, "async-rl-bench-")
    from verl_core.bundled import arithmetic

    eval_rows = arithmetic.eval_rows(args.eval_rows)
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES) or "sync" not in modes:
        parser.error(f"--modes must include sync and come from {sorted(MODES)}")
    load = os.getloadavg()
    print(
        f"base {base}; seeds {seeds}; {args.steps} steps of shape {args.shape} {SHAPES[args.shape]}; sync with "
        f"{args.threads} threads; load average at start {load[0]:.2f}",
        flush=True,
    )
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for seed in seeds:
        for mode in modes:
            r = run(mode, base, seed, args.steps, eval_rows, SHAPES[args.shape], args.threads)
            results[mode].append(r)
            print(
                f"seed {seed} {mode}: {r['wall']:.0f}s, {r['samples_per_s']:.1f} samples/s "
                f"({r['steady_samples_per_s']:.1f} after step 1), accuracy {r['accuracy']:.3f}, "
                f"staleness {r['staleness']:.2f}, {r['in_process']:.0f} steps sampled in-process while the worker "
                f"started, {r['updates']:.0f} updates, load {os.getloadavg()[0]:.2f}",
                flush=True,
            )

    def mean(mode: str, key: str) -> float:
        return sum(r[key] for r in results[mode]) / len(results[mode])

    sync_sps, sync_acc = mean("sync", "samples_per_s"), mean("sync", "accuracy")
    print()
    steady = mean("sync", "steady_samples_per_s")
    print(f"{'mode':<8}{'wall s':>8}{'samples/s':>11}{'speed-up':>10}{'steady/s':>10}{'speed-up':>10}", end="")
    print(f"{'accuracy':>10}{'range':>15}{'staleness':>11}{'in-process':>12}")
    for m in modes:
        accs = [r["accuracy"] for r in results[m]]
        st = mean(m, "steady_samples_per_s")
        print(
            f"{m:<8}{mean(m, 'wall'):>8.0f}{mean(m, 'samples_per_s'):>11.1f}{mean(m, 'samples_per_s') / sync_sps:>9.2f}x"
            f"{st:>10.1f}{st / steady:>9.2f}x"
            f"{mean(m, 'accuracy'):>10.3f}{f'{min(accs):.3f}-{max(accs):.3f}':>15}{mean(m, 'staleness'):>11.2f}"
            f"{mean(m, 'in_process'):>12.1f}"
        )
    print(f"load average at end {os.getloadavg()[0]:.2f} (2 cores)")
    if "async1" not in modes:
        return 0
    speedup = mean("async1", "samples_per_s") / sync_sps
    gap = sync_acc - mean("async1", "accuracy")
    misses = []
    if speedup < args.speedup:
        misses.append(f"async1 is {speedup:.2f}x the synchronous samples/s, below {args.speedup:.2f}x")
    if gap > args.reward_tolerance:
        misses.append(f"async1 accuracy is {gap:.3f} below sync, more than {args.reward_tolerance:.3f}")
    if misses:
        print("\nFAIL: " + "; ".join(misses))
        return 1
    print(f"\nOK: async1 {speedup:.2f}x the synchronous samples/s, accuracy within {args.reward_tolerance:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
