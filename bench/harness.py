"""What every benchmark shares: the spec, the data, the model, the clock, memory, FLOPs, the table.

Each measured run is a separate child process (``bench/child.py``) so max RSS is that run's own;
the child writes one JSON record, the parent (``bench/run_all.py``) turns records into the table.
Nothing here imports TRL: the TRL side lives in ``bench/trl_side.py`` and is imported only in a
child that runs it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
for _p in (str(REPO), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

ALGOS = ("sft", "rm", "dpo", "kto", "grpo")
IMPLS = ("ours", "trl")


@dataclasses.dataclass
class BenchSpec:
    """Everything both sides share. One spec per run; serialised to the children as JSON."""

    # the bench model: Llama family, built locally by verl_core.bundled.tiny_model
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    # work
    rows: int = 512
    batch_size: int = 16
    warmup_steps: int = 2
    steps: int = 10
    max_length: int = 128
    max_prompt_length: int = 64
    max_completion_length: int = 32  # GRPO
    num_generations: int = 4  # GRPO
    temperature: float = 1.0  # GRPO
    learning_rate: float = 1e-5
    beta: float = 0.1
    seed: int = 0
    dtype: str = "bf16"  # "bf16" (autocast, fp32 master weights) or "fp32"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    cache_dir: str = ""
    clock: str = "wall"  # "wall" or "cpu" (process CPU time; for a busy machine, with threads=1)
    threads: int | None = None  # torch intra-op threads in every run (None: torch's default)
    # our speed features (each switchable)
    packing: bool = True
    share_prompt: bool = True
    prune_last_layer: bool = True  # with packing: the last layer only where the loss reads (verl_core.modeling.forward.last_layer_only_at)
    row_capacity: str = "auto"  # tokens per packed row: a number, "longest" (unit), "none" (one row), "auto"
    fp32_cpu_attention: bool = True  # SDPA in fp32 under CPU autocast (bench/fp32_attention.py)
    precompute_ref: bool = True
    # TRL options (defaults are TRL's own, except what must match: sizes, dtype, no gradient checkpointing)
    trl_precompute_ref: bool = False

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_row_capacity(self) -> int | str | None:
        """auto: rows no wider than the longest unit on CPU (SDPA's dense mask makes attention grow with
        the row), one row per batch on GPU."""
        cap = self.row_capacity.lower()
        if cap == "auto":
            return None if self.resolved_device() == "cuda" else "longest"
        if cap == "none":
            return None
        return cap if cap == "longest" else int(cap)

    def model_config(self):
        from verl_core.bundled.tiny_model import TinyModelConfig

        return TinyModelConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                               num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                               num_key_value_heads=self.num_key_value_heads)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchSpec:
        return cls(**json.loads(text))


def model_path(spec: BenchSpec) -> Path:
    from verl_core.bundled.tiny_model import tiny_model_path

    return tiny_model_path(spec.model_config(), cache_dir=spec.cache_dir or None)


# -- data: the bundled arithmetic task, identical rows for both sides ------------------------
def rows_for(algo: str, spec: BenchSpec) -> list[dict]:
    import random

    from verl_core.bundled import arithmetic

    n = spec.rows
    if algo == "sft":
        return arithmetic.sft_rows(n)
    if algo in ("rm", "dpo"):
        return arithmetic.preference_rows(arithmetic.train_problems(n), seed=spec.seed)
    if algo == "kto":  # unpaired, alternating desirable (correct) / undesirable (wrong answer)
        rng = random.Random(spec.seed)  # drawn in row order, for the undesirable rows only
        return [{"prompt": p.prompt, "completion": p.completion if i % 2 == 0 else arithmetic.wrong_completion(p, rng),
                 "label": i % 2 == 0} for i, p in enumerate(arithmetic.train_problems(n))]
    if algo == "grpo":
        return arithmetic.prompt_rows(n)
    raise ValueError(f"unknown algorithm {algo!r}; one of {ALGOS}")


# -- the work one step does, in logical units (identical for both sides) ----------------------
UNITS = {"sft": "tokens/s", "rm": "pairs/s", "dpo": "pairs/s", "kto": "rows/s", "grpo": "samples/s"}


def work_per_step(algo: str, spec: BenchSpec, tokenizer) -> dict[str, float]:
    """Mean logical work of one optimizer step: the throughput unit, and model FLOPs.

    Both sides process ``batch_size`` rows per step from the same rows, so the throughput
    ratio is exactly the inverse ratio of step times. Token counts are non-pad tokens of the
    logical sequences (a shared prompt counts once per sequence that contains it).
    """
    rows = rows_for(algo, spec)
    enc = lambda s, special=False: tokenizer(s, add_special_tokens=special)["input_ids"]  # noqa: E731
    b = unit = spec.batch_size
    eos = 1  # every completion ends with EOS on both sides
    fwd_only: list[list[int]] = []
    if algo == "sft":
        train = [[len(enc(r["prompt"], True)) + len(enc(r["completion"])) + eos] for r in rows]
        unit = sum(s[0] for s in train) / len(train) * b
    elif algo in ("rm", "dpo"):
        prompts = [len(enc(r["prompt"], True)) for r in rows]
        train = [[p + len(enc(r["chosen"])) + eos, p + len(enc(r["rejected"])) + eos] for p, r in zip(prompts, rows)]
    elif algo == "kto":  # plus the KL (mismatched) row: a forward, z0 is detached
        train = fwd_only = [[len(enc(r["prompt"], True)) + len(enc(r["completion"])) + eos] for r in rows]
    else:  # grpo: prefill + decode of max_completion_length, then one training pass
        train = fwd_only = [[len(enc(r["prompt"], True)) + spec.max_completion_length] for r in rows]
    head, vocab = algo != "rm", len(tokenizer)
    flops_row = (sum(train_flops(spec, s, vocab, head) for s in train)
                 + sum(forward_flops(spec, s, vocab, head) for s in fwd_only)) / len(rows)
    return {"unit": unit, "flops": flops_row * b}


def matmul_params(spec: BenchSpec, vocab: int, lm_head: bool = True) -> int:
    d, layers, inter = spec.hidden_size, spec.num_hidden_layers, spec.intermediate_size
    hd = d // spec.num_attention_heads
    attn = d * (spec.num_attention_heads * hd) * 2 + d * (spec.num_key_value_heads * hd) * 2
    return layers * (attn + 3 * d * inter) + (d * vocab if lm_head else d)


def forward_flops(spec: BenchSpec, lengths: list[int], vocab: int, lm_head: bool = True) -> float:
    """Forward FLOPs of sequences of ``lengths`` tokens: 2·N per token for the matmuls plus causal attention."""
    n = matmul_params(spec, vocab, lm_head)
    attn = 4 * spec.num_hidden_layers * spec.hidden_size  # QKᵀ and AV, per (query, key) pair
    return sum(2 * n * t + attn * t * (t + 1) / 2 for t in lengths)


def train_flops(spec: BenchSpec, lengths: list[int], vocab: int, lm_head: bool = True) -> float:
    return 3 * forward_flops(spec, lengths, vocab, lm_head)  # forward + backward (2× forward)


# -- clock and memory inside a child -----------------------------------------------------------
class StepClock:
    """Wall-clock and process CPU time at the end of every optimizer step (both sides call :meth:`tick`).

    Wall time is the measure. CPU time of the process (``--clock cpu``) is for a busy machine:
    with one thread it is the time the run computed, whatever else competes for the cores.
    """

    def __init__(self, device: str):
        self.device = device
        self.ticks: list[float] = []
        self.cpu_ticks: list[float] = []
        self.marks: dict[str, float] = {}
        self.cpu_marks: dict[str, float] = {}

    def _sync(self):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def mark(self, name: str) -> None:
        self._sync()
        self.marks[name] = time.perf_counter()
        self.cpu_marks[name] = time.process_time()

    def tick(self) -> None:
        self._sync()
        self.ticks.append(time.perf_counter())
        self.cpu_ticks.append(time.process_time())

    def timed_seconds(self, warmup: int, steps: int, cpu: bool = False) -> float:
        ticks, marks = (self.cpu_ticks, self.cpu_marks) if cpu else (self.ticks, self.marks)
        if len(ticks) < warmup + steps:
            raise RuntimeError(f"only {len(ticks)} steps ran, expected {warmup + steps}")
        start = ticks[warmup - 1] if warmup > 0 else marks["train_begin"]
        return ticks[warmup + steps - 1] - start


def current_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def max_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def cuda_peak_mb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def prepare_torch(spec: BenchSpec) -> None:
    import torch

    torch.manual_seed(spec.seed)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


# -- the machine's matmul peak ------------------------------------------------------------------
def measure_matmul_peak(device: str, dtype: str, quick: bool = False, cpu_clock: bool = False) -> dict[str, float]:
    """Best FLOP/s of a large square matmul in the training dtype (bf16 or fp32) on ``device``
    (timed by process CPU time with ``cpu_clock``, like the runs)."""
    import torch

    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    n = 8192 if device == "cuda" else (1024 if quick else 2048)
    reps = 20 if device == "cuda" else (2 if quick else 5)
    a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
    (a @ b)
    now = time.process_time if cpu_clock and device == "cpu" else time.perf_counter
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = math.inf
    for _ in range(reps):
        sync()
        t = now()
        (a @ b)
        sync()
        best = min(best, now() - t)
    return {"flops_per_s": 2 * n ** 3 / best, "n": n, "dtype": dtype, "threads": torch.get_num_threads()}


# -- targets and the table ----------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    algo: str
    metric: str  # "throughput" | "memory" | "mfu"
    bound: float  # ratio vs TRL (throughput ≥, memory ≤) or MFU fraction of peak (≥)

    def describe(self) -> str:
        return {"throughput": f"≥ {self.bound:g}× TRL", "memory": f"≤ {self.bound:g}× TRL peak mem"}.get(
            self.metric, f"MFU ≥ {self.bound:.0%} of peak")


TARGETS = [
    Target("sft", "throughput", 1.5), Target("sft", "mfu", 0.60),
    Target("rm", "throughput", 1.5),
    Target("dpo", "throughput", 2.0), Target("dpo", "memory", 0.6),
    Target("kto", "throughput", 2.0),
    Target("grpo", "throughput", 2.0),
]


def judge(target: Target, value: float | None) -> tuple[str, str]:
    """(``PASS``/``MISS``/``n/a``, how much) for one target and its measured value."""
    if value is None or not math.isfinite(value):
        return "n/a", ""
    ratio = target.metric in ("memory", "throughput")
    if (value <= target.bound) if target.metric == "memory" else (value >= target.bound):
        return "PASS", f"{value:.2f}×" if ratio else f"{value:.1%}"
    if target.metric == "memory":
        return "MISS", f"{value:.2f}× > {target.bound:g}×: needs {1 - target.bound / value:.0%} less memory"
    if ratio:
        return "MISS", f"{value:.2f}× < {target.bound:g}×: needs {target.bound / value - 1:.0%} more speed"
    return "MISS", f"{value:.1%} < {target.bound:.0%}: short by {target.bound - value:.1%} of peak"


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}f}"


def summarise(algo: str, rec: dict | None, work: dict[str, float], spec: BenchSpec, peak: float) -> dict[str, Any]:
    """Throughput, memory and MFU of one child record."""
    if rec is None or rec.get("error"):
        return {"error": (rec or {}).get("error", "did not run")}
    seconds = rec["timed_cpu_seconds"] if spec.clock == "cpu" else rec["timed_seconds"]
    per_s = work["unit"] * spec.steps / seconds
    out = {"throughput": per_s, "step_ms": 1000 * seconds / spec.steps, "max_rss_mb": rec["max_rss_mb"],
           "rss_before_mb": rec.get("rss_before_mb"), "cuda_peak_mb": rec.get("cuda_peak_mb"),
           "mfu": work["flops"] * spec.steps / seconds / peak if peak else None,
           "setup_s": rec.get("setup_s"), "precompute_s": rec.get("precompute_s")}
    # One epoch over the rows with the one-time reference precompute spread over it.
    if rec.get("precompute_s"):
        steps_per_epoch = spec.rows // spec.batch_size
        epoch_s = seconds / spec.steps * steps_per_epoch + rec["precompute_s"]
        out["throughput_epoch"] = work["unit"] * steps_per_epoch / epoch_s
    return out


def memory_of(s: dict[str, Any], device: str) -> float | None:
    if "error" in s:
        return None
    return s["cuda_peak_mb"] if device == "cuda" and s.get("cuda_peak_mb") is not None else s["max_rss_mb"]


def build_table(spec: BenchSpec, algos: list[str], results: dict[str, dict[str, dict]], works: dict[str, dict],
                peak: dict[str, float], device: str, env: dict[str, str]) -> tuple[str, list[tuple[Target, str, str]]]:
    """The markdown report and the verdict of every target that applies."""
    mem_name = "peak CUDA MiB" if device == "cuda" else "max RSS MiB"
    lines = [
        "# verl_core vs TRL",
        "",
        f"Model: Llama, {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, intermediate {spec.intermediate_size}, "
        f"{spec.num_attention_heads} heads / {spec.num_key_value_heads} KV heads (verl_core.bundled.tiny_model). Data: bundled arithmetic "
        f"task, {spec.rows} rows, batch {spec.batch_size}, max_length {spec.max_length}; {spec.dtype} "
        f"{'autocast' if spec.dtype == 'bf16' else ''} on {device}; {spec.steps} timed steps after {spec.warmup_steps} warm-up; "
        f"each run in its own process; "
        + ("timed by process CPU time (busy-machine mode), not wall time." if spec.clock == "cpu" else "timed by wall clock."),
        f"Matmul peak ({peak['dtype']}, {peak['n']}², {peak['threads']} threads): {peak['flops_per_s'] / 1e9:,.1f} GFLOP/s. "
        + ", ".join(f"{k} {v}" for k, v in env.items()),
        "",
        f"| algorithm | unit | ours | TRL | speed ratio | ours {mem_name} | TRL {mem_name} | mem ratio | ours MFU | TRL MFU | ours step ms | TRL step ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes, ratios = [], {}
    for algo in algos:
        ours = summarise(algo, results[algo].get("ours"), works[algo], spec, peak["flops_per_s"])
        trl = summarise(algo, results[algo].get("trl"), works[algo], spec, peak["flops_per_s"])
        speed = ours["throughput"] / trl["throughput"] if "error" not in ours and "error" not in trl else None
        m_ours, m_trl = memory_of(ours, device), memory_of(trl, device)
        mem = m_ours / m_trl if m_ours and m_trl else None
        ratios[algo] = {"throughput": speed, "memory": mem, "mfu": ours.get("mfu")}
        lines.append(
            f"| {algo} | {UNITS[algo]} | {_fmt(ours.get('throughput'))} | {_fmt(trl.get('throughput'))} | "
            f"{_fmt(speed, 2) + '×' if speed else '—'} | {_fmt(m_ours, 0)} | {_fmt(m_trl, 0)} | {_fmt(mem, 2) + '×' if mem else '—'} | "
            f"{_fmt(100 * ours['mfu'], 1) + '%' if ours.get('mfu') else '—'} | {_fmt(100 * trl['mfu'], 1) + '%' if trl.get('mfu') else '—'} | "
            f"{_fmt(ours.get('step_ms'), 0)} | {_fmt(trl.get('step_ms'), 0)} |")
        for side, s in (("ours", ours), ("TRL", trl)):
            if "error" in s and not (side == "TRL" and "trl" not in results[algo]):
                notes.append(f"- {algo} {side}: ERROR {s['error']}")
        if "throughput_epoch" in ours and "error" not in trl:
            notes.append(f"- {algo}: reference log-probs precomputed once in {ours['precompute_s']:.1f} s (outside the timed steps); "
                         f"spread over one epoch of {spec.rows} rows ours is {_fmt(ours['throughput_epoch'])} {UNITS[algo]}, "
                         f"{ours['throughput_epoch'] / trl['throughput']:.2f}× TRL")
        if device != "cuda" and ours.get("rss_before_mb") and trl.get("rss_before_mb"):
            notes.append(f"- {algo}: RSS before training (imports, model, data): ours {ours['rss_before_mb']:.0f} MiB, "
                         f"TRL {trl['rss_before_mb']:.0f} MiB; growth during training: ours "
                         f"{ours['max_rss_mb'] - ours['rss_before_mb']:.0f} MiB, TRL {trl['max_rss_mb'] - trl['rss_before_mb']:.0f} MiB")
    verdicts = []
    lines += ["", "| target | measured | verdict |", "|---|---|---|"]
    for t in TARGETS:
        if t.algo not in algos:
            continue
        status, how = judge(t, ratios[t.algo][t.metric])
        verdicts.append((t, status, how))
        lines.append(f"| {t.algo}: {t.describe()} | {how or '—'} | {status} |")
    lines += ["", "MFU: model FLOPs (6·N per trained token + 2·N per forward-only token, N = matmul parameters incl. "
              "the LM head, plus causal attention; logical sequences, so work a side avoids is not counted as its own) "
              "per second over the matmul peak. GRPO's MFU counts the full max_completion_length.", ""]
    if notes:
        lines += ["Notes:"] + notes + [""]
    return "\n".join(lines), verdicts


def write_json(path: str | os.PathLike, record: dict) -> None:
    Path(path).write_text(json.dumps(record, indent=1, default=str))


def finish_report(out_path: str | os.PathLike, table: str, record: dict, results: dict[str, dict[str, dict]],
                  verdicts: list) -> int:
    """Write the table (markdown) and ``record`` (JSON beside it); the bench's exit code: 2 when a
    run failed, 1 when a target was missed (listed on stderr), else 0."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    print(f"written to {out}")
    if any(rec.get("error") for r in results.values() for rec in r.values()):
        return 2
    missed = [(t, how) for t, status, how in verdicts if status == "MISS"]
    if missed:
        print("targets missed:\n" + "\n".join(f"  {t.algo}: {t.describe()}: {how}" for t, how in missed), file=sys.stderr)
        return 1
    return 0


def selected_algos(only: str) -> list[str]:
    """The comma-separated ``--only`` list, checked against :data:`ALGOS`."""
    algos = [a.strip() for a in only.split(",") if a.strip()]
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {unknown}; choose from {ALGOS}")
    return algos
