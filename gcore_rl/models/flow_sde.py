"""Flow-GRPO's stochastic sampler for rectified-flow models, as pure tensor functions.

A rectified-flow model interpolates ``x_t = (1 - t)·x_0 + t·ε`` between data (t = 0) and noise
(t = 1) and predicts the velocity ``v = ε - x_0``; diffusers' `FlowMatchEulerDiscreteScheduler`
calls t "sigma" and integrates the ODE ``dx = v dt`` from t = 1 down to 0. That sampler is
deterministic, so a denoising step has no probability to take a policy gradient through.

Flow-GRPO (Liu et al. 2025, arXiv 2505.05470, §4.1) samples the reverse-time SDE with the same
marginals instead. The score of the interpolant is ``∇log p_t(x) = -E[ε | x_t] / t`` and
``E[ε | x_t] = x_t + (1 - t)·v``, so with a diffusion coefficient σ_t the reverse SDE is
``dx = [v + σ_t²/(2t)·(x_t + (1 - t)·v)] dt + σ_t dw``. One Euler–Maruyama step from t to
t + Δt (Δt < 0) is Gaussian::

    mean = x_t + [v + σ_t²/(2t)·(x_t + (1 - t)·v)]·Δt,     std = σ_t·√|Δt|,     σ_t = a·√(t / (1 - t))

with the noise level ``a`` (Flow-GRPO: 0.7). At t = 1 the factor t/(1 - t) is infinite; as in
Flow-GRPO, t is capped there at `t_cap` (the scheduler's second sigma). With a = 0 the step is
the scheduler's Euler step ``x_t + v·Δt``.

Shapes: latents ``x`` are ``[B, *dims]`` (e.g. ``[B, C, H, W]``); `t`, `t_next` are ``[B]`` (or
scalars); log-probabilities and KL are ``[B]``, *averaged* over the non-batch dimensions, the
convention of Flow-GRPO, so a ratio of two step probabilities stays near 1 at any resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SdeStep:
    """The Gaussian law of one denoising step: ``x_next ~ N(mean, std²)`` per element.

    `mean` is ``[B, *dims]``, `std` is ``[B]`` (one standard deviation per sample); `std` is 0 for
    a deterministic (ODE) step. `std_positive`: known on the host that every std is > 0 (a step between host
    times with noise), so that `step_log_prob` need not read the device to check it.
    """

    mean: Tensor
    std: Tensor
    std_positive: bool = False


def _per_sample(value: Tensor | float, like: Tensor) -> Tensor:
    """`value` as a ``[B, 1, ..., 1]`` tensor broadcasting against `like` (``[B, *dims]``); a Python number is
    filled in on `like`'s device (no copy from the host)."""
    if isinstance(value, (int, float)):
        return torch.full((like.shape[0], *([1] * (like.dim() - 1))), float(value), dtype=like.dtype, device=like.device)
    tensor = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if tensor.dim() == 0:
        tensor = tensor.expand(like.shape[0])
    return tensor.reshape(-1, *([1] * (like.dim() - 1)))


def diffusion_coefficient(t: Tensor, noise_level: float, t_cap: float) -> Tensor:
    """σ_t = a·√(t / (1 - t)), with t capped at `t_cap` < 1 (so the first step from pure noise is finite)."""
    if not 0.0 < t_cap < 1.0:
        raise ValueError(f"t_cap must be in (0, 1), got {t_cap}")
    capped = torch.clamp(t, max=t_cap)
    return noise_level * torch.sqrt(capped / (1.0 - capped))


def sde_step(x: Tensor, velocity: Tensor, t: Tensor | float, t_next: Tensor | float, noise_level: float,
             t_cap: float) -> SdeStep:
    """The Gaussian step from time t to t_next < t (see the module docstring for the formula).

    Args:
        x: ``[B, *dims]`` latents at time t.
        velocity: ``[B, *dims]`` the model's velocity prediction v(x, t).
        t, t_next: ``[B]`` or scalars in [0, 1], t_next < t (the scheduler's consecutive sigmas); Python numbers
            (the sampler's) are checked on the host and mark a noisy step's std as positive.
        noise_level: a >= 0; 0 gives the deterministic Euler step.
        t_cap: the largest t used in σ_t and in the score term (Flow-GRPO: the scheduler's second sigma).
    """
    if x.shape != velocity.shape:
        raise ValueError(f"latents {tuple(x.shape)} and velocity {tuple(velocity.shape)} differ in shape")
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    if isinstance(t, (int, float)) and isinstance(t_next, (int, float)):
        return sde_law(x, velocity, t, t_next, noise_level, t_cap,
                       std_positive=check_time_grid([t, t_next], noise_level, t_cap, x.dtype))
    if bool((torch.as_tensor(t_next) > torch.as_tensor(t)).any()):
        raise ValueError(_BACKWARDS)
    return sde_law(x, velocity, t, t_next, noise_level, t_cap)


def sde_law(x: Tensor, velocity: Tensor, t: Tensor | float, t_next: Tensor | float, noise_level: float, t_cap: float,
            std_positive: bool = False) -> SdeStep:
    """`sde_step` without its checks (which read `t` and `t_next`), for a caller that checked its time grid on the
    host (`check_time_grid`): the image engine's steps, which a CUDA graph records and which so must read nothing
    back. `std_positive`: the caller knows every std is > 0."""
    t_b = _per_sample(t, x)
    dt = _per_sample(t_next, x) - t_b
    sigma = diffusion_coefficient(t_b, noise_level, t_cap)
    t_safe = torch.clamp(t_b, max=t_cap)
    drift = velocity + sigma**2 / (2.0 * t_safe) * (x + (1.0 - t_safe) * velocity)
    mean = x + drift * dt
    std = (sigma * torch.sqrt(-dt)).reshape(-1)
    return SdeStep(mean=mean, std=std, std_positive=std_positive)


_BACKWARDS = "t_next must not exceed t: the sampler runs from noise (t = 1) to data (t = 0)"


def check_time_grid(times: list[float], noise_level: float, t_cap: float, dtype: torch.dtype = torch.float32) -> bool:
    """Checks a sampler's time grid ``t_0 > ... > t_S`` on the host (ValueError where a time rises) and returns
    whether each of its steps with `noise_level` has a positive std: noise, t > 0, and times that still fall
    once rounded to `dtype`, the latents' (two close times can round to one in bf16, a step of std 0)."""
    rounded = torch.tensor(times, dtype=torch.float64).to(dtype).tolist()
    steps = list(zip(rounded[:-1], rounded[1:], strict=True))
    if any(t_next > t for t, t_next in zip(times[:-1], times[1:], strict=True)):
        raise ValueError(_BACKWARDS)
    return noise_level > 0 and all(t_next < t and min(t, t_cap) > 0 for t, t_next in steps)


def step_log_prob(x_next: Tensor, step: SdeStep) -> Tensor:
    """``[B]`` log N(x_next; mean, std²), averaged over the non-batch dimensions (needs std > 0)."""
    if not step.std_positive and bool((step.std <= 0).any()):
        raise ValueError("a deterministic step (std 0) has no density: sample with noise_level > 0")
    std = _per_sample(step.std, x_next)
    per_element = -((x_next - step.mean) ** 2) / (2.0 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return per_element.flatten(1).mean(dim=1)


def step_kl(step: SdeStep, reference: SdeStep) -> Tensor:
    """``[B]`` KL(N(mean, std²) || N(ref_mean, std²)) per element, averaged over the non-batch dimensions.

    Both steps start from the same latents and share σ_t, so their laws differ only in the mean and
    the KL is exactly ``|mean - ref_mean|² / (2·std²)`` (Flow-GRPO's KL term, §4.1).
    """
    std = _per_sample(step.std, step.mean)
    return ((step.mean - reference.mean) ** 2 / (2.0 * std**2)).flatten(1).mean(dim=1)


def sample_step(step: SdeStep, noise: Tensor) -> Tensor:
    """x_next ~ N(mean, std²) from `noise`, standard normal draws ``[B, *dims]`` on the step's device (the image
    engine draws them ahead on the host, so every device samples alike; the mean itself where std is 0)."""
    return step.mean + _per_sample(step.std, step.mean) * noise
