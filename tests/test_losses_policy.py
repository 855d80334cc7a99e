"""PPO policy/value losses, aggregation, KL penalties and controllers against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from verl_core.losses import POLICY_LOSSES as EXPORTED_POLICY_LOSSES
from verl_core.losses.policy import (
    AGG_MODES,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    cispo_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    ppo_value_loss,
)

NAN = float("nan")


def log_ratios(*ratios: float) -> torch.Tensor:
    return torch.tensor([[math.log(r) for r in ratios]])


# --- aggregation ---------------------------------------------------------------------------

LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, 99.0, NAN, 99.0], [7.0, 7.0, 7.0, 7.0]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # row 2: no valid token


@pytest.mark.parametrize(
    "agg, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),  # 5.0; empty row 2 left out
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # 3.0
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) + 4) / 2 / 4),  # 1.25; constant = T = 4
    ],
)
def test_aggregate_modes_with_padding(agg: str, expected: float) -> None:
    assert aggregate(LOSS_MAT, AGG_MASK, agg).item() == pytest.approx(expected)


def test_aggregate_sum_norm_constant() -> None:
    # The normaliser is a constant, not the response lengths: ((1+2+3) + 4) / 2 / 10
    assert aggregate(LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm", norm_constant=10).item() == pytest.approx(0.5)
    assert aggregate(LOSS_MAT, AGG_MASK, "token-mean", norm_constant=10).item() == pytest.approx(2.5)  # ignored
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm", norm_constant=0)
    assert set(AGG_MODES) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}


def test_aggregate_unknown_lists_names() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(LOSS_MAT, AGG_MASK, "token-sum")


# --- PPO policy loss -----------------------------------------------------------------------


def test_ppo_policy_loss_hand_values_and_clipping() -> None:
    # ratios 1.5, 0.5, 1.1, 0.7 ; advantages 1, -1, 2, 1 ; clip range [0.8, 1.2]
    #   t0: max(-1.5, -1.2) = -1.2   clipped term active
    #   t1: max( 0.5,  0.8) =  0.8   clipped term active
    #   t2: max(-2.2, -2.2) = -2.2   inside the range
    #   t3: max(-0.7, -0.8) = -0.7   outside the range but the unclipped term is the max
    old = torch.zeros(1, 4)
    logp = log_ratios(1.5, 0.5, 1.1, 0.7).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0]])
    out = ppo_policy_loss(old, logp, adv, torch.ones(1, 4))
    assert out.loss.item() == pytest.approx((-1.2 + 0.8 - 2.2 - 0.7) / 4)  # -0.825
    assert out.clip_fraction.item() == pytest.approx(0.5)
    k2 = 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2 + math.log(1.1) ** 2 + math.log(0.7) ** 2)
    assert out.approx_kl.item() == pytest.approx(k2 / 4)
    assert not out.clip_fraction.requires_grad and not out.approx_kl.requires_grad

    out.loss.backward()
    # d/dlogp of -A*rho/4 = -A*rho/4 on unclipped tokens; 0 where the clip is active.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -2.2 / 4, -0.7 / 4]]))


def test_ppo_policy_loss_clip_higher() -> None:
    # clip_high 0.28: t0 (ratio 1.5, A=1) is clipped at 1.28 instead of 1.2.
    old = torch.zeros(1, 2)
    logp = log_ratios(1.5, 0.5)
    adv = torch.tensor([[1.0, -1.0]])
    out = ppo_policy_loss(old, logp, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx((-1.28 + 0.8) / 2)


def test_ppo_policy_loss_dual_clip() -> None:
    # c = 3, ratios 5, 2, 5, 0.5 ; advantages -1, -1, 1, -1
    #   t0: max(5, 1.2) = 5, A<0 -> min(5, 3) = 3     dual clip active
    #   t1: max(2, 1.2) = 2, A<0 -> min(2, 3) = 2     unclipped
    #   t2: max(-5, -1.2) = -1.2 (A>0: no dual clip)  clipped
    #   t3: max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8     clipped
    old = torch.zeros(1, 4)
    logp = log_ratios(5.0, 2.0, 5.0, 0.5)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    out = ppo_policy_loss(old, logp, adv, torch.ones(1, 4), dual_clip=3.0)
    assert out.loss.item() == pytest.approx((3 + 2 - 1.2 + 0.8) / 4)  # 1.15
    assert out.clip_fraction.item() == pytest.approx(3 / 4)
    without = ppo_policy_loss(old, logp, adv, torch.ones(1, 4))
    assert without.loss.item() == pytest.approx((5 + 2 - 1.2 + 0.8) / 4)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(old, logp, adv, torch.ones(1, 4), dual_clip=1.0)


def test_ppo_policy_loss_padding_and_agg() -> None:
    # Row 0: tokens (ratio 1.5, A=1) -> -1.2 and (ratio 1.1, A=2) -> -2.2; row 1: (1, A=3) -> -3.
    # Padded positions carry junk (huge log-ratio, NaN advantage).
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, -500.0, 0.0]])
    logp = torch.tensor([[math.log(1.5), math.log(1.1), 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected = {
        "token-mean": (-1.2 - 2.2 - 3.0) / 3,
        "seq-mean-token-sum": ((-1.2 - 2.2) + (-3.0)) / 2,
        "seq-mean-token-mean": ((-1.2 - 2.2) / 2 + (-3.0)) / 2,
        "seq-mean-token-sum-norm": ((-1.2 - 2.2) + (-3.0)) / 2 / 3,
    }
    for agg, value in expected.items():
        out = ppo_policy_loss(old, logp, adv, mask, agg=agg)
        assert out.loss.item() == pytest.approx(value), agg
        assert out.clip_fraction.item() == pytest.approx(1 / 3)
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 2] == 0 and logp.grad[1, 1] == 0


def test_ppo_at_old_policy_is_neutral() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -7.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5], [3.0, -1.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = ppo_policy_loss(logp.clone(), logp, adv, mask)
    # ratio 1 everywhere: loss = -mean(A) over valid tokens = -(1 - 2 + 0.5 + 3 - 1) / 5
    assert out.loss.item() == pytest.approx(-1.5 / 5)
    assert out.clip_fraction.item() == 0.0
    assert out.approx_kl.item() == 0.0
    for kind in ["k1", "abs", "k2", "mse", "k3", "low_var_kl"]:
        assert torch.equal(kl_penalty(logp, logp.clone(), kind), torch.zeros_like(logp)), kind


# --- registry ------------------------------------------------------------------------------


def test_policy_loss_registry_one_convention() -> None:
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "cispo"}
    assert EXPORTED_POLICY_LOSSES is POLICY_LOSSES and POLICY_LOSSES["vanilla"] is ppo_policy_loss
    old = torch.zeros(2, 3)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, -4.0]]) * 0.01
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for name, fn in POLICY_LOSSES.items():
        for agg in AGG_MODES:
            out = fn(old, logp, adv, mask, clip_low=0.2, clip_high=0.2, agg=agg, dual_clip=None, norm_constant=None)
            assert torch.isfinite(out.loss) and out.loss.ndim == 0, (name, agg)
            assert not out.clip_fraction.requires_grad and not out.approx_kl.requires_grad
    # the positional call of the trainer still works
    positional = ppo_policy_loss(old, logp, adv, mask, 0.2, 0.28, None, "token-mean")
    keyword = POLICY_LOSSES["vanilla"](old, logp, adv, mask, clip_low=0.2, clip_high=0.28, agg="token-mean")
    assert positional.loss.item() == keyword.loss.item()


# --- GSPO ----------------------------------------------------------------------------------


def test_gspo_sequence_ratio_hand_values_and_gradient() -> None:
    # Row 0: log-ratios 0.1, -0.3 -> s_0 = exp(-0.1) = 0.904837, A = 1 on both tokens.
    # Row 1: log-ratio 0.2 then a padded junk token -> s_1 = exp(0.2) = 1.221403, A = -1.
    # clip [0.8, 1.2]: s_0 inside; s_1 > 1.2 but A < 0, so the unclipped term 1.221403 is the max.
    s0, s1 = math.exp(-0.1), math.exp(0.2)
    old = torch.tensor([[-1.0, -1.0], [-2.0, 50.0]])
    logp = (old + torch.tensor([[0.1, -0.3], [0.2, 0.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, NAN]])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = gspo_policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.2)  # seq-mean-token-mean
    assert out.loss.item() == pytest.approx((-s0 + s1) / 2)
    assert out.clip_fraction.item() == 0.0
    assert out.approx_kl.item() == pytest.approx(0.5 * (0.01 + 0.09 + 0.04) / 3)
    out.loss.backward()
    # d/dlogp_t = -A * s_i * (1/2 seqs) * (1/n_i): the *sequence* ratio, the same on every token of a row
    # (a token ratio would give exp(0.1) and exp(-0.3) on row 0).
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 4, -s0 / 4], [s1 / 2, 0.0]]))


def test_gspo_small_clip_range() -> None:
    # GSPO defaults 3e-4 / 4e-4. Row 0: s = exp(1e-3) > 1.0004, A = 1 -> clipped at 1.0004, no gradient.
    # Row 1: s = exp(-1e-3) < 0.9997, A = 1 -> unclipped (-0.9990 > -0.9997). Row 2: same s, A = -1 -> clipped at 0.9997.
    old = torch.zeros(3, 2)
    logp = torch.tensor([[0.0, 2e-3], [-2e-3, 0.0], [-1e-3, -1e-3]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]])
    out = gspo_policy_loss(old, logp, adv, torch.ones(3, 2))
    s_down = math.exp(-1e-3)
    assert out.loss.item() == pytest.approx((-1.0004 - s_down + 0.9997) / 3)
    assert out.clip_fraction.item() == pytest.approx(4 / 6)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-s_down / 6, -s_down / 6], [0.0, 0.0]]))


def test_gspo_token_form_matches_sequence_objective() -> None:
    # With one advantage per sequence, the token form has the gradient of mean_i(-A_i * s_i).
    torch.manual_seed(0)
    old = -torch.rand(3, 5)
    logp = (old + 0.05 * torch.randn(3, 5)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    seq_adv = torch.tensor([0.7, -1.3, 0.4])
    out = gspo_policy_loss(old, logp, seq_adv[:, None].expand(3, 5), mask, clip_low=10.0, clip_high=10.0)
    (grad,) = torch.autograd.grad(out.loss, logp)

    logp_ref = logp.detach().clone().requires_grad_(True)
    s = torch.exp(((logp_ref - old) * mask).sum(-1) / mask.sum(-1))
    reference = (-seq_adv * s).mean()
    reference.backward()
    assert out.loss.item() == pytest.approx(reference.item())
    torch.testing.assert_close(grad, logp_ref.grad)


def test_gspo_equals_ppo_when_token_ratios_equal_within_rows() -> None:
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, 0.3, 0.3], [-0.4, -0.4, 0.0]])  # row 1: 2 valid tokens
    adv = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for agg in AGG_MODES:
        for dual in (None, 1.2):
            gspo = gspo_policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.2, agg=agg, dual_clip=dual)
            ppo = ppo_policy_loss(old, logp, adv, mask, 0.2, 0.2, dual, agg)
            assert gspo.loss.item() == pytest.approx(ppo.loss.item()), (agg, dual)
            assert gspo.clip_fraction.item() == pytest.approx(ppo.clip_fraction.item())


# --- CISPO ---------------------------------------------------------------------------------


def test_cispo_hand_values_and_detached_weight_gradient() -> None:
    # ratios 1.5, 0.5, 1.1 ; A = 1, -1, 2 ; logp = -1, -2, -0.5 ; clip_high 0.2, no lower bound:
    #   w = 1.2 (clipped), 0.5, 1.1 ; L = -w A logp = 1.2, -1.0, 1.1
    logp = torch.tensor([[-1.0, -2.0, -0.5, 7.0]], requires_grad=True)
    old = logp.detach() - log_ratios(1.5, 0.5, 1.1, 1.0)
    adv = torch.tensor([[1.0, -1.0, 2.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = cispo_policy_loss(old, logp, adv, mask, clip_high=0.2)
    assert out.loss.item() == pytest.approx((1.2 - 1.0 + 1.1) / 3)
    assert out.clip_fraction.item() == pytest.approx(1 / 3)
    out.loss.backward()
    # gradient -w * A / 3 with w detached; the clipped token 0 keeps a gradient (PPO would give 0).
    # (Not detaching w would add -A * logp * rho on unclipped tokens: token 2 would get -(2.2 - 1.1) / 3.)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2 / 3, 0.5 / 3, -2.2 / 3, 0.0]]))


def test_cispo_bounds() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach() - log_ratios(1.5, 0.5, 1.1)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    # lower bound 0.8 too: w = 1.2, 0.8, 1.1 ; L = 1.2, -1.6, 1.1
    both = cispo_policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.2)
    assert both.loss.item() == pytest.approx((1.2 - 1.6 + 1.1) / 3)
    assert both.clip_fraction.item() == pytest.approx(2 / 3)
    both.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2 / 3, 0.8 / 3, -2.2 / 3]]))
    # no bounds: plain IS-weighted policy gradient, w = rho
    free = cispo_policy_loss(old, logp, adv, mask, clip_low=None, clip_high=None)
    assert free.loss.item() == pytest.approx((1.5 - 1.0 + 1.1) / 3)
    assert free.clip_fraction.item() == 0.0
    with pytest.raises(ValueError, match="dual clip"):
        cispo_policy_loss(old, logp, adv, mask, dual_clip=3.0)


# --- KL penalties --------------------------------------------------------------------------


def test_kl_penalty_hand_values() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])  # d = logp - ref = 0.5, -1.0
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([[0.5, 1.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    # k3 = exp(-d) + d - 1
    k3 = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), k3)
    # extreme token: clamped to 10, finite gradient
    far = torch.tensor([[-30.0]], requires_grad=True)
    value = kl_penalty(far, torch.tensor([[0.0]]), "k3")
    assert value.item() == 10.0
    value.sum().backward()
    assert torch.isfinite(far.grad).all()
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "k4")


# --- value loss ----------------------------------------------------------------------------


def test_ppo_value_loss_hand_values() -> None:
    # eps = 0.2; 4th token is padding.
    #   t0: V=1.2, old=0.8 -> V_clip=1.0, R=1.5: (0.3^2=0.09, 0.5^2=0.25) -> 0.25 clipped active
    #   t1: V=0.5, old=0.5 -> V_clip=0.5, R=0.0: (0.25, 0.25) -> 0.25
    #   t2: V=2.0, old=1.0 -> V_clip=1.2, R=1.1: (0.81, 0.01) -> 0.81 unclipped
    values = torch.tensor([[1.2, 0.5, 2.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.8, 0.5, 1.0, NAN]])
    returns = torch.tensor([[1.5, 0.0, 1.1, -50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = ppo_value_loss(values, old, returns, mask, clip_range=0.2)
    assert out.loss.item() == pytest.approx(0.5 * (0.25 + 0.25 + 0.81) / 3)
    assert out.clip_fraction.item() == pytest.approx(1 / 3)
    unclipped = ppo_value_loss(values, old, returns, mask, clip_range=None)
    assert unclipped.loss.item() == pytest.approx(0.5 * (0.09 + 0.25 + 0.81) / 3)
    assert unclipped.clip_fraction.item() == 0.0


# --- KL controllers ------------------------------------------------------------------------


def test_adaptive_kl_controller_hand_values() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 9: error (9-6)/6 = 0.5 clipped to 0.2 -> 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    assert ctl.update(current_kl=9.0, n_steps=256) == pytest.approx(0.100512)
    # KL 5.4: error -0.1 -> * (1 - 0.1 * 1000 / 10000) = * 0.99
    assert ctl.update(current_kl=5.4, n_steps=1000) == pytest.approx(0.100512 * 0.99)
    assert ctl.value == pytest.approx(0.09950688)
    # KL far below: error clipped to -0.2
    assert ctl.update(current_kl=0.0, n_steps=10000) == pytest.approx(0.09950688 * 0.8)


def test_fixed_kl_controller() -> None:
    ctl = FixedKLController(kl_coef=0.05)
    assert ctl.update(current_kl=100.0, n_steps=10) == 0.05
    assert ctl.value == 0.05
