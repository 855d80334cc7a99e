"""Where does a step of the realistic bench go? One side, one algorithm, in this process, under torch.profiler.

    python bench/realistic_profile.py rm                   # ours, shape a, 3 steps, 1 thread
    python bench/realistic_profile.py grpo --side trl --threads 2 --top 30
    python bench/realistic_profile.py dpo --shape b --sort cpu_time_total
    python bench/realistic_profile.py dpo --shape smollm2 --steps 1 --threads 2 --memory   # what holds memory

Runs the same code as the bench (``bench/realistic_sides.py``) on the same rows, prints the time
from ``train()`` to each step end, the phases our GRPO logs (generation, update), and the top ops
by self CPU time over the whole ``train()`` (reference precompute and the first step included); with
``--memory``, the top ops by the memory they allocate and keep (torch.profiler's self CPU memory: what a
forward saves for its backward shows here) and the process's peak RSS.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from realistic_models import SHAPES, RealSpec  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("algo", choices=harness.ALGOS)
    ap.add_argument("--side", default="ours", choices=["ours", "trl", "trl-best"])
    ap.add_argument("--shape", default="a", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--sort", default="self_cpu_time_total", choices=["self_cpu_time_total", "cpu_time_total"])
    ap.add_argument("--memory", action="store_true", help="profile memory; sort by the memory each op keeps")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--cache-dir", default="")
    args = ap.parse_args(argv)
    spec = RealSpec(shape=args.shape, steps=args.steps, threads=args.threads, dtype=args.dtype, cache_dir=args.cache_dir,
                    trl_best=args.side == "trl-best")
    harness.prepare_torch(spec)
    import realistic_sides
    import torch
    from torch.profiler import ProfilerActivity, profile

    phases: list[dict] = []
    if args.side == "ours" and args.algo == "grpo":
        from verl_core.algorithms.online import OnlineTrainer

        step = OnlineTrainer.train_step

        def logged(self, i):
            metrics = step(self, i)
            phases.append({k: v for k, v in metrics.items() if k.startswith("perf/") and k.endswith("seconds")})
            return metrics

        OnlineTrainer.train_step = logged
    run = realistic_sides.run_ours if args.side == "ours" else realistic_sides.run_trl
    clock = harness.StepClock(spec.resolved_device())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=args.memory) as prof:
        info = run(args.algo, spec, clock)
    start = clock.marks["setup_done"]
    ends = [round(t - start, 2) for t in clock.ticks]
    print(f"{args.side} {args.algo}, shape {args.shape}, {args.threads} thread(s): step ends after train() {ends} s; "
          f"epoch {info['epoch_s']:.2f} s (reference precompute {info['precompute_s']:.2f} s)")
    for i, p in enumerate(phases):
        print(f"  step {i + 1}: " + ", ".join(f"{k.removeprefix('perf/')} {v:.2f}" for k, v in p.items()))
    print(f"settings: {info['features']}")
    if args.memory:
        import resource

        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB")
    print(prof.key_averages().table(sort_by="self_cpu_memory_usage" if args.memory else args.sort, row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
