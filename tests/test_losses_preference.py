"""Tests for verl_core.losses.preference.

Expected values are written out by hand with math.log / math.exp, never by
calling the function under test.
"""

import math

import pytest
import torch

from verl_core.losses.preference import (
    DPO_LOSS_TYPES,
    dpo_loss,
    kto_loss,
    mismatched_indices,
    orpo_loss,
    sequence_logps,
    sequence_mean_logps,
    simpo_loss,
)

LN2 = math.log(2.0)


def t(values, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def neg_logsig(x: float) -> float:
    """-log sigma(x) = log(1 + exp(-x))."""
    return math.log(1.0 + math.exp(-x))


def assert_close(actual: torch.Tensor, expected: list[float], tol: float = 1e-10) -> None:
    assert actual.shape == (len(expected),)
    for a, e in zip(actual.tolist(), expected):
        assert abs(a - e) < tol, f"{actual.tolist()} != {expected}"


# ---------------------------------------------------------------- sequence log-probs


def test_sequence_logps_ignores_masked_garbage():
    token_logps = t([[1e30, -0.5, -1.25, 9e20], [-7.0, -0.1, -0.2, -0.3]])
    token_logps[0, 3] = float("inf")  # padding may hold anything
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    assert_close(sequence_logps(token_logps, mask), [-1.75, -0.5])
    assert_close(sequence_mean_logps(token_logps, mask), [-0.875, -0.25])


def test_sequence_mean_logps_empty_mask_is_zero_not_nan():
    token_logps = t([[-1.0, -2.0], [-3.0, -4.0]])
    mask = torch.tensor([[0, 0], [1, 1]])
    assert_close(sequence_mean_logps(token_logps, mask), [0.0, -3.5])


def test_sequence_logps_gradient_only_on_masked_tokens():
    token_logps = t([[-1.0, -2.0, -3.0]], grad=True)
    sequence_logps(token_logps, torch.tensor([[0, 1, 1]])).sum().backward()
    assert token_logps.grad.tolist() == [[0.0, 1.0, 1.0]]


# ---------------------------------------------------------------- DPO

# Shared fixture: z = (pc - rc) - (pr - rr) = [1.0, -1.5]
PC, PR, RC, RR = [-1.0, -3.0], [-2.0, -1.0], [-1.5, -2.0], [-1.5, -1.5]


def _dpo(beta, loss_type, **kw):
    return dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=beta, loss_type=loss_type, **kw)


def test_dpo_sigmoid_at_reference_is_ln2():
    torch.manual_seed(0)
    pc, pr = torch.randn(16, dtype=torch.float64) * 5, torch.randn(16, dtype=torch.float64) * 5
    out = dpo_loss(pc, pr, pc.clone(), pr.clone(), beta=0.37)
    assert torch.all((out.losses - LN2).abs() < 1e-12)
    assert torch.all(out.chosen_rewards == 0) and torch.all(out.rejected_rewards == 0)


def test_dpo_sigmoid_hand_values():
    out = _dpo(0.5, "sigmoid")  # beta z = [0.5, -0.75]
    assert_close(out.losses, [neg_logsig(0.5), neg_logsig(-0.75)])
    assert_close(out.chosen_rewards, [0.25, -0.5])
    assert_close(out.rejected_rewards, [-0.25, 0.25])


def test_dpo_sigmoid_label_smoothing_is_cdpo():
    out = _dpo(0.5, "sigmoid", label_smoothing=0.1)
    expected = [0.9 * neg_logsig(bz) + 0.1 * neg_logsig(-bz) for bz in (0.5, -0.75)]
    assert_close(out.losses, expected)


def test_dpo_robust_hand_values():
    out = _dpo(0.5, "robust", label_smoothing=0.1)
    expected = [(0.9 * neg_logsig(bz) - 0.1 * neg_logsig(-bz)) / 0.8 for bz in (0.5, -0.75)]
    assert_close(out.losses, expected)
    # eps = 0 reduces to plain DPO
    assert_close(_dpo(0.5, "robust").losses, [neg_logsig(0.5), neg_logsig(-0.75)])


def test_dpo_robust_rejects_eps_half():
    with pytest.raises(ValueError, match="label_smoothing"):
        _dpo(0.5, "robust", label_smoothing=0.5)


def test_dpo_hinge_hand_values():
    # beta z = [2, -3] -> relu(1 - 2) = 0, relu(1 + 3) = 4
    assert_close(_dpo(2.0, "hinge").losses, [0.0, 4.0])
    assert_close(_dpo(0.5, "hinge").losses, [0.5, 1.75])


def test_dpo_ipo_hand_values_length_normalised():
    lc, lr = t([2.0, 4.0]), t([5.0, 1.0])
    out = _dpo(0.5, "ipo", chosen_lengths=lc, rejected_lengths=lr)
    # chosen ratio [0.5, -1] / [2, 4] = [0.25, -0.25]; rejected [-0.5, 0.5] / [5, 1] = [-0.1, 0.5]
    # z_norm = [0.35, -0.75]; 1/(2 beta) = 1
    assert_close(out.losses, [(0.35 - 1.0) ** 2, (-0.75 - 1.0) ** 2])
    # rewards stay unnormalised beta * (policy - ref)
    assert_close(out.chosen_rewards, [0.25, -0.5])


def test_dpo_ipo_with_premeaned_logps_and_unit_lengths():
    ones = torch.ones(2, dtype=torch.float64)
    out = _dpo(0.5, "ipo", chosen_lengths=ones, rejected_lengths=ones)  # z = [1, -1.5]
    assert_close(out.losses, [0.0, 6.25])


def test_dpo_ipo_requires_lengths():
    with pytest.raises(ValueError, match="ipo"):
        _dpo(0.5, "ipo")
    with pytest.raises(ValueError, match="ipo"):
        _dpo(0.5, "ipo", chosen_lengths=t([1.0, 1.0]))


def test_dpo_unknown_loss_type_names_it():
    with pytest.raises(ValueError, match="bogus_loss") as info:
        _dpo(0.5, "bogus_loss")
    for name in DPO_LOSS_TYPES:
        assert name in str(info.value)


@pytest.mark.parametrize("loss_type", sorted(DPO_LOSS_TYPES))
def test_dpo_rewards_detached_losses_have_grad(loss_type):
    pc, pr = t(PC, grad=True), t(PR, grad=True)
    lengths = t([2.0, 3.0])
    out = dpo_loss(pc, pr, t(RC), t(RR), beta=0.5, loss_type=loss_type, chosen_lengths=lengths, rejected_lengths=lengths)
    assert out.losses.requires_grad
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
    out.losses.sum().backward()
    assert pc.grad is not None and torch.isfinite(pc.grad).all()


# ---------------------------------------------------------------- KTO

KP, KR = [-1.0, -2.0, -3.0], [-1.5, -1.5, -3.0]  # r = [0.5, -0.5, 0.0]
LABELS = torch.tensor([True, False, True])


def test_kto_at_reference_is_half():
    torch.manual_seed(1)
    p, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    labels = torch.tensor([True, False] * 4)
    out = kto_loss(p, p.clone(), labels, k, k.clone(), beta=0.3)
    assert torch.all(out.losses == 0.5)
    assert out.kl.item() == 0.0


def test_kto_hand_values_with_kl_and_weights():
    kl_policy = t([-1.0, -2.0, -3.0])
    kl_ref = t([-1.3, -2.3, -3.3])  # z0 = 0.3
    out = kto_loss(t(KP), t(KR), LABELS, kl_policy, kl_ref, beta=0.5, desirable_weight=2.0, undesirable_weight=1.5)
    expected = [
        2.0 * (1 - sig(0.5 * (0.5 - 0.3))),
        1.5 * (1 - sig(0.5 * (0.3 - (-0.5)))),
        2.0 * (1 - sig(0.5 * (0.0 - 0.3))),
    ]
    assert_close(out.losses, expected)
    assert abs(out.kl.item() - 0.3) < 1e-10
    assert_close(out.rewards, [0.25, -0.25, 0.0])


def test_kto_negative_kl_is_clamped_to_zero():
    kl_policy = t([-1.3, -2.3, -3.3])
    kl_ref = t([-1.0, -2.0, -3.0])  # mean diff -0.3 -> z0 = 0
    out = kto_loss(t(KP), t(KR), LABELS, kl_policy, kl_ref, beta=0.5)
    assert out.kl.item() == 0.0
    assert_close(out.losses, [1 - sig(0.25), 1 - sig(0.25), 0.5])


def test_kto_reduce_kl_applied_before_clamp():
    kl_policy, kl_ref = t([-1.0, -2.0, -3.0]), t([-1.3, -2.3, -3.3])  # local z0 = 0.3
    doubled = kto_loss(t(KP), t(KR), LABELS, kl_policy, kl_ref, beta=0.5, reduce_kl=lambda z: 2 * z)
    assert abs(doubled.kl.item() - 0.6) < 1e-10
    assert_close(doubled.losses[:1], [1 - sig(0.5 * (0.5 - 0.6))])
    negated = kto_loss(t(KP), t(KR), LABELS, kl_policy, kl_ref, beta=0.5, reduce_kl=lambda z: -z)
    assert negated.kl.item() == 0.0


def test_kto_rewards_and_kl_detached():
    p, kl_p = t(KP, grad=True), t([-1.0, -2.0, -3.0], grad=True)
    out = kto_loss(p, t(KR), LABELS, kl_p, t([-1.3, -2.3, -3.3]), beta=0.5)
    assert out.losses.requires_grad
    assert not out.rewards.requires_grad and not out.kl.requires_grad
    out.losses.sum().backward()
    assert p.grad is not None and kl_p.grad is None


def test_mismatched_indices():
    idx = mismatched_indices(4)
    assert idx.tolist() == [1, 2, 3, 0]
    assert mismatched_indices(2).tolist() == [1, 0]
    with pytest.raises(ValueError):
        mismatched_indices(1)


# ---------------------------------------------------------------- SimPO


def _simpo(**kw):
    # avg_c = [-4/2, -3/3] = [-2, -1]; avg_r = [-6/3, -2/1] = [-2, -2]
    return simpo_loss(t([-4.0, -3.0], grad=True), t([-6.0, -2.0], grad=True), t([2.0, 3.0]), t([3.0, 1.0]), **kw)


def test_simpo_hand_values():
    out = _simpo(beta=2.0, gamma=0.5)  # x = beta (avg_c - avg_r) - gamma = [-0.5, 1.5]
    assert_close(out.losses, [neg_logsig(-0.5), neg_logsig(1.5)])
    assert_close(out.chosen_rewards, [-4.0, -2.0])
    assert_close(out.rejected_rewards, [-4.0, -4.0])
    assert out.losses.requires_grad and not out.chosen_rewards.requires_grad


def test_simpo_label_smoothing():
    out = _simpo(beta=2.0, gamma=0.5, label_smoothing=0.2)
    assert_close(out.losses, [0.8 * neg_logsig(x) + 0.2 * neg_logsig(-x) for x in (-0.5, 1.5)])


# ---------------------------------------------------------------- ORPO


def log_odds(avg: float) -> float:
    return avg - math.log(1.0 - math.exp(avg))


def test_orpo_hand_values():
    # avg_c = [-1/2, -6/3] = [-0.5, -2.0]; avg_r = [-3/3, -1/4] = [-1.0, -0.25]
    pc, pr = t([-1.0, -6.0], grad=True), t([-3.0, -1.0], grad=True)
    nll = t([0.5, 2.0], grad=True)
    out = orpo_loss(pc, pr, t([2.0, 3.0]), t([3.0, 4.0]), nll, lam=0.1)
    ratios = [log_odds(-0.5) - log_odds(-1.0), log_odds(-2.0) - log_odds(-0.25)]
    assert_close(out.log_odds_ratio, ratios)
    assert_close(out.losses, [0.5 + 0.1 * neg_logsig(ratios[0]), 2.0 + 0.1 * neg_logsig(ratios[1])])
    assert_close(out.chosen_rewards, [-0.05, -0.2])
    assert_close(out.rejected_rewards, [-0.1, -0.025])
    assert out.losses.requires_grad
    assert not out.chosen_rewards.requires_grad and not out.log_odds_ratio.requires_grad
    out.losses.sum().backward()
    assert torch.isfinite(pc.grad).all() and torch.isfinite(pr.grad).all()


def test_orpo_stable_near_zero_and_very_negative():
    # avg logp == 0 (prob 1) must not give inf/nan; very negative must not underflow to nan
    out = orpo_loss(
        t([0.0, -400.0], grad=True), t([-1e-9, -800.0], grad=True), t([1.0, 4.0]), t([1.0, 4.0]), t([0.0, 0.0]), lam=1.0
    )
    assert torch.isfinite(out.losses).all()
    # for avg << 0, log odds ~= avg, so ratio ~= -100 - (-200) = 100
    assert abs(out.log_odds_ratio[1].item() - 100.0) < 1e-9
    out.losses.sum().backward()
