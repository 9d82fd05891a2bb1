"""Flow-GRPO's SDE step: the paper's equations, the Gaussian it defines, the scheduler's Euler step, and marginals."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from gcore_rl.models.flow_sde import (
    check_time_grid,
    diffusion_coefficient,
    sample_step,
    sde_law,
    sde_step,
    step_kl,
    step_log_prob,
)


def _paper_step(x, v, t, t_next, a, cap):
    """Flow-GRPO eq. (mean x_t + [v + σ²/(2t)(x_t + (1-t)v)]Δt, std σ√|Δt|), written out per element in float64."""
    tc = min(t, cap)
    sigma = a * math.sqrt(tc / (1 - tc))
    dt = t_next - t
    mean = x + (v + sigma**2 / (2 * tc) * (x + (1 - tc) * v)) * dt
    return mean, sigma * math.sqrt(-dt)


@pytest.mark.parametrize("t,t_next", [(1.0, 0.9), (0.6, 0.5), (0.1, 0.0)])
def test_step_matches_the_papers_equation(t, t_next):
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64), torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64)
    step = sde_step(x, v, t, t_next, noise_level=0.7, t_cap=0.9)
    mean, std = _paper_step(x, v, t, t_next, 0.7, 0.9)
    torch.testing.assert_close(step.mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(step.std, torch.full((3,), std, dtype=torch.float64), rtol=1e-12, atol=0)


def test_log_prob_and_kl_are_those_of_the_gaussian():
    gen = torch.Generator().manual_seed(1)
    x, v, ref_v = (torch.randn(4, 3, 2, 2, generator=gen, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([0.9, 0.7, 0.5, 0.3], dtype=torch.float64)
    step, ref = sde_step(x, v, t, t - 0.1, 0.7, 0.95), sde_step(x, ref_v, t, t - 0.1, 0.7, 0.95)
    x_next = sample_step(step, torch.randn(step.mean.shape, generator=gen, dtype=step.mean.dtype))
    std = step.std.reshape(-1, 1, 1, 1)
    normal, ref_normal = torch.distributions.Normal(step.mean, std), torch.distributions.Normal(ref.mean, std)
    torch.testing.assert_close(step_log_prob(x_next, step), normal.log_prob(x_next).flatten(1).mean(1))
    torch.testing.assert_close(step_kl(step, ref), torch.distributions.kl_divergence(normal, ref_normal).flatten(1).mean(1))
    assert torch.all(step_kl(step, step) == 0)


def test_noise_free_step_is_the_schedulers_euler_step():
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(8)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 4, generator=gen)
    for i, timestep in enumerate(scheduler.timesteps):
        v = torch.randn(x.shape, generator=gen)
        expected = scheduler.step(v, timestep, x).prev_sample
        got = sde_step(x, v, float(scheduler.sigmas[i]), float(scheduler.sigmas[i + 1]), 0.0, 0.99).mean
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        x = expected


def _exact_velocity(x, t, m, s):
    """E[ε - x_0 | x_t] for x_0 ~ N(m, s²), ε ~ N(0, 1), x_t = (1 - t)x_0 + tε (jointly Gaussian)."""
    var = (1 - t) ** 2 * s**2 + t**2
    centred = x - (1 - t) * m
    return t / var * centred - (m + (1 - t) * s**2 / var * centred)


@pytest.mark.parametrize("noise_level", [0.0, 0.7])
def test_sampler_with_the_exact_velocity_reaches_the_data_distribution(noise_level):
    """With the true velocity of a Gaussian data law, the SDE (any a) and the ODE end at that law: a wrong
    sign or factor in the score term would change the final variance by far more than the tolerance.

    Tolerances: 40 000 samples give the mean a standard error of s/200 and the variance a relative one of
    √(2/40000) ≈ 0.7%; 400 Euler steps add an O(1/400) bias. Bounds of 4 standard errors + 1% bias.
    """
    m, s, steps, n = 1.0, 0.5, 400, 40_000
    gen = torch.Generator().manual_seed(3)
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    x = torch.randn(n, 1, generator=gen, dtype=torch.float64)
    for i in range(steps):
        t = float(sigmas[i])
        step = sde_step(x, _exact_velocity(x, t, m, s), t, float(sigmas[i + 1]), noise_level, float(sigmas[1]))
        x = sample_step(step, torch.randn(step.mean.shape, generator=gen, dtype=step.mean.dtype))
    assert abs(float(x.mean()) - m) < 4 * s / math.sqrt(n) + 0.01
    assert abs(float(x.var()) / s**2 - 1) < 4 * math.sqrt(2 / n) + 0.01


def test_bad_arguments_are_refused():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="t_next must not exceed t"):
        sde_step(x, x, 0.5, 0.6, 0.7, 0.9)
    with pytest.raises(ValueError, match="differ in shape"):
        sde_step(x, torch.zeros(2, 4), 0.5, 0.4, 0.7, 0.9)
    with pytest.raises(ValueError, match="no density"):
        step_log_prob(x, sde_step(x, x, 0.5, 0.4, 0.0, 0.9))
    with pytest.raises(ValueError, match="t_cap"):
        diffusion_coefficient(torch.tensor(0.5), 0.7, 1.0)


def test_the_time_grid_is_checked_on_the_host_and_says_when_every_std_is_positive():
    """`check_time_grid` (the image engine's check before its steps, which read nothing back): a rising time is
    refused; a noisy grid of falling times has positive stds, the ODE's none; times that fall in fp32 but round
    to one value in bf16 (a step of std 0) are not called positive for bf16 latents."""
    with pytest.raises(ValueError, match="must not exceed t"):
        check_time_grid([1.0, 0.5, 0.6, 0.0], 0.7, 0.9)
    assert check_time_grid([1.0, 0.5, 0.25, 0.0], 0.7, 0.9)
    assert not check_time_grid([1.0, 0.5, 0.25, 0.0], 0.0, 0.9)
    collapsing = [1.0, 0.5001, 0.5, 0.0]
    assert check_time_grid(collapsing, 0.7, 0.9) and not check_time_grid(collapsing, 0.7, 0.9, torch.bfloat16)
    x = torch.randn(2, 3, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="std 0"):  # so step_log_prob still checks, and refuses, that step
        step_log_prob(x, sde_step(x, torch.zeros_like(x), 0.5001, 0.5, 0.7, 0.9))


def test_the_unchecked_law_is_the_checked_step_with_times_on_the_device():
    """`sde_law` with 0-d tensor times (what a captured step reads from its buffers) gives `sde_step`'s law with host
    times exactly."""
    gen = torch.Generator().manual_seed(2)
    x, v = torch.randn(3, 2, 4, 4, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
    times = torch.tensor([0.8, 0.6])
    checked = sde_step(x, v, float(times[0]), float(times[1]), 0.7, 0.9)
    law = sde_law(x, v, times[0], times[1], 0.7, 0.9, std_positive=True)
    assert torch.equal(law.mean, checked.mean) and torch.equal(law.std, checked.std)
    assert checked.std_positive and law.std_positive
