"""Our SFT under ``accelerate launch --config_file deployments/accelerate/fsdp2.yaml --num_processes 1``.

    python -m accelerate.commands.launch --config_file deployments/accelerate/fsdp2.yaml --num_processes 1 \\
        bench/gpu_check_fsdp.py SPEC_JSON RESULT_JSON

``bench/gpu_check.py`` starts it. The rank runs ``SFTTrainer`` (its defaults, as the realistic bench's
``run_ours``: only the work is given, with a learning rate that lowers the loss within 10 steps: 1e-4 for
the real model, 1e-3 for the dry run's random one) on the realistic SFT rows, records every optimizer
step's loss, and
writes one JSON record: what accelerate made of the config (``distributed_type``, ``fsdp_version``),
the losses, the step clock and the peak CUDA memory. A failure is recorded as ``{"error": ...}``.
``ok`` is true when accelerate sharded with FSDP2 and the loss went down. On a CPU machine accelerate
1.16 ignores the FSDP setting (measured: ``MULTI_CPU``, the model wrapped in DDP), so the record then
says so and the run is the same launch training without sharding.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check_child  # noqa: E402
import harness  # noqa: E402

LEARNING_RATE = 1e-3  # the dry run's built model: from random init the loss falls by nats within a few steps at this rate
REAL_LEARNING_RATE = 1e-4  # the real pretrained model (GPU mode): 1e-3 would knock it off its weights


def train(spec, clock: harness.StepClock) -> dict:
    from realistic_models import REAL_MODELS, model_path, rows_for
    from realistic_sides import _timing, _tokenizer

    from verl_core.algorithms.sft import SFTTrainer
    from verl_core.train.callbacks import Callback

    losses: list[float] = []

    class Record(Callback):
        def on_train_begin(self, params):
            clock.mark("train_begin")

        def on_update(self, step, metrics):
            losses.append(float(metrics["loss"]))

        def on_step_end(self, step):
            clock.tick()

    rows = rows_for("sft", spec, _tokenizer(spec))
    trainer = SFTTrainer(
        str(model_path(spec)),
        train_dataset=rows,
        callbacks=[Record()],
        batch_size=spec.batch_size,
        max_length=spec.max_length,
        max_steps=spec.total_steps,
        learning_rate=REAL_LEARNING_RATE if spec.shape in REAL_MODELS else LEARNING_RATE,
        seed=spec.seed,
        progress=False,
        logging_steps=spec.total_steps,
        lr_scheduler="constant",
        mixed_precision="bf16" if spec.dtype == "bf16" else "no",
    )
    clock.mark("setup_done")
    trainer.train()
    acc = trainer.engine.accelerator
    plugin = getattr(acc.state, "fsdp_plugin", None)
    kind = str(acc.distributed_type).removeprefix("DistributedType.")
    version = getattr(plugin, "fsdp_version", None) if kind == "FSDP" else None
    head, tail = losses[: max(1, len(losses) // 3)], losses[-max(1, len(losses) // 3) :]
    fell = sum(tail) / len(tail) < sum(head) / len(head)
    return {
        "distributed_type": kind,
        "fsdp_version": version,
        "num_processes": acc.num_processes,
        "model_class": type(trainer.engine.model).__name__,
        "losses": losses,
        "loss_fell": fell,
        "ok": version == 2 and fell,
        **_timing([], clock),
    }


def main(argv: list[str]) -> int:
    spec_path, result_path = argv
    gpu_check_child.register_shapes()
    from realistic_models import RealSpec

    spec = RealSpec.from_json(Path(spec_path).read_text())
    try:
        harness.prepare_torch(spec)
        device = spec.resolved_device()
        if device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
        clock = harness.StepClock(device)
        started = time.perf_counter()
        record = train(spec, clock)
        record.update(
            device=device,
            timed_seconds=clock.ticks[-1] - clock.ticks[0],
            setup_s=clock.marks["setup_done"] - started,
            max_rss_mb=harness.max_rss_mb(),
            cuda_peak_mb=harness.cuda_peak_mb(),
        )
        harness.write_json(result_path, record)
        return 0
    except BaseException as err:  # noqa: BLE001 - the parent reports it in the table
        harness.write_json(result_path, {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
