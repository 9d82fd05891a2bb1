"""The policy trainer: the FSDP2 actor, the frozen reference, the critic (PPO with GAE), their
optimiser state and export.

One `PolicyTrainer` per trainer rank. Per RL step the device worker calls `prepare` (the
forward-only passes: old and reference log-probs, the critic's values, then GAE) and then `update`
(the critic's and the actor's optimiser steps), and
afterwards drains `full_weights` into the rollout engines. `state_dict` / `load_state_dict` carry
everything the next update depends on, sharded, in the form `torch.distributed.checkpoint` saves;
`export` writes the policy as a Hugging Face model folder.

Every method that touches the weights is a collective over the trainer group when the model is
sharded over several ranks: every rank calls it, with the same number of rows.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from transformers import PreTrainedTokenizerBase

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.kl import kl_divergence
from gcore_rl.algos.mismatch import ratio_reference
from gcore_rl.algos.policy_loss import logprob_gap_max
from gcore_rl.algos.value_loss import value_targets
from gcore_rl.distributed import barrier
from gcore_rl.models.loading import load_causal_lm, save_model_dir
from gcore_rl.models.lora import LoraSettings, adapters_disabled, apply_lora, is_lora
from gcore_rl.models.lora import sync_weights as lora_sync_weights
from gcore_rl.records import TokenBatch
from gcore_rl.training.actor import Actor, TrainConfig, compute_logprobs, full_tensor
from gcore_rl.training.critic import (
    Critic,
    CriticConfig,
    global_explained_variance,
    global_whiten,
    load_critic_model,
)
from gcore_rl.training.fsdp import shard_model
from gcore_rl.training.offload import OffloadPart
from gcore_rl.training.optim_step import all_reduce_sums
from gcore_rl.training.sequence_parallel import new_sequence_parallel_group, use_ulysses
from gcore_rl.training.shapes import update_shape


class PolicyTrainer:
    """Owns the trained policy (`actor`: FSDP2 model, AdamW, LambdaLR), the frozen `reference` and,
    for PPO with GAE, the `critic`.

    Args:
        actor: the policy, already FSDP-wrapped, with its optimiser and schedule.
        reference: the frozen reference model (sharded, no grad), or None when the algorithm
            has no KL term or the reference log-probs come with the batch (`interleave`).
        critic: the value model with its own optimiser (`Critic`), or None when the estimator
            needs none (every estimator but GAE) or the critic has devices of its own
            (`placement.critic_devices`, `CriticTrainer`), whose values then come with the batch.
        actor_freeze_steps: RL steps in which only the critic trains (`critic.actor_freeze_steps`).
        lora: a LoRA policy's settings (the actor's model is then peft-wrapped), which say what the sync sends.
    """

    def __init__(self, actor: Actor, reference: nn.Module | None = None, critic: Critic | None = None,
                 actor_freeze_steps: int = 0, lora: LoraSettings | None = None):
        self.actor = actor
        self.reference = reference
        self.critic = critic
        self.actor_freeze_steps = actor_freeze_steps
        self.optimiser_steps = 0
        self.updates = 0  # RL steps trained (the critic's warm-up counts them)
        self.lora = lora
        self._prepared: dict[str, float] = {}  # statistics of the last `prepare` (GAE's), reported by `update`

    @classmethod
    def build(cls, model_path: str | Path, *, dtype: str, attn_implementation: str, reference_path: str | Path | None,
              train: TrainConfig, algo: AlgoConfig, logprob_temperature: float, device: torch.device,
              bf16: bool, critic: CriticConfig | None = None, with_reference: bool = True,
              with_critic: bool = True, lora: LoraSettings | None = None) -> PolicyTrainer:
        """Load and shard the policy (and, when `algo.uses_reference`, the reference from
        `reference_path`, default `model_path`; when `algo.uses_critic`, the critic from
        `critic.model_path`, default `model_path`, see `gcore_rl.models.value.load_value_model`).

        `bf16` all-gathers parameters in bf16 (CUDA); master weights and gradients stay in `dtype`.
        The order (policy, its optimiser, the reference, then the critic) is fixed: results of a
        seeded run depend on it. `with_reference=False`: the reference log-probs arrive with the
        batch (computed in the rollout phase, `interleave`), so no reference shard is loaded.
        `with_critic=False`: the critic has devices of its own and its values arrive with the batch.
        With `lora` enabled the policy is the base plus adapters (`models.lora`), and a reference at the
        policy's own path is that model with its adapters off, not a second copy.
        """
        if train.sequence_parallel > 1 and algo.uses_critic:
            raise ValueError("train.sequence_parallel splits the actor's and the reference's passes; the critic's "
                             "value passes are not split: use a critic-free estimator or sequence_parallel=1")
        group = new_sequence_parallel_group(train.sequence_parallel) if train.sequence_parallel > 1 else None
        model = load_causal_lm(model_path, dtype, attn_implementation, device)
        lora_on = lora is not None and lora.enabled
        if lora_on:
            model = apply_lora(model, lora)
        if group is not None:
            use_ulysses(model, group)
        actor = Actor(shard_model(model, bf16=bf16, activation_checkpointing=train.activation_checkpointing), train, algo,
                      logprob_temperature, device)
        reference = None
        if algo.uses_reference and with_reference and lora_on and same_model(reference_path, model_path):
            reference = actor.model  # the base: the policy with its adapters off (`reference_logprobs`)
        elif algo.uses_reference and with_reference:
            reference = load_causal_lm(reference_path or model_path, dtype, attn_implementation, device)
            reference.requires_grad_(False)
            if group is not None:
                use_ulysses(reference, group)
            reference = shard_model(reference, bf16=bf16)
        value_model = None
        if algo.uses_critic and critic is None:
            raise ValueError("algo.advantage=gae trains a critic: pass its CriticConfig")
        if algo.uses_critic and with_critic:
            cfg = critic
            model = load_critic_model(cfg, model_path, dtype, attn_implementation, device)
            value_model = Critic(shard_model(model, bf16=bf16, activation_checkpointing=train.activation_checkpointing),
                                 cfg, batching=train.batching,
                                 mini_batches=train.mini_batches, epochs=train.ppo_epochs, device=device)
        return cls(actor, reference, value_model, critic.actor_freeze_steps if algo.uses_critic else 0,
                   lora if lora_on else None)

    @property
    def model(self) -> nn.Module:
        """The trained policy (FSDP2-wrapped)."""
        return self.actor.model

    @property
    def single_pass(self) -> bool:
        """One optimiser step per update, which needs no separate old-log-prob pass (`Actor.single_pass`)."""
        return self.actor.single_pass

    @property
    def _needs_current_logprobs(self) -> bool:
        """`prepare` computes the current weights' log-probs: for the ratio of a multi-step update, or for
        the KL that goes into GAE's rewards."""
        return not self.single_pass or (self.actor.algo.uses_critic and self.actor.algo.kl_in_reward)

    @property
    def prepare_passes(self) -> int:
        """Forward-only passes `prepare` makes over the batch (current log-probs, reference log-probs, values)."""
        return int(self._needs_current_logprobs) + int(self.reference is not None) + int(self.critic is not None)

    @property
    def actor_frozen(self) -> bool:
        """The critic is still warming up (`critic.actor_freeze_steps`): this step trains only the critic."""
        return self.updates < self.actor_freeze_steps

    # ---- one update ---------------------------------------------------------------------

    def prepare(self, batch: TokenBatch) -> torch.Tensor | None:
        """Fill `batch.old_logprobs` and `batch.ref_logprobs` (`[B, T]`, CPU fp32) for `update`.

        Old log-probs are those of the current weights, or (without a mismatch correction) the
        engine's `rollout_logprobs` for stale rows (`ratio_reference`); a single-pass update leaves
        them None and takes them from its own forward. Reference log-probs are filled when there
        is a reference model.

        With a critic, also `batch.old_values` (`[B, T]`, the critic's values now; a critic on devices
        of its own has sent them with the batch) and, from `batch.rewards` (`[B]`), GAE's
        `batch.advantages` and `batch.returns` (`gae_batch`).

        Returns the current weights' log-probs `[B, T]` of the batch (before `ratio_reference`),
        which `update` compares with the engine's for `rollout/logprob_gap_max`; None for a
        single-pass update without a KL in the reward.
        """
        trainer_logprobs = None
        if self._needs_current_logprobs:
            trainer_logprobs = self.actor.compute_logprobs(batch)
        if not self.single_pass:
            batch.old_logprobs = ratio_reference(trainer_logprobs, batch.rollout_logprobs, batch.staleness,
                                                 self.actor.algo.mismatch_correction)
        if self.reference is not None:
            batch.ref_logprobs = self.reference_logprobs(batch)
        elif self.actor.algo.uses_reference and batch.ref_logprobs is None:
            raise ValueError("the KL needs reference log-probs: this trainer holds no reference, and the batch "
                             "brought none from the rollout phase")
        if self.critic is not None:
            batch.old_values = self.critic.values(batch)
        elif self.actor.algo.uses_critic and batch.old_values is None:
            raise ValueError("GAE needs the critic's values: this trainer holds no critic, and the batch brought none "
                             "from the critic's devices")
        if self.actor.algo.uses_critic:
            self._prepared = gae_batch(batch, self.actor.algo, trainer_logprobs, self.actor.device)
        return trainer_logprobs

    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """The reference's log-probs `[B, T]` (CPU fp32) of the batch: a LoRA policy's reference is the
        policy itself with its adapters off."""
        context = adapters_disabled(self.model) if self.reference is self.model else contextlib.nullcontext()
        with context:
            return compute_logprobs(self.reference, batch, self.actor.temperature, self.actor.train_cfg.batching,
                                    self.actor.device)

    def update(self, batch: TokenBatch, trainer_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """Take the update's optimiser steps on a prepared batch (see `prepare`); returns mean metrics.

        `trainer_logprobs` (`[B, T]`) is what `prepare` returned; it is needed unless the update
        is single-pass. Besides the actor's metrics, `rollout/logprob_gap_max` is the largest
        |engine − trainer| log-prob on the response tokens of fresh rows (stale rows differ by
        the updates since they were sampled).
        """
        if trainer_logprobs is None and not self.single_pass:
            raise ValueError("an update that is not a single pass (several optimiser steps, or train.max_kl) needs "
                             "the trainer log-probs that prepare() returned")
        stats, self._prepared = dict(self._prepared), {}
        frozen = self.actor_frozen
        if self.critic is not None:
            stats.update(self.critic.update(batch))
            stats["critic/explained_variance"] = global_explained_variance(batch.old_values, batch.returns,
                                                                           batch.response_mask, self.actor.device)
        if self.actor.algo.uses_critic:
            stats["actor/frozen"] = float(frozen)
        self.updates += 1
        if frozen:  # the critic's warm-up: the policy stays as it is
            return stats
        stats.update(self.actor.update(batch, trainer_logprobs))
        self.optimiser_steps += update_shape(batch.size, self.actor.train_cfg.micro_batch_size,
                                             self.actor.train_cfg.mini_batches, self.actor.train_cfg.ppo_epochs)[0]
        if trainer_logprobs is None:  # measured by the update's own forward
            stats["rollout/logprob_gap_max"] = self.actor.logprob_gap_max
        else:
            stats["rollout/logprob_gap_max"] = logprob_gap_max(batch.rollout_logprobs, trainer_logprobs,
                                                               batch.response_mask, batch.staleness)
        return stats

    def offload_parts(self) -> list[OffloadPart]:
        """What `train.offload` moves off the device between updates: the actor with its optimiser, a sharded
        reference of its own, the critic with its optimiser."""
        parts = [OffloadPart(self.model, self.actor.optimizer)]
        if self.reference is not None and self.reference is not self.model:
            parts.append(OffloadPart(self.reference))
        if self.critic is not None:
            parts.append(OffloadPart(self.critic.model, self.critic.optimizer))
        return parts

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, full tensor) one parameter at a time, under the base model's names (a LoRA policy's
        merged), for export and the weight sync.

        Every rank must consume the iterator in full: gathering a sharded parameter is a collective.
        """
        return self.actor.full_weights()

    def sync_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the weight sync sends the engines: `full_weights`, or a LoRA policy's adapters alone under
        `model.lora.sync=adapters` (`models.lora.sync_weights`). A collective, as `full_weights`."""
        if self.lora is None:
            return self.full_weights()
        return lora_sync_weights(self.model, full_tensor, self.lora)

    # ---- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the next update depends on: `model` (parameters, sharded DTensors keyed by name),
        `optimizer` (AdamW state keyed by parameter name), `scheduler` (LambdaLR state),
        `optimiser_steps` and `updates`, and with a critic `critic`: its own `model`, `optimizer` and
        `scheduler`. Saveable with `torch.distributed.checkpoint.save` as it is."""
        state = {**model_state(self.model, self.actor.optimizer, self.actor.scheduler),
                 "optimiser_steps": self.optimiser_steps, "updates": self.updates}
        if self.critic is not None:
            state["critic"] = model_state(self.critic.model, self.critic.optimizer, self.critic.scheduler)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (of a trainer with the same model, sharding and configs).

        The values are copied: the trainer shares no tensor with `state` afterwards, unless they
        were its own (the DCP way: `dcp.load` into this trainer's `state_dict()`, then this).
        """
        load_model_state(self.model, self.actor.optimizer, self.actor.scheduler, state)
        if self.critic is not None:
            load_model_state(self.critic.model, self.critic.optimizer, self.critic.scheduler, state["critic"])
        self.optimiser_steps = int(state["optimiser_steps"])
        self.updates = int(state.get("updates", 0))

    def export(self, path: str | Path, tokenizer: PreTrainedTokenizerBase) -> Path:
        """Write the policy's current weights and `tokenizer` as a Hugging Face model folder.

        A collective: every trainer rank calls it; the weights are gathered to rank 0, which
        writes the folder, and the call returns on every rank once the folder is complete.
        """
        out = Path(path)
        model = self.model
        if is_lora(model):  # the merged model, under the base model's names
            weights = {name: tensor.cpu() for name, tensor in self.full_weights()}
            model = model.get_base_model()
        else:
            weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not dist.is_initialized() or dist.get_rank() == 0:
            # from the gathered weights: the sharded model's own state_dict would gather on this rank alone
            save_model_dir(model, tokenizer, out, state_dict=weights)
        barrier()
        return out


def same_model(path: str | Path | None, model_path: str | Path) -> bool:
    """Whether a model path (None: the policy's own) names the folder `model_path`."""
    return path is None or Path(path).resolve() == Path(model_path).resolve()


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict[str, Any]:
    """`model` (sharded parameters by name), `optimizer` (AdamW state by parameter name), `scheduler`; only the
    parameters that train (a LoRA policy's adapters, not its frozen base)."""
    fresh = not optimizer.state
    weights, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    if len(trained) < len(list(model.parameters())):  # a tied copy of a frozen weight (lm_head) is no parameter
        weights = {name: value for name, value in weights.items() if name in trained}
    if fresh:
        # torch fills an empty optimiser state with one zero-gradient step at lr 0, which would
        # count as AdamW's first step in its bias correction: a count of 0 is a fresh AdamW
        for per_param in optimizer.state.values():
            per_param["step"].zero_()
    return {"model": weights, "optimizer": optimizer_state, "scheduler": scheduler.state_dict()}


def load_model_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, state: dict[str, Any]) -> None:
    """The inverse of `model_state`, copying the values (see `PolicyTrainer.load_state_dict`)."""
    own = {id(value): value for per_param in optimizer.state.values() for value in per_param.values()}
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    partial = len(trained) < len(list(model.parameters()))  # a LoRA policy: the state is the adapters
    if partial and trained - set(state["model"]):
        raise ValueError(f"the state lacks parameters that train: {sorted(trained - set(state['model']))[:3]}")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=not partial))
    # the optimiser keeps the very tensors it is given (parameters are copied into): two trainers
    # would step the same moments and step counts
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if torch.is_tensor(value) and id(value) not in own:
                per_param[key] = value.clone()
    scheduler.load_state_dict(copy.deepcopy(state["scheduler"]))  # it keeps (and pops) what it is given


def gae_batch(batch: TokenBatch, algo: AlgoConfig, current_logprobs: torch.Tensor | None,
              device: torch.device) -> dict[str, float]:
    """Fill `batch.advantages` and `batch.returns` (`[B, T]`) from `batch.rewards` (`[B]`), an environment's
    `batch.turn_rewards` (`[B, T]`, when it has any) and `batch.old_values` with GAE (`value_targets`,
    `algo.gamma`, `algo.lam`).

    Under `algo.kl_in_reward` each token's reward carries ``-kl_coef * KL_t`` between the policy that
    is being trained (`current_logprobs`) and the reference (`batch.ref_logprobs`), estimator
    `algo.kl_estimator`. With `algo.whiten_advantages` the advantages are whitened over the valid
    tokens of the whole step's batch, every trainer rank's rows (`global_whiten`, a collective).

    Returns metrics over the whole batch: ``critic/returns_mean``, and under `algo.kl_in_reward` ``kl``
    (the mean per-token KL estimate that the rewards carry).
    """
    if batch.rewards is None:
        raise ValueError("GAE needs batch.rewards, the outcome reward of each row")
    kl = None
    if algo.kl_in_reward:
        kl = kl_divergence(current_logprobs, batch.ref_logprobs, algo.kl_estimator)
    advantages, returns = value_targets(batch.rewards, batch.old_values, batch.response_mask, algo.gamma, algo.lam,
                                        kl=kl, kl_coef=algo.kl_coef if algo.kl_in_reward else 0.0,
                                        whiten_advantages=False, turn_rewards=batch.turn_rewards)
    if algo.whiten_advantages:
        advantages = global_whiten(advantages, batch.response_mask, device)
    batch.advantages, batch.returns = advantages, returns
    mask = batch.response_mask.double()
    sums = [float(mask.sum()), float((returns.double() * mask).sum())]
    if kl is not None:
        sums.append(float((kl.double() * mask).sum()))
    count, *totals = all_reduce_sums(sums, device)
    names = ["critic/returns_mean", "kl"][:len(totals)]
    return {name: total / max(count, 1.0) for name, total in zip(names, totals, strict=True)}
