"""The GPU check's table (``bench/gpu_check.py``): tokens/s and peak memory of each side, their ratios, why a run failed.

Tokens/s: non-pad tokens of the logical sequences (:func:`realistic_models.sequence_tokens`; GRPO: prompt +
max new tokens per sample) of steps 2..N over their wall time, plus the share of those steps in a reference
precompute (ours does it once in ``train()``, TRL's defaults score the reference every step). Step 1 holds
CUDA warm-up, compilation and a vLLM engine's start: the notes give each side's time to first step.
"""

from __future__ import annotations

VLLM_ON_GPU = (
    "- grpo: each peak includes a vLLM engine in the run's process: weights and KV cache within 0.3 of the GPU "
    "(ours rollout.vllm.gpu_memory_utilization, TRL vllm_gpu_memory_utilization: both defaults). Our engine's dtype is "
    "rollout.vllm.dtype auto, the policy's parameter dtype (float32: bf16 is autocast); TRL passes none, and vLLM's auto "
    "downcasts a float32 checkpoint to the platform's first dtype (bf16 on an H200)"
)


def throughput(algo: str, rec: dict | None, spec, tokens: dict) -> dict | None:
    """Tokens/s of steps 2..N (plus their share of a reference precompute), memory, time to first step."""
    if not rec or rec.get("error") or rec.get("skipped"):
        return None
    n = spec.total_steps
    units = spec.grpo_batch if algo == "grpo" else spec.batch_size
    window = rec["after_first_step_s"] + rec.get("precompute_s", 0.0) * (n - 1) / n
    key = "sft" if algo == "fsdp2" else algo
    mem = rec["cuda_peak_mb"] if rec.get("cuda_peak_mb") is not None else rec["max_rss_mb"]
    return {
        "tokens_s": tokens[key]["tokens_per_unit"] * units * (n - 1) / window,
        "mem": mem,
        "first_step_s": rec["first_step_s"],
    }


def _f(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    return f"{a[key] / b[key]:.2f}×" if a and b and b[key] else "—"


def render(spec, runs: dict, tokens: dict, facts: dict, device: str, elapsed: float) -> tuple[str, bool]:
    """The markdown report, and whether any run failed."""
    from realistic_models import describe_shape

    mem = "peak GPU MiB" if device == "cuda" else "max RSS MiB"
    lines = [
        "# GPU check: verl_core vs TRL" + (" (dry run on CPU)" if device == "cpu" else ""),
        "",
        f"{describe_shape(spec)}. {spec.dtype} on {device}; batch {spec.batch_size} x max_length {spec.max_length}; "
        f"{spec.total_steps} steps a run; GRPO {spec.grpo_batch // spec.num_generations} prompts x {spec.num_generations} "
        f"samples x {spec.max_completion_length} new tokens, ours with rollout.backend {spec.rollout_backend}. "
        "Tokens/s over steps 2..N; each side in its own process; memory: that process's peak; ratios: ours ÷ TRL "
        "(speed: above 1 is faster, memory: below 1 is smaller).",
        ", ".join(f"{k} {v}" for k, v in facts.items()) + f"; check wall {elapsed:.0f} s",
        "",
        f"| algorithm | ours tokens/s | TRL tokens/s | ratio | ours {mem} | TRL {mem} | memory ratio | status / notes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    notes, failed = [], False
    for algo, run in runs.items():
        ours, trl = (throughput(algo, run.get(side), spec, tokens) for side in ("ours", "trl"))
        status = []
        for side in ("ours", "trl"):
            rec = run.get(side)
            if rec is None:
                continue
            if rec.get("skipped"):
                status.append(f"{'TRL' if side == 'trl' else 'ours'} skipped: {rec['skipped']}")
                failed |= bool(rec.get("counts_as_failure"))
            elif rec.get("error"):
                failed = True
                status.append(f"{'TRL' if side == 'trl' else 'ours'} FAILED: {rec['error'].splitlines()[0][:200]}")
            if side == "ours" and algo == "fsdp2" and not rec.get("error") and not rec.get("skipped"):
                status.append(fsdp2_status(rec, device))
                failed |= device == "cuda" and not rec.get("ok")
        status += run.get("notes", [])
        lines.append(
            f"| {algo} | {_f(ours and ours['tokens_s'])} | {_f(trl and trl['tokens_s'])} | "
            f"{_ratio(ours, trl, 'tokens_s')} | {_f(ours and ours['mem'])} | {_f(trl and trl['mem'])} | "
            f"{_ratio(ours, trl, 'mem')} | {'; '.join(status) or 'ok'} |"
        )
        first = [f"{label} {s['first_step_s']:.1f} s" for label, s in (("ours", ours), ("TRL", trl)) if s]
        if first:
            notes.append(
                f"- {algo}: time to first step (process start → end of step 1: imports, model load, warm-up, engine "
                "start) " + ", ".join(first)
            )
        for side in ("ours", "trl"):
            features = (run.get(side) or {}).get("features")
            if features:
                notes.append(f"- {algo} {side}: {features}")
    if device == "cuda" and "grpo" in runs and spec.rollout_backend == "vllm":
        notes.append(VLLM_ON_GPU)
    lines += ["", "Notes:"] + notes + [""]
    return "\n".join(lines), failed


def fsdp2_status(rec: dict, device: str) -> str:
    losses = rec["losses"]
    trained = f"loss {losses[0]:.3f} → {losses[-1]:.3f} over {len(losses)} steps" + (
        "" if rec["loss_fell"] else " (did NOT fall)"
    )
    got = f"{rec['distributed_type']}" + (f" v{rec['fsdp_version']}" if rec["fsdp_version"] else f", {rec['model_class']}")
    if device != "cuda":
        return (
            f"skipped: FSDP2 needs CUDA: accelerate gave {got} for fsdp2.yaml here (it shards only on GPUs); "
            f"the same launch trained unsharded, {trained}"
        )
    return f"{'ok' if rec['ok'] else 'FAILED'}: accelerate launch fsdp2.yaml, 1 process, {got}, {trained}"
