"""One SFT optimizer step, run alone or under torchrun; rank 0 saves loss and parameters."""

import sys

import torch

from verl_core.algorithms.sft import SFTTrainer
from verl_core.bundled import arithmetic

model_path, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
trainer = SFTTrainer(
    model_path,
    train_dataset=arithmetic.sft_rows(64),
    max_steps=1,
    batch_size=16,
    learning_rate=1e-3,
    progress=False,
    logging_steps=1,
    seed=3,
)
result = trainer.train()
acc = trainer.engine.accelerator
if acc.is_main_process:
    params = {k: v.detach().clone() for k, v in trainer.engine.unwrapped.state_dict().items()}
    torch.save({"processes": acc.num_processes, "loss": result.metrics["loss"], "params": params}, out)
