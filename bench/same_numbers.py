"""Same numbers before and after a change of structure: short trainings of every offline algorithm and GRPO
through the public API, run on this tree and on another commit (a ``git worktree``), compared step by step.

    python bench/same_numbers.py --against 03c3eff    # exits 1 when a logged metric differs (perf/* aside)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = r"""
import json, tempfile, torch
torch.set_num_threads(1)
from verl_core import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, SFTTrainer, arithmetic, tiny_model_path
tiny, q = str(tiny_model_path()), dict(progress=False, logging_steps=1, mixed_precision="no")
out = {}
with tempfile.TemporaryDirectory() as d:
    out["sft"] = SFTTrainer(tiny, train_dataset=arithmetic.sft_rows(64), batch_size=8, max_steps=6, output_dir=f"{d}/s", **q).train().history
    pairs = arithmetic.preference_rows(arithmetic.train_problems(32))
    for name, cls in (("dpo", DPOTrainer), ("rm", RewardTrainer), ("kto", KTOTrainer)):
        out[name] = cls(tiny, train_dataset=pairs, batch_size=8, max_steps=4, output_dir=f"{d}/{name}", **q).train().history
    out["grpo"] = GRPOTrainer(tiny, prompts=arithmetic.prompt_rows(64), batch_size=16, max_steps=2, output_dir=f"{d}/g", **q).train().history
print("RESULT " + json.dumps(out))
"""


def run(tree: Path) -> dict:
    env = {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", PROGRAM], cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the run in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", required=True, help="the commit to compare with")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        other = Path(d) / "other"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(other), args.against], cwd=ROOT, check=True)
        try:
            before, after = run(other), run(ROOT)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)
    print("| algorithm | metric series compared | identical |\n|---|---|---|")
    bad = 0
    for name in before:
        keys = [k for k in before[name] if not k.startswith("perf/")]
        same = all(before[name][k] == after[name].get(k) for k in keys)
        bad += not same
        print(
            f"| {name} | {len(keys)} | {'yes' if same else 'NO: ' + ', '.join(k for k in keys if before[name][k] != after[name].get(k))} |"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
