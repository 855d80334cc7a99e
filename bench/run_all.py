"""verl_core vs TRL, side by side: SFT, reward model, DPO, KTO, GRPO.

    python bench/run_all.py                 # full run (≈ 5-10 min on 2 quiet cores)
    python bench/run_all.py --only dpo,kto  # a subset
    python bench/run_all.py --quick         # smoke: few rows and steps
    python bench/run_all.py --no-trl        # our side only (TRL not needed)

Every run (each algorithm × {ours, TRL}, and the matmul peak) is its own child process, one
after the other. Prints a markdown table and writes it to bench/results/latest.md (raw records
to latest.json). Exit code: 0 every target met, 1 a target missed (the table says by how much),
2 a run failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import ALGOS, BenchSpec  # noqa: E402
from threads import resolve_threads  # noqa: E402

SMALL_MODEL = {"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 3,
               "num_key_value_heads": 1}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(ALGOS), help=f"comma-separated subset of {','.join(ALGOS)}")
    ap.add_argument("--quick", action="store_true", help="smoke mode: 64 rows, 1 warm-up + 2 timed steps")
    ap.add_argument("--small", action="store_true", help="the verl_core default tiny model instead of the bench model (tests)")
    ap.add_argument("--no-trl", action="store_true", help="run our side only")
    ap.add_argument("--steps", type=int, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default 2)")
    ap.add_argument("--rows", type=int, help="dataset rows (default 512)")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--no-packing", action="store_true")
    ap.add_argument("--no-share-prompt", action="store_true")
    ap.add_argument("--no-prune-last-layer", action="store_true", help="run the last decoder layer at every position")
    ap.add_argument("--row-capacity", default="auto",
                    help="tokens per packed row: a number, 'longest' (the longest unit), 'none' (one row) or 'auto' "
                         "(longest on CPU, one row on GPU)")
    ap.add_argument("--no-fp32-attention", action="store_true", help="keep SDPA in bf16 under CPU autocast")
    ap.add_argument("--no-precompute", action="store_true", help="our DPO/KTO score the reference every step")
    ap.add_argument("--trl-precompute", action="store_true", help="TRL DPO/KTO with precompute_ref_log_probs=True")
    ap.add_argument("--threads", help="torch threads per run: a number, or 'auto' (1 when other processes keep the "
                                      "CPU busy; bench/threads.py); default torch's (1 is steadier on a busy machine)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="cpu: time runs by process CPU time (a busy machine; use with --threads 1)")
    ap.add_argument("--cache-dir", default=os.environ.get("VERL_CORE_CACHE", ""))
    ap.add_argument("--out", default=str(harness.BENCH_DIR / "results" / "latest.md"))
    ap.add_argument("--timeout", type=int, default=600, help="seconds per child run")
    return ap.parse_args(argv)


def spec_from(args: argparse.Namespace) -> BenchSpec:
    spec = BenchSpec(device=args.device, dtype=args.dtype, cache_dir=args.cache_dir, packing=not args.no_packing,
                     share_prompt=not args.no_share_prompt, precompute_ref=not args.no_precompute,
                     prune_last_layer=not args.no_prune_last_layer,
                     trl_precompute_ref=args.trl_precompute, threads=resolve_threads(args.threads, args.device),
                     clock=args.clock)
    if args.quick:
        spec = dataclasses.replace(spec, rows=64, warmup_steps=1, steps=2)
    if args.small:
        spec = dataclasses.replace(spec, **SMALL_MODEL)
    for name, value in (("steps", args.steps), ("warmup_steps", args.warmup), ("rows", args.rows),
                        ("batch_size", args.batch_size)):
        if value is not None:
            spec = dataclasses.replace(spec, **{name: value})
    spec.row_capacity = args.row_capacity
    spec.fp32_cpu_attention = not args.no_fp32_attention
    spec.resolved_row_capacity()  # validate
    if spec.rows < spec.batch_size:
        raise SystemExit(f"--rows {spec.rows} is fewer than one batch of {spec.batch_size}")
    return spec


def run_child(impl: str, algo: str, spec_file: Path, work: Path, timeout: int) -> dict:
    result = work / f"{impl}-{algo}.json"
    log = work / f"{impl}-{algo}.log"
    cmd = [sys.executable, str(harness.BENCH_DIR / "child.py"), impl, algo, str(spec_file), str(result)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(harness.REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=harness.REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    wall = time.perf_counter() - started
    if not result.is_file():
        tail = log.read_text()[-2000:]
        return {"error": f"exit code {proc.returncode}, no result; log tail:\n{tail}"}
    record = json.loads(result.read_text())
    record["wall_s"] = wall
    if record.get("error"):
        print(record.get("traceback", ""), file=sys.stderr)
    return record


def environment(device: str) -> dict[str, str]:
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    env = {"torch": version("torch"), "transformers": version("transformers"), "trl": version("trl"),
           "python": platform.python_version()}
    if device == "cuda":
        import torch

        env["gpu"] = torch.cuda.get_device_name(0)
    else:
        env["cpu"] = _cpu_name()
        env["cores"] = str(os.cpu_count())
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def main(argv=None) -> int:
    args = parse_args(argv)
    algos = harness.selected_algos(args.only)
    spec = spec_from(args)
    harness.prepare_torch(spec)
    device = spec.resolved_device()
    with_trl = not args.no_trl
    if with_trl:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            raise SystemExit("TRL is not installed: pip install -e '.[bench]' (or run with --no-trl)")
    t0 = time.perf_counter()
    load_before = _load()
    path = harness.model_path(spec)  # build the model once, before any timed child
    from verl_core.modeling.loading import load_tokenizer

    tokenizer = load_tokenizer(path)
    works = {a: harness.work_per_step(a, spec, tokenizer) for a in algos}
    with tempfile.TemporaryDirectory(prefix="verl-bench-") as tmp:
        work = Path(tmp)
        spec_file = work / "spec.json"
        spec_file.write_text(spec.to_json())
        print(f"bench: {', '.join(algos)} on {device}; {spec.steps} timed steps after {spec.warmup_steps} warm-up; "
              f"load average {load_before}", flush=True)
        peak = run_child("peak", "-", spec_file, work, args.timeout)
        if peak.get("error"):
            print(f"matmul peak failed: {peak['error']}", file=sys.stderr)
            return 2
        print(f"  matmul peak {peak['flops_per_s'] / 1e9:,.1f} GFLOP/s ({peak['dtype']})", flush=True)
        results: dict[str, dict[str, dict]] = {}
        for algo in algos:
            results[algo] = {}
            for impl in ("ours", "trl") if with_trl else ("ours",):
                rec = run_child(impl, algo, spec_file, work, args.timeout)
                results[algo][impl] = rec
                key = "timed_cpu_seconds" if spec.clock == "cpu" else "timed_seconds"
                status = rec["error"].splitlines()[0] if rec.get("error") else f"{1000 * rec[key] / spec.steps:.0f} ms/step"
                print(f"  {algo:4s} {impl:4s} {status} (wall {rec.get('wall_s', 0):.0f} s)", flush=True)
    env = environment(device)
    env["load avg before/after"] = f"{load_before}/{_load()}"
    env["bench wall"] = f"{time.perf_counter() - t0:.0f} s"
    table, verdicts = harness.build_table(spec, algos, results, works, peak, device, env)
    features = {f"{algo} {impl}": rec.get("features") for algo in algos for impl, rec in results[algo].items()}
    table += "\nConfigurations:\n" + "\n".join(f"- {k}: {v}" for k, v in features.items() if v) + "\n"
    print()
    print(table)
    record = {"spec": dataclasses.asdict(spec), "peak": peak, "works": works, "results": results, "env": env}
    return harness.finish_report(args.out, table, record, results, verdicts)


if __name__ == "__main__":
    sys.exit(main())
