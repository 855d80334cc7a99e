"""Advantage estimators and masked statistics against hand-computed values."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import verl_core.losses as losses
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

NAN = float("nan")


def close(actual: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    expected_t = torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, atol=atol, rtol=0)


# --- masked statistics ---------------------------------------------------------------------


def test_masked_stats_ignore_padding_even_nan() -> None:
    x = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, NAN]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(x, m).item() == 6.0
    close(masked_sum(x, m, dim=-1), [3.0, 3.0])
    assert masked_mean(x, m).item() == 2.0
    close(masked_mean(x, m, dim=-1), [1.5, 3.0])
    # values 1, 2, 3: mean 2, squared deviations 1 + 0 + 1 = 2
    assert masked_var(x, m).item() == pytest.approx(1.0)  # 2 / (3 - 1)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2 / 3)


def test_masked_mean_zero_count_is_zero_not_nan() -> None:
    x = torch.tensor([[5.0, 6.0], [1.0, 2.0]])
    m = torch.tensor([[0, 0], [1, 1]])
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0
    close(masked_mean(x, m, dim=-1), [0.0, 1.5])


def test_masked_whiten() -> None:
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, NAN, NAN]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # mean 2, unbiased std 1  ->  (x - 2) / 1
    close(masked_whiten(x, m), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atol=1e-6)
    close(masked_whiten(x, m, shift_mean=False), [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], atol=1e-6)


# --- GAE -----------------------------------------------------------------------------------

GAMMA, LAM = 0.9, 0.8  # gamma * lam = 0.72

# Row 0: all 4 tokens valid. Row 1: 2 valid tokens, then padding with junk values.
REWARDS = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 99.0, 99.0]])
VALUES = torch.tensor([[0.5, 0.4, 0.3, 0.2], [0.6, 0.7, 99.0, 99.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])

# Hand computation, row 0 (from the end):
#   t=3: delta = 1 + 0.9*0 - 0.2 = 0.8                  A = 0.8
#   t=2: delta = 0 + 0.9*0.2 - 0.3 = -0.12              A = -0.12 + 0.72*0.8     = 0.456
#   t=1: delta = 0 + 0.9*0.3 - 0.4 = -0.13              A = -0.13 + 0.72*0.456   = 0.19832
#   t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14              A = -0.14 + 0.72*0.19832 = 0.0027904
# Row 1 (last valid token is t=1):
#   t=1: delta = 1 + 0 - 0.7 = 0.3                      A = 0.3
#   t=0: delta = 0 + 0.9*0.7 - 0.6 = 0.03               A = 0.03 + 0.72*0.3 = 0.246
EXPECTED_ADV = [[0.0027904, 0.19832, 0.456, 0.8], [0.246, 0.3, 0.0, 0.0]]
EXPECTED_RET = [[0.5027904, 0.59832, 0.756, 1.0], [0.846, 1.0, 0.0, 0.0]]


def test_gae_hand_values_with_padding() -> None:
    adv, ret = gae_advantages(REWARDS, VALUES, MASK, gamma=GAMMA, lam=LAM)
    close(adv, EXPECTED_ADV)
    close(ret, EXPECTED_RET)


def test_gae_padding_does_not_leak() -> None:
    rewards, values = REWARDS.clone(), VALUES.clone()
    rewards[1, 2:] = torch.tensor([-1e6, NAN])
    values[1, 2:] = torch.tensor([NAN, 1e6])
    adv, ret = gae_advantages(rewards, values, MASK, gamma=GAMMA, lam=LAM)
    close(adv, EXPECTED_ADV)
    close(ret, EXPECTED_RET)


def test_gae_mask_with_hole_carries_next_valid_value() -> None:
    # Token 1 is masked out: token 0 bootstraps from token 2's value.
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.3, 0.2]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=GAMMA, lam=LAM)
    # t=3: 0.8; t=2: 0.456 (as above); t=0: delta = 0.9*0.3 - 0.5 = -0.23, A = -0.23 + 0.72*0.456
    close(adv, [[0.09832, 0.0, 0.456, 0.8]])
    close(ret, [[0.59832, 0.0, 0.756, 1.0]])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value() -> None:
    rewards = torch.tensor([[0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[1.5, 1.0, 0.5]])
    close(ret, [[2.0, 2.0, 2.0]])


# --- GRPO / RLOO ---------------------------------------------------------------------------

# Group 7: scores 1, 0, 0, 1  (mean 0.5, unbiased std sqrt(1/3) = 0.5773503)
# Group 3: scores 0.5, 2.0    (mean 1.25, unbiased std sqrt(1.125) = 1.0606602)
# Group 42: a single score 3  -> advantage 0
SCORES = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.0, 1.0, 3.0])
GROUPS = torch.tensor([7, 3, 7, 3, 7, 7, 42])


def test_grpo_hand_values() -> None:
    # 0.5 / 0.5773503 = 0.8660254; 0.75 / 1.0606602 = 0.7071068
    expected = [0.8660254, -0.7071068, -0.8660254, 0.7071068, -0.8660254, 0.8660254, 0.0]
    close(grpo_advantages(SCORES, GROUPS, eps=0.0), expected)
    close(grpo_advantages(SCORES, GROUPS), expected, atol=3e-6)  # eps=1e-6 barely matters
    no_std = [0.5, -0.75, -0.5, 0.75, -0.5, 0.5, 0.0]
    close(grpo_advantages(SCORES, GROUPS, norm_by_std=False), no_std)


def test_grpo_group_ids_as_list_and_constant_group() -> None:
    # All-equal group: no signal, advantage 0 (not NaN); singleton group: 0.
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 4.0]), [0, 0, 0, 1])
    close(adv, [0.0, 0.0, 0.0, 0.0])


def test_rloo_hand_values() -> None:
    # Group 7: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3. Group 3: 0.5 - 2 = -1.5 ; 2 - 0.5 = 1.5
    expected = [2 / 3, -1.5, -2 / 3, 1.5, -2 / 3, 2 / 3, 0.0]
    close(rloo_advantages(SCORES, GROUPS), expected)


def test_broadcast_to_tokens() -> None:
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(broadcast_to_tokens(adv, mask), [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


# --- REINFORCE++ ---------------------------------------------------------------------------


def test_reinforce_pp_returns_then_whitened() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5. Row 0: G2 = 1, G1 = 0.5, G0 = 0.25. Row 1 (last valid t=1): G1 = 2, G0 = 1.
    returns = discounted_returns(rewards, mask, gamma=0.5)
    close(returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])

    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # Valid returns 0.25, 0.5, 1, 1, 2: mean 0.95, squared deviations sum to 1.8,
    # unbiased std sqrt(1.8 / 4) = 0.6708204.
    std = math.sqrt(0.45)
    expected = [[-0.7 / std, -0.45 / std, 0.05 / std], [0.05 / std, 1.05 / std, 0.0]]
    close(adv, expected, atol=1e-5)
    valid = adv[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-5)
    assert adv[1, 2].item() == 0.0


# --- Dr. GRPO, group size 1, token broadcast ------------------------------------------------


def test_dr_grpo_hand_values() -> None:
    # group mean subtracted only: group 7 mean 0.5, group 3 mean 1.25, singleton group 42 -> 0
    expected = [0.5, -0.75, -0.5, 0.75, -0.5, 0.5, 0.0]
    close(dr_grpo_advantages(SCORES, GROUPS), expected)


@pytest.mark.parametrize("estimator", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_group_estimators_groups_of_size_one_give_zero(estimator) -> None:
    adv = estimator(torch.tensor([3.0, -1.0, 0.5]), [0, 1, 2])
    close(adv, [0.0, 0.0, 0.0])
    assert torch.isfinite(adv).all()


def test_group_estimators_broadcast_with_mask() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 1, 1]])  # row 2 has a hole at the front
    scores, groups = torch.tensor([1.0, 0.0, 5.0]), [0, 0, 1]  # group 1 is a singleton
    # grpo: +-0.5 / std(1, 0) = +-0.5 / 0.7071068 ; dr_grpo: +-0.5 ; rloo: +-1
    g = 0.5 / math.sqrt(0.5)
    close(grpo_advantages(scores, groups, response_mask=mask, eps=0.0), [[g, g, 0], [-g, 0, 0], [0, 0, 0]])
    close(dr_grpo_advantages(scores, groups, response_mask=mask), [[0.5, 0.5, 0], [-0.5, 0, 0], [0, 0, 0]])
    close(rloo_advantages(scores, groups, response_mask=mask), [[1.0, 1.0, 0], [-1.0, 0, 0], [0, 0, 0]])


# --- REINFORCE++-baseline --------------------------------------------------------------------


def test_reinforce_pp_baseline_hand_values() -> None:
    # group 0: scores 1, 0 -> centred 0.5, -0.5 ; group 1: 2, 2, 5 -> -1, -1, 2 ; group 9: singleton -> 0
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0, 7.0])
    groups = [0, 0, 1, 1, 1, 9]
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    centred = [0.5, -0.5, -1.0, -1.0, 2.0]
    # whitened over the valid *tokens* of the non-singleton rows (longer rows weigh more):
    tokens = [0.5] * 3 + [-0.5] + [-1.0] * 2 + [-1.0] + [2.0] * 2
    mean, std = statistics.mean(tokens), statistics.stdev(tokens)  # 2/9, unbiased std
    w = [(c - mean) / math.sqrt(std**2 + 1e-8) for c in centred]
    expected = [[w[0]] * 3, [w[1], 0, 0], [w[2], w[2], 0], [w[3], 0, 0], [w[4], w[4], 0], [0, 0, 0]]
    adv = reinforce_pp_baseline_advantages(scores, groups, response_mask=mask)
    close(adv, expected, atol=1e-5)
    valid = adv[mask.bool() & torch.tensor([True] * 5 + [False])[:, None]]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-5)


def test_reinforce_pp_baseline_degenerate_batches_are_zero_not_nan() -> None:
    mask = torch.tensor([[1, 1], [1, 0]])
    close(reinforce_pp_baseline_advantages(torch.tensor([1.0, 2.0]), [0, 1], response_mask=mask), [[0, 0], [0, 0]])
    close(reinforce_pp_baseline_advantages(torch.tensor([3.0, 3.0]), [0, 0], response_mask=mask), [[0, 0], [0, 0]])


# --- outcome-score adapters of the token-level estimators ------------------------------------


def test_outcome_token_rewards() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])  # row 1 has a hole, row 2 is empty
    dense = torch.tensor([[-0.1, -0.2, NAN], [-0.3, 99.0, -0.4], [1.0, 1.0, 1.0]])
    close(outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask), [[0, 1, 0], [0, 0, 2], [0, 0, 0]])
    close(outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, dense), [[-0.1, 0.8, 0], [-0.3, 0, 1.6], [0, 0, 0]])


def test_reinforce_pp_outcome_hand_values() -> None:
    # token rewards [[0, 1, 0], [0, 0, 0]] ; gamma 0.5 -> returns 0.5, 1 | 0 ; mean 0.5, unbiased std 0.5
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = reinforce_pp_outcome_advantages(torch.tensor([1.0, 0.0]), [0, 1], response_mask=mask, gamma=0.5)
    close(adv, [[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]], atol=1e-6)


def test_gae_outcome_matches_gae_hand_values() -> None:
    # REWARDS above are exactly outcome score 1 on each row's last valid token.
    adv = gae_outcome_advantages(torch.tensor([1.0, 1.0]), None, response_mask=MASK, values=VALUES, gamma=GAMMA, lam=LAM)
    close(adv, EXPECTED_ADV)


# --- registry ------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_advantages
    assert losses.ADVANTAGE_ESTIMATORS is ADVANTAGE_ESTIMATORS
    for name in [
        "dr_grpo_advantages",
        "reinforce_pp_baseline_advantages",
        "reinforce_pp_outcome_advantages",
        "gae_outcome_advantages",
        "outcome_token_rewards",
    ]:
        assert name in losses.__all__ and hasattr(losses, name)


def test_registry_one_calling_convention() -> None:
    # (scores, group_index, response_mask=...) -> [N, T], 0 at masked positions; rows 4/5 are a singleton group.
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 0]])
    extra = {"gae": {"values": torch.full((5, 3), 0.25)}}
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        adv = fn(scores, groups, response_mask=mask, **extra.get(name, {}))
        assert adv.shape == (5, 3) and torch.isfinite(adv).all(), name
        assert (adv[~mask.bool()] == 0).all(), name
        if name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
            assert (adv[4] == 0).all(), name  # singleton group
