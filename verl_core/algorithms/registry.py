"""The policy-optimisation algorithms, by name: the one list the pipeline config, the CLI, the
stage dispatch and the package exports are derived from.

Adding an algorithm = its trainer (a config class plus the loss of one batch over the shared
engine) and one :class:`Algorithm` entry below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from verl_core.algorithms.dapo import DAPOTrainer
from verl_core.algorithms.distill import DistillTrainer
from verl_core.algorithms.dpo import DPOTrainer, ORPOTrainer, SimPOTrainer
from verl_core.algorithms.grpo import GRPOTrainer, ReinforcePPTrainer, RLOOTrainer
from verl_core.algorithms.kto import KTOTrainer
from verl_core.algorithms.ppo import PPOTrainer
from verl_core.algorithms.rounds import IterativeDPOTrainer, RFTTrainer

Kind = Literal["offline", "online", "rounds"]


@dataclass(frozen=True)
class Algorithm:
    """``trainer`` is constructed as ``trainer(model, train_dataset=rows, config=...)`` (offline,
    trains on ``data``), ``trainer(policy, reward_model=..., prompts=rows, config=...)`` (online), or
    is a :class:`~verl_core.algorithms.rounds.RoundsTrainer`: rounds of generate -> score -> train,
    which the pipeline runs as one cached, retryable task each (rounds)."""

    name: str
    trainer: type
    kind: Kind
    data: Literal["pairs", "prompts"]  # pairs: prompt/chosen/rejected; prompts: prompt/ground_truth
    summary: str
    reads_unpaired: bool = False  # also trains on unpaired rows (prompt/completion/label) in place of pairs

    @property
    def config_cls(self) -> type:
        return self.trainer.config_cls


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("dpo", DPOTrainer, "offline", "pairs", "Direct Preference Optimization (Rafailov et al. 2023)"),
        Algorithm("kto", KTOTrainer, "offline", "pairs", "Kahneman-Tversky Optimization (Ethayarajh et al. 2024)", True),
        Algorithm("simpo", SimPOTrainer, "offline", "pairs", "SimPO, reference-free (Meng et al. 2024)"),
        Algorithm("orpo", ORPOTrainer, "offline", "pairs", "ORPO, odds-ratio + SFT (Hong et al. 2024)"),
        Algorithm("ppo", PPOTrainer, "online", "prompts", "PPO with a value head and GAE (Schulman et al. 2017)"),
        Algorithm("grpo", GRPOTrainer, "online", "prompts", "GRPO, group-normalised advantages (Shao et al. 2024)"),
        Algorithm("rloo", RLOOTrainer, "online", "prompts", "RLOO, leave-one-out baseline (Ahmadian et al. 2024)"),
        Algorithm("reinforce_pp", ReinforcePPTrainer, "online", "prompts", "REINFORCE++ (Hu 2025)"),
        Algorithm(
            "dapo", DAPOTrainer, "online", "prompts", "DAPO: clip-higher, dynamic sampling, overlong shaping (Yu et al. 2025)"
        ),
        Algorithm(
            "distill",
            DistillTrainer,
            "online",
            "prompts",
            "On-policy distillation: reverse KL / generalized JSD to a teacher (Agarwal et al. 2024)",
        ),
        Algorithm("iterative_dpo", IterativeDPOTrainer, "rounds", "prompts", "on-policy pairs + DPO, rounds (Xiong et al. 2024)"),
        Algorithm("rft", RFTTrainer, "rounds", "prompts", "rounds of best-of-n SFT, RAFT (Dong et al. 2023)"),
    )
}


def get_algorithm(name: str) -> Algorithm:
    from verl_core.config import ConfigError

    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]
