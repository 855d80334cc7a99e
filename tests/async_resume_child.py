"""A short async GRPO run for tests/test_async_rollout.py's kill -9 trial: ``python tests/async_resume_child.py
OUT STALENESS kill|run``. With ``kill`` the process SIGKILLs itself right after its first checkpoint is
written (the patch only adds the kill). Every optimizer step is appended to ``OUT/updates.jsonl`` with the
process id and the rollout workers' pids; the last line printed is the run's JSON summary."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch


def _reward(completions, truths):  # varies within a group, so even the untrained tiny model learns something
    return [float(len(c) % 3) for c in completions]


def main() -> None:
    from verl_core.algorithms.grpo import GRPOTrainer
    from verl_core.bundled.tiny_model import tiny_model_path
    from verl_core.policies import LLMPolicy
    from verl_core.train import engine
    from verl_core.train.callbacks import Callback

    out, staleness, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if mode == "kill":
        real_save = engine.Engine.save_checkpoint

        def save_then_die(self):
            path = real_save(self)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
            return path

        engine.Engine.save_checkpoint = save_then_die

    class Updates(Callback):
        trainer = None

        def on_update(self, step, metrics):
            pids = getattr(self.trainer.backend, "worker_pids", list)()
            with open(out / "updates.jsonl", "a") as f:
                f.write(json.dumps({"update": step, "pid": os.getpid(), "workers": pids}) + "\n")

    cb = Updates()
    trainer = GRPOTrainer(
        policy=LLMPolicy.from_pretrained(str(tiny_model_path())),
        reward_fns=[_reward],
        callbacks=[cb],
        batch_size=8,
        num_generations=4,
        max_steps=5,
        save_steps=2,
        learning_rate=1e-3,
        max_new_tokens=8,
        progress=False,
        logging_steps=1,
        mixed_precision="no",
        output_dir=str(out / "run"),
        async_rollout={"max_staleness": staleness},
    )
    cb.trainer = trainer
    result = trainer.train()
    summary = {"steps": result.steps, "resumed": result.resumed_from_step, "updates": trainer.engine.optimizer_steps}
    print(json.dumps({**summary, "model": result.output_dir}))


if __name__ == "__main__":
    main()
