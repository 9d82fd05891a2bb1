"""Advantage estimators and policy losses by name (``algo.advantage``, ``algo.policy_loss``).

Each entry says which function computes it, what inputs it needs beyond the rewards of the step's
batch, and which settings it combines with; the controller and the actor look names up here instead
of branching on them. The math lives in :mod:`gcore_rl.algos.advantages` and
:mod:`gcore_rl.algos.policy_loss`; the table with equations and papers is ``docs/algorithms.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from gcore_rl.algos.advantages import (
    gae_advantages,
    group_advantages,
    last_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from gcore_rl.algos.policy_loss import PolicyLossStats, cispo_loss, gspo_loss, ppo_clip_loss
from gcore_rl.errors import ConfigError

if TYPE_CHECKING:
    from gcore_rl.algos.config import AlgoConfig

__all__ = [
    "ADVANTAGES",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AdvantageSpec",
    "PolicyLossSpec",
    "check_advantage_inputs",
    "compute_advantages",
    "compute_policy_loss",
]


@dataclass(frozen=True)
class AdvantageInputs:
    """What the controller has for a step's batch when it computes advantages.

    ``rewards`` ``[B]`` (groups of ``group_size`` contiguous rows), ``mask`` ``[B, T]`` the response
    tokens that count (padding groups already zeroed). ``values`` ``[B, T]`` (critic) and
    ``greedy_rewards`` ``[B]`` (ReMax baseline) only where the run produces them.
    """

    rewards: Tensor
    group_size: int
    mask: Tensor
    values: Tensor | None = None
    greedy_rewards: Tensor | None = None


@dataclass(frozen=True)
class AdvantageSpec:
    """One estimator: ``compute(inputs, algo)`` returns ``[B]`` or ``[B, T]`` advantages.

    ``needs`` names the optional :class:`AdvantageInputs` fields it reads (``values``,
    ``greedy_rewards``); ``min_group_size`` the samples per prompt it needs; ``unavailable`` says why
    the runtime cannot feed it yet (None when it can), reported as a ConfigError. ``on_trainer``: the
    estimator needs what only the trainer workers compute (the critic's values), so the controller
    ships the rewards and the trainer computes the advantages after its preparation pass
    (`gcore_rl.training.policy_trainer.gae_batch`); ``compute`` then takes ``values`` in the inputs.
    """

    compute: Callable[[AdvantageInputs, AlgoConfig], Tensor]
    needs: frozenset[str] = frozenset()
    min_group_size: int = 1
    unavailable: str | None = None
    on_trainer: bool = False


def _gae(inputs: AdvantageInputs, algo: AlgoConfig) -> Tensor:
    """GAE advantages of outcome rewards (no KL in the reward, no whitening): `value_targets`' first half."""
    if inputs.values is None:
        raise ValueError("algo.advantage=gae needs the critic's values (AdvantageInputs.values)")
    return gae_advantages(last_token_rewards(inputs.rewards, inputs.mask), inputs.values, inputs.mask,
                          gamma=algo.gamma, lam=algo.lam)[0]


ADVANTAGES: dict[str, AdvantageSpec] = {
    "grpo": AdvantageSpec(
        lambda x, algo: group_advantages(x.rewards, x.group_size, scale_by_std=algo.scale_rewards), min_group_size=2),
    "dr_grpo": AdvantageSpec(
        lambda x, algo: group_advantages(x.rewards, x.group_size, scale_by_std=False), min_group_size=2),
    "rloo": AdvantageSpec(lambda x, algo: rloo_advantages(x.rewards, x.group_size), min_group_size=2),
    "reinforce_pp": AdvantageSpec(lambda x, algo: reinforce_pp_advantages(x.rewards, x.mask)),
    "reinforce_pp_baseline": AdvantageSpec(
        lambda x, algo: reinforce_pp_baseline_advantages(x.rewards, x.group_size, x.mask), min_group_size=2),
    # the rollout adds one greedy completion per prompt for an estimator that needs greedy_rewards
    "remax": AdvantageSpec(lambda x, algo: remax_advantages(x.rewards, x.greedy_rewards), needs=frozenset({"greedy_rewards"})),
    "gae": AdvantageSpec(_gae, needs=frozenset({"values"}), on_trainer=True),
}
"""Advantage estimators by ``algo.advantage`` name."""


def check_advantage_inputs(name: str, group_size: int, provided: frozenset[str] = frozenset()) -> None:
    """Raise a ConfigError when estimator `name` cannot run in this job.

    `group_size` is ``sampling.n``; `provided` the optional inputs the job produces (``"values"`` when a
    critic is configured, ``"greedy_rewards"`` when the rollout adds a greedy sample per prompt).
    """
    spec = ADVANTAGES[name]
    missing = spec.needs - provided
    if missing and spec.unavailable:
        raise ConfigError("algo.advantage", f"{name} is not available: {spec.unavailable}")
    if missing:
        raise ConfigError("algo.advantage", f"{name} needs {', '.join(sorted(missing))}, which this job does not produce")
    if group_size < spec.min_group_size:
        raise ConfigError("sampling.n", f"algo.advantage={name} compares each completion with the other completions "
                          f"of its prompt, so it needs at least {spec.min_group_size} per prompt; got {group_size}")


def compute_advantages(algo: AlgoConfig, inputs: AdvantageInputs) -> Tensor:
    """Advantages of a step's batch with the estimator ``algo.advantage``: ``[B]`` or ``[B, T]``.

    An ``on_trainer`` estimator (GAE) is computed here only when ``inputs.values`` are given (tests);
    in a run the trainer computes it after its preparation pass."""
    return ADVANTAGES[algo.advantage].compute(inputs, algo)


PolicyLossFn = Callable[..., tuple[Tensor, PolicyLossStats]]


@dataclass(frozen=True)
class PolicyLossSpec:
    """One policy loss: ``loss_fn(logprobs, old_logprobs, advantages, mask, **options(algo), aggregation=...,
    norm_length=..., token_weights=...)``; ``options`` picks its settings from the config."""

    loss_fn: PolicyLossFn
    options: Callable[[AlgoConfig], dict[str, float]]


POLICY_LOSSES: dict[str, PolicyLossSpec] = {
    "ppo_clip": PolicyLossSpec(ppo_clip_loss, lambda a: {"clip_low": a.clip_low, "clip_high": a.clip_high}),
    "dual_clip": PolicyLossSpec(
        ppo_clip_loss, lambda a: {"clip_low": a.clip_low, "clip_high": a.clip_high, "dual_clip_c": a.dual_clip_c}),
    "gspo": PolicyLossSpec(gspo_loss, lambda a: {"clip_low": a.gspo_clip_low, "clip_high": a.gspo_clip_high}),
    "cispo": PolicyLossSpec(cispo_loss, lambda a: {"clip_low": a.cispo_clip_low, "clip_high": a.cispo_clip_high}),
}
"""Policy losses by ``algo.policy_loss`` name (``AlgoConfig.validate`` checks their combinations)."""


def compute_policy_loss(algo: AlgoConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                        token_weights: Tensor | None = None) -> tuple[Tensor, PolicyLossStats]:
    """The loss ``algo.policy_loss`` reduced with ``algo.loss_aggregation``.

    Shapes: ``logprobs``/``old_logprobs``/``mask`` ``[B, T]``, ``advantages`` ``[B]`` or ``[B, T]``,
    ``token_weights`` optional detached ``[B, T]`` multiplying each token's loss before aggregation.
    ``algo.norm_length`` must be resolved (``AlgoConfig.resolved``) for ``seq_mean_token_sum_norm``.
    """
    spec = POLICY_LOSSES[algo.policy_loss]
    return spec.loss_fn(logprobs, old_logprobs, advantages, mask, aggregation=algo.loss_aggregation,
                        norm_length=algo.aggregation_norm_length, token_weights=token_weights, **spec.options(algo))
