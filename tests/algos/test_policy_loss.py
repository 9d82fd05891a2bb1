import math

import pytest
import torch

from gcore_rl.algos import PolicyLossStats, aggregate, masked_mean, masked_sum, ppo_clip_loss
from gcore_rl.algos.policy_loss import behaviour_logprobs

F64 = torch.float64

# Two sequences of three tokens. Ratios (new/old probability) chosen by hand:
#   seq 0, A = +1: ratios 1.5, 0.7, 1.1
#   seq 1, A = -2: ratios 0.5, 1.3, <masked>
RATIOS = [[1.5, 0.7, 1.1], [0.5, 1.3, 1.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
ADV = torch.tensor([1.0, -2.0], dtype=F64)
# With clip_low = 0.2, clip_high = 0.28 (clip range [0.8, 1.28]):
#   seq 0: 1.5 -> min(1.5, 1.28) = 1.28 (clipped) | 0.7 -> min(0.7, 0.8) = 0.7 | 1.1 -> 1.1
#   seq 1: 0.5 -> min(-1.0, -1.6) = -1.6 (clipped) | 1.3 -> min(-2.6, -2.56) = -2.6
# per-token loss = -objective:
PER_TOKEN = [[-1.28, -0.7, -1.1], [1.6, 2.6, 0.0]]


def _inputs():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.2, -1.0]], dtype=F64)
    new = old + torch.log(torch.tensor(RATIOS, dtype=F64))
    new[1, 2] = 50.0  # garbage at the masked position must not matter
    return new.requires_grad_(True), old


def test_ppo_clip_loss_hand_values_token_mean():
    logp, old = _inputs()
    loss, stats = ppo_clip_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.28)
    # (-1.28 - 0.7 - 1.1 + 1.6 + 2.6) / 5
    assert loss.item() == pytest.approx(0.224, abs=1e-12)
    assert isinstance(stats, PolicyLossStats)
    assert stats.clip_fraction == pytest.approx(0.4)  # 2 of 5 valid tokens clipped
    assert stats.ratio_mean == pytest.approx(1.02)  # (1.5 + 0.7 + 1.1 + 0.5 + 1.3) / 5
    assert stats.ratio_max == pytest.approx(1.5)  # the masked 'ratio' exp(51) is ignored
    assert stats.approx_kl == pytest.approx(0.08499910210889652, abs=1e-12)
    assert all(isinstance(v, float) for v in (stats.clip_fraction, stats.approx_kl, stats.ratio_mean, stats.ratio_max))


@pytest.mark.parametrize(
    ("aggregation", "norm_length", "expected"),
    [
        ("seq_mean_token_mean", None, 0.5366666666666666),  # (-3.08 / 3 + 4.2 / 2) / 2
        ("seq_mean_token_sum", None, 0.56),  # (-3.08 + 4.2) / 2
        ("seq_mean_token_sum", 4, 0.14),  # (-3.08 / 4 + 4.2 / 4) / 2
    ],
)
def test_ppo_clip_loss_other_aggregations(aggregation, norm_length, expected):
    logp, old = _inputs()
    loss, _ = ppo_clip_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.28, aggregation=aggregation,
                            norm_length=norm_length)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_ppo_gradient_hand_values_and_zero_when_clipped():
    logp, old = _inputs()
    loss, _ = ppo_clip_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # d(-ratio * A)/d logp = -ratio * A for unclipped tokens, divided by 5 valid tokens.
    # [0,0]: A>0, ratio above 1+clip_high -> clipped -> 0.  [1,0]: A<0, ratio below 1-clip_low -> 0.
    # [0,1]: A>0 but ratio below 1-clip_low: the unclipped (smaller) term is used -> -0.7/5.
    expected = torch.tensor([[0.0, -0.14, -0.22], [0.0, 0.52, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)


def test_ppo_per_token_advantages_and_symmetric_clip():
    logp, old = _inputs()
    adv = ADV.unsqueeze(-1).expand(2, 3).clone()
    loss_bt, _ = ppo_clip_loss(logp, old, adv, MASK, clip_low=0.2, clip_high=0.28)
    loss_b, _ = ppo_clip_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.28)
    assert loss_bt.item() == pytest.approx(loss_b.item(), abs=1e-15)
    # symmetric 0.2: token [0,0] now contributes -1.2 instead of -1.28; [1,1] min(-2.6, -2.4) = -2.6 unchanged
    loss_sym, stats = ppo_clip_loss(logp, old, ADV, MASK)
    assert loss_sym.item() == pytest.approx((-1.2 - 0.7 - 1.1 + 1.6 + 2.6) / 5, abs=1e-12)
    assert stats.clip_fraction == pytest.approx(0.4)


def test_ppo_on_policy_ratio_one():
    logp = torch.tensor([[-0.3, -1.2]], dtype=F64, requires_grad=True)
    loss, stats = ppo_clip_loss(logp, logp.detach().clone(), torch.tensor([2.0], dtype=F64), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-2.0)
    assert stats == PolicyLossStats(clip_fraction=0.0, approx_kl=0.0, ratio_mean=1.0, ratio_max=1.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0]], dtype=F64))


def test_ppo_grad_only_wrt_logprobs():
    logp, old = _inputs()
    old = old.clone().requires_grad_(True)
    adv = ADV.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(logp, old, adv, MASK)
    loss.backward()
    assert old.grad is None and adv.grad is None
    assert logp.grad is not None


def test_ppo_empty_mask_is_zero_and_finite():
    logp, old = _inputs()
    loss, stats = ppo_clip_loss(logp, old, ADV, torch.zeros(2, 3, dtype=torch.bool))
    assert loss.item() == 0.0
    assert stats == PolicyLossStats(0.0, 0.0, 0.0, 0.0)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3, dtype=F64))


def test_ppo_shape_errors():
    logp, old = _inputs()
    with pytest.raises(ValueError):
        ppo_clip_loss(logp, old, torch.zeros(3, dtype=F64), MASK)
    with pytest.raises(ValueError):
        ppo_clip_loss(logp, old[:, :2], ADV, MASK)


PT = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]], dtype=F64)
PT_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=F64)


@pytest.mark.parametrize(
    ("mode", "norm_length", "expected"),
    [
        ("token_mean", None, 40.0 / 6),  # (1+2+3+4+10+20) / 6 valid tokens
        ("seq_mean_token_mean", None, 8.75),  # (2.5 + 15) / 2 non-empty sequences
        ("seq_mean_token_sum", None, 20.0),  # (10 + 30) / 2
        ("seq_mean_token_sum", 5, 4.0),  # (10/5 + 30/5) / 2
    ],
)
def test_aggregate_hand_values(mode, norm_length, expected):
    out = aggregate(PT, PT_MASK, mode, norm_length=norm_length)
    assert out.dim() == 0
    assert out.item() == pytest.approx(expected, abs=1e-12)


def test_aggregate_errors():
    with pytest.raises(ValueError, match="bogus"):
        aggregate(PT, PT_MASK, "bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        aggregate(PT, PT_MASK, "token_mean", norm_length=4)
    with pytest.raises(ValueError):
        aggregate(PT, PT_MASK, "seq_mean_token_sum", norm_length=0)


def test_masked_mean_and_sum():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert masked_sum(values, mask).item() == 3.0
    assert masked_mean(values, mask).item() == 1.5
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 0.0], dtype=F64))
    torch.testing.assert_close(masked_sum(values, mask.double(), dim=0), torch.tensor([1.0, 2.0, 0.0], dtype=F64))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    assert not math.isnan(masked_mean(values, torch.zeros_like(mask)).item())


def test_masked_mean_gradient_safe_on_empty_rows():
    values = torch.tensor([[1.0, 3.0], [2.0, 2.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64)
    masked_mean(values, mask, dim=-1).sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.5, 0.5], [0.0, 0.0]], dtype=F64))


def test_stale_rows_take_the_behaviour_policys_logprobs():
    trainer = torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]])
    rollout = torch.tensor([[-1.5, -2.5], [-3.5, -4.5], [-5.5, -6.5]])
    mixed = behaviour_logprobs(trainer, rollout, torch.tensor([0, 1, 0]))
    assert torch.equal(mixed, torch.tensor([[-1.0, -2.0], [-3.5, -4.5], [-5.0, -6.0]]))
    assert torch.equal(behaviour_logprobs(trainer, rollout, None), trainer)
    # the clipped ratio of a stale row is taken against the policy that sampled it: e^(new - behaviour)
    assert torch.allclose(torch.exp(trainer - mixed)[1], torch.exp(torch.tensor([0.5, 0.5])))
