"""Run ``verl-core`` and SIGKILL the process at a named moment (for the kill -9 trials of
tests/test_reliability.py). Usage: ``python tests/killpoints.py POINT verl-core-args...`` with POINT
one of ``none``, ``mid-sft`` (after SFT's first checkpoint), ``mid-checkpoint-write`` (the model
file of this process's first checkpoint written, the rest not), ``mid-registration`` (the model version
created, before the run is tagged or ended). The patches only add the kill; the code under test runs as is.
"""

from __future__ import annotations

import os
import signal
import sys


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str) -> None:
    from verl_core.train import engine, state_io

    if point == "mid-sft":
        real_save = engine.Engine.save_checkpoint

        def save_then_die(self):
            path = real_save(self)
            _die()
            return path

        engine.Engine.save_checkpoint = save_then_die
    elif point == "mid-checkpoint-write":

        def write_model_then_die(accelerator, model, states, folder):  # the first checkpoint of this process
            from safetensors.torch import save_file

            weights = {k: v.detach().clone().contiguous() for k, v in accelerator.get_state_dict(model).items()}
            save_file(weights, str(folder / state_io.MODEL_FILE))
            _die()

        engine.save_training_state = write_model_then_die
    elif point == "mid-registration":
        from verl_core.pipeline import model_registry

        def register_then_die(*args, **kwargs):  # called right after the version is created
            _die()

        model_registry._is_better_than_champion = register_then_die
    elif point != "none":
        raise SystemExit(f"unknown kill point {point!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from flows.cli import main

    sys.exit(main(sys.argv[2:]))
