"""Mixed-precision choice: ``mixed_precision: auto`` picks bf16 only where it is faster.

On CPUs, bf16 matmuls are fast only with AVX512-BF16 or AMX; elsewhere (e.g. AVX2-only
cores) PyTorch falls back to kernels that are 6-10x *slower* than fp32 (measured on an
AVX2 EPYC: 65 GFLOP/s fp32 vs 6-10 GFLOP/s bf16 for the default model's shapes).
"""

from __future__ import annotations

import functools

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX tiles (torch's own CPU probes; /proc/cpuinfo flags as a fallback)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        try:
            with open("/proc/cpuinfo") as fh:
                flags = next((line for line in fh if line.startswith("flags")), "").split()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_mixed_precision(value: str) -> str:
    """``auto`` -> ``bf16`` on a GPU with bf16 support or a CPU with fast bf16, else ``no``."""
    if value != "auto":
        return value
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_fast_bf16() else "no"


def allow_precision_change(mixed_precision: str) -> None:
    """accelerate keeps one process-wide ``AcceleratorState`` and refuses a second
    ``Accelerator`` with another ``mixed_precision``; a later run in the same process (a
    notebook, a pipeline, a test session) resets it, keeping the distributed ``PartialState``."""
    from accelerate.state import AcceleratorState

    previous = AcceleratorState._shared_state.get("_mixed_precision")
    if previous is not None and previous != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
