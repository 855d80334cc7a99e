"""Pure loss and advantage functions on tensors: no models, no state.

Each family lives in its own module (:mod:`.preference`, :mod:`.policy`, :mod:`.advantages`,
:mod:`.reward`, :mod:`.masked`); registries map config strings to functions::

    from verl_core.losses import dpo_loss, grpo_advantages, ADVANTAGE_ESTIMATORS, POLICY_LOSSES
"""
from verl_core.losses.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    gae_outcome_advantages,
    grpo_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_outcome_advantages,
    rloo_advantages,
)
from verl_core.losses.masked import masked_mean, masked_sum, masked_var, masked_whiten
from verl_core.losses.policy import (
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    PolicyLossOutput,
    ValueLossOutput,
    aggregate,
    cispo_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    ppo_value_loss,
)
from verl_core.losses.preference import (
    DPO_LOSS_TYPES,
    DPOOutput,
    KTOOutput,
    ORPOOutput,
    SimPOOutput,
    dpo_loss,
    kto_loss,
    orpo_loss,
    sequence_logps,
    sequence_mean_logps,
    simpo_loss,
)
from verl_core.losses.reward import bradley_terry_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "DPO_LOSS_TYPES", "KL_KINDS", "POLICY_LOSSES",
    "AdaptiveKLController", "DPOOutput", "FixedKLController", "KTOOutput", "ORPOOutput", "PolicyLossOutput",
    "SimPOOutput", "ValueLossOutput", "aggregate", "bradley_terry_loss", "broadcast_to_tokens", "cispo_policy_loss",
    "discounted_returns", "dpo_loss", "dr_grpo_advantages", "gae_advantages", "gae_outcome_advantages",
    "grpo_advantages", "gspo_policy_loss", "kl_penalty", "kto_loss", "masked_mean", "masked_sum", "masked_var",
    "masked_whiten", "orpo_loss", "outcome_token_rewards", "ppo_policy_loss", "ppo_value_loss",
    "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "reinforce_pp_outcome_advantages",
    "rloo_advantages", "sequence_logps", "sequence_mean_logps", "simpo_loss",
]
