"""Rollout/training mismatch and the TIS weight, computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from verl_core.losses.correction import ROLLOUT_CORRECTIONS, correct_rollout_mismatch, rollout_mismatch, tis_weights
from verl_core.losses.policy import POLICY_LOSSES

pytestmark = pytest.mark.fast


def test_tis_weight_is_the_probability_ratio_capped_and_zero_off_the_mask():
    train = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]])
    rollout = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.4)]])
    mask = torch.tensor([[1, 1, 0]])
    w = tis_weights(train, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.0]]))  # 0.9 / 0.3 = 3 -> capped at 2
    torch.testing.assert_close(tis_weights(train, rollout, torch.ones(1, 3), cap=5.0), torch.tensor([[1.0, 3.0, 0.5]]))
    with pytest.raises(ValueError, match="cap"):
        tis_weights(train, rollout, mask, cap=0)


def test_tis_weight_carries_no_gradient():
    train = torch.zeros(1, 2, requires_grad=True)
    assert not tis_weights(train, torch.zeros(1, 2), torch.ones(1, 2)).requires_grad


def test_mismatch_metrics_by_hand():
    train = torch.tensor([[math.log(0.5), math.log(0.6), 0.0]])
    rollout = torch.tensor([[math.log(0.5), math.log(0.3), 5.0]])  # the last token is off the mask
    m = rollout_mismatch(train, rollout, torch.tensor([[1, 1, 0]]))
    assert m["mismatch/logp_abs_diff_mean"] == pytest.approx(math.log(2) / 2)
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(math.log(2))
    assert m["mismatch/ratio_mean"] == pytest.approx(1.5)
    assert m["mismatch/kl"] == pytest.approx((0 + (2 - 1 - math.log(2))) / 2)  # k3: r - 1 - log r
    assert rollout_mismatch(train, train, torch.ones(1, 3))["mismatch/kl"] == 0


def test_correct_rollout_mismatch_sets_weights_only_when_asked():
    base = {
        "old_logp": torch.tensor([[math.log(0.9)]]),
        "rollout_logp": torch.tensor([[math.log(0.3)]]),
        "response_mask": torch.ones(1, 1),
    }
    exp = dict(base)
    metrics = correct_rollout_mismatch(exp, "none", 2.0)
    assert "rollout_logp" not in exp and "tis_weight" not in exp and metrics["mismatch/ratio_mean"] == pytest.approx(3)
    exp = dict(base)
    metrics = correct_rollout_mismatch(exp, "tis", 2.0)
    assert exp["tis_weight"].item() == pytest.approx(2.0) and metrics["mismatch/tis_weight_mean"] == pytest.approx(2.0)
    assert correct_rollout_mismatch({"response_mask": torch.ones(1, 1)}, "tis", 2.0) == {}
    assert set(ROLLOUT_CORRECTIONS) == {"none", "tis"}


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_scaling_the_advantages_by_the_weight_weights_each_tokens_policy_loss(name):
    """The trainer applies TIS by scaling the advantages. That is the token-weighted loss
    ``sum_t w_t l_t`` because every registered loss is additive over tokens and, per token, positively
    homogeneous in the advantage: ``L(w * A) = sum_t w_t L(e_t * A)``. A loss that is not fails here."""
    torch.manual_seed(0)
    old = torch.randn(2, 3) * 0.1
    logp = old + torch.randn(2, 3) * 0.3  # ratios inside and outside every loss's clip range
    adv, mask = torch.randn(2, 3), torch.ones(2, 3)
    w = torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.25, 1.0]])
    loss = lambda a: POLICY_LOSSES[name](old, logp, a, mask, agg="seq-mean-token-sum").loss.item()  # noqa: E731
    per_token = sum(w[b, t].item() * loss(adv * (torch.arange(6).view(2, 3) == 3 * b + t)) for b in range(2) for t in range(3))
    assert loss(adv * w) == pytest.approx(per_token, rel=1e-5, abs=1e-7)
