"""Online preference optimisation in rounds against single-round DPO, through the pipeline's own
stage code (no Prefect): from the same SFT policy of the bundled task, run ``policy_optimisation``
with each algorithm and score greedy held-out exact match.

    .venv/bin/python bench/rounds.py [--sft-path DIR] [--algorithms dpo,iterative_dpo,rft] [--seed 0]

Each algorithm uses the pipeline's recipe (verl_core/pipeline/config.py:RECIPE) in fp32. Prints a
table; exits 1 when a rounds algorithm gains less than single-round DPO.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_rl import add_base_arguments, prepare_base  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(parser, threads=2)
    parser.add_argument("--algorithms", default="dpo,iterative_dpo,rft")
    parser.add_argument("--eval-rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="pipeline override, e.g. policy_optimisation.rft.rounds=2")
    args = parser.parse_args(argv)
    out, base = prepare_base(args, "verl-rounds-")

    from verl_core.bundled import arithmetic
    from verl_core.data.fingerprint import fingerprint_path
    from verl_core.pipeline import load_pipeline_config, run_stage
    from verl_core.pipeline.evaluation import score_policy
    from verl_core.pipeline.records import StageRecord
    from verl_core.pipeline.runner import run_all_rounds

    rows = arithmetic.eval_rows(args.eval_rows)
    before = score_policy(str(base), rows, "exact_match", 32, None).metrics["accuracy"]
    sft = StageRecord(stage="sft", output_path=str(base), fingerprint=fingerprint_path(base), given=True)
    table = []
    for name in args.algorithms.split(","):
        overrides = [
            f"workdir={out / 'work'}",
            f"policy_optimisation.algorithm={name}",
            f"policy_optimisation.{name}.seed={args.seed}",
            f"policy_optimisation.{name}.mixed_precision=no",
            f"policy_optimisation.{name}.progress=false",
            *args.set,
        ]
        cfg = load_pipeline_config(None, overrides)
        start = time.monotonic()
        pairs = run_stage(cfg, "preference_data", {}).record if name == "dpo" else None
        rec = run_all_rounds(cfg, "policy_optimisation", {"sft": sft, "preference_data": pairs}).record
        after = score_policy(rec.output_path, rows, "exact_match", 32, None).metrics["accuracy"]
        table.append(
            {"algorithm": name, "before": before, "after": after, "gain": after - before, "seconds": time.monotonic() - start}
        )
        print(f"{name}: {before:.3f} -> {after:.3f} ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"\nheld-out exact match on {len(rows)} problems, from the SFT policy {base} (seed {args.seed}, fp32):")
    print("| algorithm | before | after | gain | wall s |\n|---|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['algorithm']} | {r['before']:.3f} | {r['after']:.3f} | {r['gain']:+.3f} | {r['seconds']:.0f} |")
    dpo = next((r["gain"] for r in table if r["algorithm"] == "dpo"), None)
    misses = [r["algorithm"] for r in table if dpo is not None and r["algorithm"] != "dpo" and r["gain"] < dpo]
    if misses:
        print(f"MISS: {', '.join(misses)} gained less than single-round DPO ({dpo:+.3f})")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
