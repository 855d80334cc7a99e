"""One run of the GPU check in its own process: ``python bench/gpu_check_child.py SIDE ALGO SPEC_JSON RESULT_JSON``.

A thin front of ``bench/child.py`` (the benches' run harness: step clock, RSS, peak CUDA memory, the
error record) over the realistic bench's sides (``bench/realistic_sides.py``). It adds two things:

- the dry run's model shape (:data:`SHAPES`) to ``realistic_models.SHAPES``, so a
  ``RealSpec(shape="gpu-dry")`` read back from JSON gets its sizes here as in the parent (GPU mode runs
  the realistic bench's own ``smollm2`` shape, the real SmolLM2-135M-Instruct);
- the side ``real-trl-vllm``: ``realistic_sides.run_trl`` (TRL's defaults) with ``use_vllm=True,
  vllm_mode="colocate"`` added to its ``GRPOConfig``, so the work stays exactly the TRL run's.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in the run's own process (its peak memory)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Built Llama shapes; every head size is one vLLM takes (its CPU attention: 32, 64, 80, 96, 112, 128, 256).
SHAPES = {
    # the dry run on a CPU: 2 layers, 2 heads of 32
    "gpu-dry": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
}
TRL_VLLM = {"use_vllm": True, "vllm_mode": "colocate"}


def register_shapes() -> None:
    import realistic_models

    realistic_models.SHAPES.update(SHAPES)


def main(argv: list[str]) -> int:
    side, *rest = argv
    register_shapes()
    if side == "real-trl-vllm":
        import trl

        trl.GRPOConfig = functools.partial(trl.GRPOConfig, **TRL_VLLM)
        side = "real-trl"
    import child

    return child.main([side, *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
