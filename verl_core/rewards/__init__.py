"""Rewards: rule-based scorers (``rules``), reward-model scoring and user callables (``model``), an LM as
judge (``judge``), a reward service over HTTP (``remote``, served by ``serve``).

``RewardSource`` combines them with weights; every source is checked and a failing one raises
:class:`RewardError` naming the source and the sample.
"""

from verl_core.rewards import code  # noqa: F401  (registers the code_output rule)
from verl_core.rewards.gsm8k import ANSWER_EXTRACTORS, gsm8k_answer, gsm8k_ground_truth
from verl_core.rewards.judge import JudgeConfig, JudgeReward
from verl_core.rewards.model import RewardModel, RewardScores, RewardSource, RewardSourceConfig
from verl_core.rewards.remote import RemoteReward, RemoteRewardConfig
from verl_core.rewards.rules import (
    RULE_REWARDS,
    RewardError,
    RewardFn,
    get_rule_reward,
    register_rule_reward,
    score_with_rules,
)

__all__ = [
    "ANSWER_EXTRACTORS",
    "RULE_REWARDS",
    "JudgeConfig",
    "JudgeReward",
    "RemoteReward",
    "RemoteRewardConfig",
    "RewardError",
    "RewardFn",
    "RewardModel",
    "RewardScores",
    "RewardSource",
    "RewardSourceConfig",
    "get_rule_reward",
    "gsm8k_answer",
    "gsm8k_ground_truth",
    "register_rule_reward",
    "score_with_rules",
]
