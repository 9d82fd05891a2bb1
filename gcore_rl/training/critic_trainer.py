"""PPO's critic on devices of its own (`placement.critic_devices` > 0).

The plan can give the critic devices apart from the actor's (placement/plan.py: `_own_critic`). There
the critic is a group of its own: an FSDP2 value model sharded over the critic devices of every slice,
its AdamW and schedule, none of the actor's state. Per RL step a critic device gets its rows of the
step's batch with their outcome rewards and

1. returns their values (no grad) — the controller hands them to the actor's devices, which compute
   GAE's advantages from them exactly as a colocated critic's would be used;
2. computes the returns from the same rewards and values (`value_targets`: GAE before whitening, so the
   critic regresses on the unscaled return) and takes the critic's update on them while the actor
   prepares and trains on its own devices.

The two sides agree without exchanging anything else: GAE's returns depend only on the rewards, the
values, the mask, γ and λ. The KL-in-reward option would add every token's KL, which only the actor's
devices compute, so the config refuses it with a critic of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.value_loss import value_targets
from gcore_rl.records import TokenBatch
from gcore_rl.training.actor import TrainConfig
from gcore_rl.training.critic import Critic, CriticConfig, global_explained_variance, load_critic_model
from gcore_rl.training.fsdp import shard_model
from gcore_rl.training.offload import OffloadPart
from gcore_rl.training.policy_trainer import load_model_state, model_state


class CriticTrainer:
    """The critic of a critic device: `values`, then `update`; `state_dict` / `load_state_dict` for checkpoints.

    Args:
        critic: the sharded value model with its optimiser (`Critic`).
        gamma, lam: GAE's discount and λ (`algo.gamma`, `algo.lam`), for the returns.
    """

    def __init__(self, critic: Critic, gamma: float, lam: float):
        self.critic = critic
        self.gamma = gamma
        self.lam = lam
        self.updates = 0

    @classmethod
    def build(cls, model_path: str | Path, cfg: CriticConfig, *, dtype: str, attn_implementation: str,
              train: TrainConfig, algo: AlgoConfig, device: torch.device, bf16: bool) -> CriticTrainer:
        """Load the value model from `cfg.model_path` (default `model_path`, the policy's start; see
        `load_value_model`) and shard it over this process's group, as `PolicyTrainer.build` does next to the actor."""
        model = load_critic_model(cfg, model_path, dtype, attn_implementation, device)
        critic = Critic(shard_model(model, bf16=bf16, activation_checkpointing=train.activation_checkpointing), cfg,
                        batching=train.batching, mini_batches=train.mini_batches, epochs=train.ppo_epochs, device=device)
        return cls(critic, algo.gamma, algo.lam)

    @property
    def model(self) -> torch.nn.Module:
        return self.critic.model

    def offload_parts(self) -> list[OffloadPart]:
        """What `train.offload` moves off a critic device that also scores or generates: the critic and its optimiser."""
        return [OffloadPart(self.critic.model, self.critic.optimizer)]

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """Values `[B, T]` (CPU fp32) of this device's rows under the current weights (`Critic.values`)."""
        return self.critic.values(batch)

    def update(self, batch: TokenBatch, values: torch.Tensor) -> dict[str, float]:
        """Regress on the returns of `batch.rewards` (`[B]`) given `values` (`[B, T]`, from `values`).

        Returns `Critic.update`'s metrics and ``critic/explained_variance`` over the critic group's rows.
        """
        if batch.rewards is None:
            raise ValueError("the critic's returns need batch.rewards, the outcome reward of each row")
        batch.old_values = values
        _, batch.returns = value_targets(batch.rewards, values, batch.response_mask, self.gamma, self.lam,
                                         whiten_advantages=False, turn_rewards=batch.turn_rewards)
        stats = self.critic.update(batch)
        stats["critic/explained_variance"] = global_explained_variance(values, batch.returns, batch.response_mask,
                                                                       self.critic.device)
        self.updates += 1
        return stats

    def state_dict(self) -> dict[str, Any]:
        """The value model's `model`, `optimizer` and `scheduler` (laid out as a `PolicyTrainer`'s own, so the
        same checkpoint code saves and reshards it), `optimiser_steps` (0: the actor counts them) and
        `updates`; saveable with `torch.distributed.checkpoint` as it is."""
        return {**model_state(self.critic.model, self.critic.optimizer, self.critic.scheduler),
                "optimiser_steps": 0, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (the values copied, see `PolicyTrainer.load_state_dict`)."""
        load_model_state(self.critic.model, self.critic.optimizer, self.critic.scheduler, state)
        self.updates = int(state.get("updates", 0))
