"""One measured run in its own process: ``python bench/child.py IMPL ALGO SPEC_JSON RESULT_JSON``.

IMPL is ``ours``, ``trl`` or ``peak`` (the matmul peak; ALGO is then ignored), or a side of the
realistic bench (``real-ours``, ``real-trl``, ``real-trl-best``: ``bench/realistic_sides.py``,
SPEC_JSON a ``realistic_models.RealSpec``). The record
written to RESULT_JSON holds the step clock, max RSS of this process, the RSS before training
and, on GPU, the peak CUDA memory. A failure is recorded as ``{"error": ...}`` (exit code 1).
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

REALISTIC = {"real-ours": "run_ours", "real-trl": "run_trl", "real-trl-best": "run_trl"}  # impl -> realistic_sides function


def main(argv: list[str]) -> int:
    impl, algo, spec_path, result_path = argv
    if impl.startswith("real-"):
        from realistic_models import RealSpec as spec_cls
    else:
        spec_cls = harness.BenchSpec
    spec = spec_cls.from_json(Path(spec_path).read_text())
    started = time.perf_counter()
    try:
        harness.prepare_torch(spec)
        device = spec.resolved_device()
        if impl == "peak":
            harness.write_json(result_path, harness.measure_matmul_peak(device, spec.dtype, quick=spec.steps < 5,
                                                                      cpu_clock=spec.clock == "cpu"))
            return 0
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
        clock = harness.StepClock(device)
        if impl == "ours":
            from ours import run
        elif impl == "trl":
            from trl_side import run
        elif impl in REALISTIC:
            import realistic_sides

            run = getattr(realistic_sides, REALISTIC[impl])
        else:
            raise ValueError(f"unknown implementation {impl!r}")
        rss_imports = harness.current_rss_mb()
        info = _run(run, algo, spec, clock)
        record = {
            "impl": impl, "algo": algo, "device": device,
            "timed_seconds": clock.timed_seconds(spec.warmup_steps, spec.steps),
            "timed_cpu_seconds": clock.timed_seconds(spec.warmup_steps, spec.steps, cpu=True),
            "step_ends": [t - clock.marks["train_begin"] for t in clock.ticks],
            "setup_s": clock.marks["setup_done"] - started,
            "max_rss_mb": harness.max_rss_mb(), "rss_imports_mb": rss_imports,
            "rss_before_mb": info.pop("rss_before_mb"), "cuda_peak_mb": harness.cuda_peak_mb(), **info,
        }
        if impl == "ours" and algo in ("dpo", "kto") and spec.precompute_ref:
            marks = clock.cpu_marks if spec.clock == "cpu" else clock.marks
            record["precompute_s"] = marks["train_begin"] - marks["setup_done"]
        harness.write_json(result_path, record)
        return 0
    except BaseException as err:  # noqa: BLE001 - the parent reports it in the table
        harness.write_json(result_path, {"impl": impl, "algo": algo, "error": f"{type(err).__name__}: {err}",
                                         "traceback": traceback.format_exc()})
        traceback.print_exc()
        return 1


def _run(run, algo, spec, clock):
    """Run the side (``run(algo, spec, clock)``); the RSS just before its first step is taken at ``setup_done``."""
    rss = {}
    mark = clock.mark

    def marking(name):
        if name == "setup_done":
            rss["before"] = harness.current_rss_mb()
        mark(name)

    clock.mark = marking
    info = run(algo, spec, clock)
    info["rss_before_mb"] = rss.get("before")
    return info


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
