"""kill -9 trials: a pipeline run killed at varied moments, then rerun, ends exactly like a run never killed.

One uninterrupted run (a small pipeline: SFT, bundled preference data, reward model, DPO, evaluation) gives
the reference: the final policy's content fingerprint and its held-out accuracy. Each trial starts the same
run in a fresh workdir, sends SIGKILL to the whole process group after a delay spread over the reference's
duration (from Prefect's start-up to registration), reruns it to completion, and checks: the final policy is
bitwise the reference's, no MLflow run is left RUNNING, one registered model version, no partial folder
(``.tmp-*`` or a model folder under its temporary name), no lock left.

    python bench/kill_trials.py [--trials 10]     # prints the table; exits 1 when a trial misses
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [
    "sft.max_steps=40",
    "sft.save_steps=10",
    "sft.progress=false",
    "reward_model.max_steps=30",
    "reward_model.save_steps=10",
    "reward_model.progress=false",
    "policy_optimisation.algorithm=dpo",
    "policy_optimisation.dpo.max_steps=30",
    "policy_optimisation.dpo.save_steps=10",
    "policy_optimisation.dpo.progress=false",
    "evaluation.num_rows=64",
    "sft.mixed_precision=no",
    "reward_model.mixed_precision=no",
    "policy_optimisation.dpo.mixed_precision=no",
]


def start(workdir: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(workdir.parent / f"{workdir.name}-prefect")}
    args = [a for s in [*SETTINGS, f"workdir={workdir}"] for a in ("--set", s)]
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the kill reaches the Prefect server child too
    )


def finish(workdir: Path) -> tuple[int, float, str]:
    began = time.monotonic()
    proc = start(workdir)
    out, _ = proc.communicate(timeout=3600)
    return proc.returncode, time.monotonic() - began, out


def state(workdir: Path) -> dict:
    from mlflow import MlflowClient

    records = {}
    for rec in (workdir / "stages").glob("*/record.json"):
        data = json.loads(rec.read_text())
        records[data["stage"]] = data
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    versions = client.search_model_versions()
    partial = [str(p.relative_to(workdir)) for p in (workdir / "stages").rglob(".tmp-*")]
    partial += [str(p.relative_to(workdir)) for p in (workdir / "stages").rglob(".final*-*")]
    return {
        "policy": records.get("policy_optimisation", {}).get("fingerprint"),
        "accuracy": records.get("evaluation", {}).get("metrics", {}).get("accuracy/final"),
        "running": sum(r.info.status == "RUNNING" for r in runs),
        "versions": len(versions),
        "partial": partial,
        "lock": (workdir / ".lock").exists(),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        code, duration, out = finish(tmp / "reference")
        if code != 0:
            print(out[-3000:])
            return 2
        ref = state(tmp / "reference")
        print(f"reference: {duration:.0f} s, policy {ref['policy'][:12]}, accuracy {ref['accuracy']}", flush=True)
        rows, misses = [], 0
        for i in range(args.trials):
            delay = duration * (0.08 + 0.88 * i / max(1, args.trials - 1))  # from start-up to the end
            workdir = tmp / f"trial{i}"
            proc = start(workdir)
            time.sleep(delay)
            killed = proc.poll() is None
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            at = _last_stage(workdir)
            code, took, out = finish(workdir)
            s = state(workdir)
            ok = (
                code == 0
                and s["policy"] == ref["policy"]
                and s["running"] == 0
                and s["versions"] == 1
                and not s["partial"]
                and not s["lock"]
            )
            misses += not ok
            rows.append((i, delay, killed, at, code, took, s, ok))
            print(f"trial {i}: killed at {delay:.0f} s ({at}), rerun {took:.0f} s, ok={ok} {s if not ok else ''}", flush=True)
    print(
        "\n| trial | killed after | stage at the kill | rerun | final policy = reference | RUNNING runs | model versions | partial folders | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i, delay, killed, at, code, took, s, ok in rows:
        print(
            f"| {i} | {delay:.0f} s{'' if killed else ' (had ended)'} | {at} | exit {code}, {took:.0f} s | "
            f"{s['policy'] == ref['policy']} | {s['running']} | {s['versions']} | {len(s['partial'])} | {'yes' if ok else 'NO'} |"
        )
    print(f"\n{len(rows) - misses}/{len(rows)} trials ended exactly like the uninterrupted run")
    return 1 if misses else 0


def _last_stage(workdir: Path) -> str:
    """The newest stage folder at the kill (what was being written)."""
    folders = sorted((workdir / "stages").glob("*"), key=lambda p: p.stat().st_mtime) if (workdir / "stages").is_dir() else []
    if not folders:
        return "before any stage"
    last = folders[-1]
    done = (last / "record.json").is_file()
    return last.name.rsplit("-", 1)[0] + ("" if not done else " (done)")


if __name__ == "__main__":
    sys.exit(main())
