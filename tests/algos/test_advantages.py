import pytest
import torch

from gcore_rl.algos import group_advantages


def test_two_groups_of_four_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    adv = group_advantages(rewards, group_size=4)
    # group 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6); group 1: all equal -> 0
    a = 0.999998000004
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_population_std_used():
    rewards = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)
    adv = group_advantages(rewards, group_size=3, eps=0.0)
    # mean 2, population variance 2/3 -> std sqrt(2/3); 1/sqrt(2/3) = sqrt(1.5)
    s = 1.224744871391589
    torch.testing.assert_close(adv, torch.tensor([s, -s, 0.0], dtype=torch.float64), rtol=0, atol=1e-12)


def test_no_std_scaling_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0], dtype=torch.float64)
    adv = group_advantages(rewards, group_size=2, scale_by_std=False)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [True, False])
def test_equal_rewards_give_exact_zero(scale):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])
    adv = group_advantages(rewards, group_size=3, scale_by_std=scale, eps=0.0)
    assert torch.equal(adv, torch.zeros(6))


def test_group_size_one_is_zero():
    adv = group_advantages(torch.tensor([0.3, 5.0]), group_size=1)
    assert torch.equal(adv, torch.zeros(2))


def test_integer_rewards_promoted_to_float():
    adv = group_advantages(torch.tensor([1, 0]), group_size=2, scale_by_std=False)
    assert adv.is_floating_point()
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))


def test_non_divisible_batch_raises():
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(7), group_size=4)


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 4), group_size=4)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), group_size=0)
