import math

import pytest
import torch

from gcore_rl.algos import entropy_from_logits, kl_divergence

LOGP = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)  # log_ratio = [0.5, -1.0]


def test_k1_hand_values():
    torch.testing.assert_close(kl_divergence(LOGP, REF, "k1"), torch.tensor([[0.5, -1.0]], dtype=torch.float64))


def test_k2_hand_values():
    torch.testing.assert_close(kl_divergence(LOGP, REF, "k2"), torch.tensor([[0.125, 0.5]], dtype=torch.float64))


def test_k3_hand_values():
    # exp(-0.5) - 1 + 0.5 and exp(1) - 1 - 1
    expected = torch.tensor([[0.10653065971263342, 0.7182818284590451]], dtype=torch.float64)
    torch.testing.assert_close(kl_divergence(LOGP, REF, "k3"), expected, rtol=0, atol=1e-12)


def test_k3_and_k2_non_negative_and_zero_at_equality():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=g, dtype=torch.float64) * 3
    b = torch.randn(16, 32, generator=g, dtype=torch.float64) * 3
    assert (kl_divergence(a, b, "k3") >= 0).all()
    assert (kl_divergence(a, b, "k2") >= 0).all()
    assert torch.equal(kl_divergence(a, a, "k3"), torch.zeros_like(a))


def test_k3_clamps_log_ratio():
    logp = torch.tensor([-100.0, 100.0], dtype=torch.float64, requires_grad=True)
    ref = torch.zeros(2, dtype=torch.float64)
    k3 = kl_divergence(logp, ref, "k3")
    # log_ratio clamped to -20 and +20
    expected = torch.tensor([485165174.4097903, math.exp(-20) - 1 + 20], dtype=torch.float64)
    torch.testing.assert_close(k3, expected, rtol=1e-12, atol=0)
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_unknown_estimator_named_in_error():
    with pytest.raises(ValueError, match="k7"):
        kl_divergence(LOGP, REF, "k7")  # type: ignore[arg-type]


def test_gradient_flows_to_logprobs():
    logp = LOGP.clone().requires_grad_(True)
    kl_divergence(logp, REF, "k3").sum().backward()
    # d/dr (exp(-r) - 1 + r) = 1 - exp(-r)
    expected = torch.tensor([[1 - math.exp(-0.5), 1 - math.e]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)


def test_entropy_uniform_is_log_v():
    logits = torch.full((2, 3, 7), 0.3, dtype=torch.float64)
    ent = entropy_from_logits(logits)
    assert ent.shape == (2, 3)
    torch.testing.assert_close(ent, torch.full((2, 3), math.log(7), dtype=torch.float64))


def test_entropy_hand_value_and_shift_invariance():
    # p = [0.5, 0.25, 0.25] -> H = 1.5 * ln 2
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor(1.0397207708399179, dtype=torch.float64))
    torch.testing.assert_close(entropy_from_logits(logits + 1000.0), torch.tensor(1.0397207708399179, dtype=torch.float64))


def test_entropy_with_masked_vocab_entries():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 0.0]], requires_grad=True)
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([math.log(3)]))
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_one_hot_is_zero():
    logits = torch.tensor([[50.0, -50.0, -50.0]], dtype=torch.float64)
    assert entropy_from_logits(logits).item() == pytest.approx(0.0, abs=1e-12)
