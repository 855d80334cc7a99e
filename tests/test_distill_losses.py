"""Distillation losses (verl_core.losses.distill): hand-computed values on a 3-token vocabulary,
masking, the GKD endpoints beta = 0 / 1, and the chunked paths equal to the one-shot one."""

from __future__ import annotations

import math

import pytest
import torch

from verl_core.losses.distill import (
    DISTILL_LOSSES,
    generalized_jsd,
    generalized_jsd_tokens,
    jsd_rows,
    linear_generalized_jsd_tokens,
    reverse_kl_advantages,
    sampled_reverse_kl,
)

S = [0.6, 0.3, 0.1]  # student distribution
T = [0.2, 0.2, 0.6]  # teacher distribution


def _logits(p: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(x) for x in p], dtype=torch.float64) + 1.7  # a shift the softmax ignores


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_registry_names():
    assert set(DISTILL_LOSSES) == {"reverse_kl", "jsd"}


def test_sampled_reverse_kl_and_its_advantage_by_hand():
    s = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, float("nan")]])
    t = torch.tensor([[-1.5, -0.5, -0.5], [-0.7, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    k = sampled_reverse_kl(s, t, mask)
    assert torch.allclose(k, torch.tensor([[0.5, -1.5, 0.0], [0.5, -2.0, 0.0]]))  # NaN off the mask -> exact 0
    adv = reverse_kl_advantages(s.requires_grad_(), t, mask)
    assert not adv.requires_grad and torch.allclose(adv, -k)


def test_jsd_endpoints_are_the_forward_and_reverse_kl():
    zs, zt = _logits(S)[None], _logits(T)[None]
    assert jsd_rows(zs, zt, 0.0).item() == pytest.approx(_kl(T, S), abs=1e-12)  # beta 0: KL(teacher || student)
    assert jsd_rows(zs, zt, 1.0).item() == pytest.approx(_kl(S, T), abs=1e-12)  # beta 1: KL(student || teacher)


@pytest.mark.parametrize("beta", [0.5, 0.1, 0.9])
def test_jsd_by_hand_with_the_mixture_weighted_toward_the_teacher(beta):
    m = [beta * t + (1 - beta) * s for s, t in zip(S, T)]
    expected = beta * _kl(T, m) + (1 - beta) * _kl(S, m)
    assert jsd_rows(_logits(S)[None], _logits(T)[None], beta).item() == pytest.approx(expected, abs=1e-12)


def test_jsd_half_by_hand_numbers():
    # M = [0.4, 0.25, 0.35]
    expected = 0.5 * (0.2 * math.log(0.2 / 0.4) + 0.2 * math.log(0.2 / 0.25) + 0.6 * math.log(0.6 / 0.35))
    expected += 0.5 * (0.6 * math.log(0.6 / 0.4) + 0.3 * math.log(0.3 / 0.25) + 0.1 * math.log(0.1 / 0.35))
    assert jsd_rows(_logits(S)[None], _logits(T)[None], 0.5).item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(0.1564, abs=1e-4)  # 0.0701 + 0.0864


def test_temperature_divides_both_logits():
    zs, zt = _logits(S)[None], _logits(T)[None]
    assert torch.allclose(jsd_rows(zs, zt, 0.5, temperature=2.0), jsd_rows(zs / 2, zt / 2, 0.5))


def test_jsd_is_zero_for_equal_distributions_and_handles_zero_probabilities():
    z = torch.tensor([[0.0, float("-inf"), 1.0]])
    for beta in (0.0, 0.3, 1.0):
        assert jsd_rows(z, z.clone(), beta).item() == pytest.approx(0.0, abs=1e-6)  # fp32 rounding only


def test_jsd_mean_is_over_masked_tokens_only():
    zs = torch.stack([_logits(S), _logits(T), _logits(S)])[None]  # [1, 3, 3]
    zt = torch.stack([_logits(T), _logits(T), torch.full((3,), float("nan"), dtype=torch.float64)])[None]
    mask = torch.tensor([[1, 1, 0]])
    expected = (_kl(S, T) + 0.0) / 2  # beta 1; the NaN row is masked away
    assert generalized_jsd(zs, zt, mask, beta=1.0).item() == pytest.approx(expected, abs=1e-12)
    assert generalized_jsd(zs, zt, torch.zeros_like(mask), beta=1.0).item() == 0.0


def test_chunked_jsd_equals_one_chunk_in_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    zs = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 5, generator=g) > 0.3).long()
    values, grads = [], []
    for chunk in (None, 1, 2, 7):
        loss = generalized_jsd(zs, zt, mask, beta=0.3, temperature=0.7, chunk_tokens=chunk)
        (grad,) = torch.autograd.grad(loss, zs)
        values.append(loss)
        grads.append(grad)
    for v, gr in zip(values[1:], grads[1:]):
        assert torch.allclose(v, values[0], atol=1e-12) and torch.allclose(gr, grads[0], atol=1e-12)
    assert (grads[0][~mask.bool()] == 0).all()  # masked positions get no gradient


def test_linear_jsd_equals_the_logits_path():
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(13, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ht, wt = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.randn(13, 4, generator=g, dtype=torch.float64)
    ones = torch.ones(9, dtype=torch.long)
    full = generalized_jsd_tokens(hs @ ws.t(), ht @ wt.t(), ones, beta=0.5)
    chunked = linear_generalized_jsd_tokens(hs, ws, ht, wt, beta=0.5, chunk_tokens=2)
    assert torch.allclose(full, chunked, atol=1e-12)
    g_full = torch.autograd.grad(full.sum(), (hs, ws))
    g_chunk = torch.autograd.grad(chunked.sum(), (hs, ws))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(g_full, g_chunk))


def test_bad_beta_and_shapes_are_refused():
    z = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="beta"):
        jsd_rows(z, z, 1.5)
    with pytest.raises(ValueError, match="differ"):
        generalized_jsd(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), torch.ones(1, 2))
