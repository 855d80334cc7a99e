"""Profile one side of one benchmark in this process: where does a step's time go?

    python bench/profile_one.py ours dpo --steps 3 --threads 1 [--dtype fp32] [--sort tottime] [--top 40]

Runs the same code as the benchmark (``bench/ours.py`` / ``bench/trl_side.py``) under cProfile
on a small slice of the rows, and prints the step times and the top functions.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("impl", choices=["ours", "trl"])
    ap.add_argument("algo", choices=harness.ALGOS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--sort", default="cumulative", choices=["cumulative", "tottime"])
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-packing", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="fp32 where the CPU has no fast bf16")
    ap.add_argument("--cache-dir", default="")
    args = ap.parse_args(argv)
    spec = dataclasses.replace(harness.BenchSpec(), rows=args.rows, warmup_steps=1, steps=args.steps, threads=args.threads,
                               cache_dir=args.cache_dir, packing=not args.no_packing, dtype=args.dtype)
    harness.prepare_torch(spec)
    clock = harness.StepClock(spec.resolved_device())
    if args.impl == "ours":
        import ours as side
    else:
        import trl_side as side
    prof = cProfile.Profile()
    prof.enable()
    side.run(args.algo, spec, clock)
    prof.disable()
    wall = [round(1000 * (b - a)) for a, b in zip(clock.ticks, clock.ticks[1:])]
    cpu = [round(1000 * (b - a)) for a, b in zip(clock.cpu_ticks, clock.cpu_ticks[1:])]
    print(f"step ms after the first: wall {wall}, cpu {cpu}")
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
