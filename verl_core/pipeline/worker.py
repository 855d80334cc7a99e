"""The entry point every rank of a distributed stage runs: ``python -m verl_core.pipeline.worker REQUEST``.

``REQUEST`` is the JSON file :mod:`verl_core.pipeline.launch` writes (the stage's resolved
:class:`~verl_core.pipeline.plan.StagePlan`, its MLflow run id). Every rank trains the stage through
:func:`~verl_core.pipeline.runner.run_planned` (accelerate finds the process group torchrun or
Ray Train set up); rank 0 alone reports metrics to the MLflow run, logs the datasets, and
writes the output and the record, atomically, as in-process. A rank that fails writes
``rank-N.error.json`` beside the request (type, message, traceback), so the launcher can
fail the task with that rank's error rather than with a collective's timeout on another rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

log = logging.getLogger("verl_core")
ERROR_FILE = "rank-{rank}.error.json"
PID_FILE = "rank-{rank}.pid"


def rank() -> int:
    """The global rank torchrun / Ray Train give this process (0 when alone)."""
    return int(os.environ.get("RANK", "0"))


def run_request(request_path: str | Path) -> None:
    """Train the requested stage on this rank; on failure leave this rank's error beside the request."""
    request_path = Path(request_path)
    launch_dir, r = request_path.parent, rank()
    (launch_dir / PID_FILE.format(rank=r)).write_text(str(os.getpid()))
    try:
        _train(json.loads(request_path.read_text()), r)
    except BaseException as err:
        error = {
            "rank": r,
            "type": type(err).__name__,
            "message": str(err),
            "traceback": traceback.format_exc(),
            "time": time.time(),
        }
        tmp = launch_dir / f".tmp-{ERROR_FILE.format(rank=r)}"
        tmp.write_text(json.dumps(error, indent=2))
        tmp.replace(launch_dir / ERROR_FILE.format(rank=r))
        raise


def _train(request: dict, r: int) -> None:
    import torch

    from verl_core.pipeline import tracking
    from verl_core.pipeline.plan import StagePlan
    from verl_core.pipeline.runner import run_planned
    from verl_core.train.callbacks import MLflowCallback

    torch.set_num_threads(int(request.get("threads", 1)))
    plan = StagePlan.from_request(request["plan"])
    config = plan.config
    run_id, main = request.get("run_id"), r == 0
    callbacks = []
    if main and run_id:
        tracking.configure(config)
        callbacks.append(MLflowCallback(run_id))
    result = run_planned(plan, callbacks=callbacks, run_id=run_id, write_record=main)
    if main and run_id:  # the launcher's process never sees the rows: log them here
        for use in result.output.datasets:
            tracking.log_dataset(config, run_id, use.name, use.rows, use.context, use.source)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m verl_core.pipeline.worker REQUEST.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank()}] %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    run_request(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
