"""The RL program one controller runs over its prompt shard: one function per step.

    (generate → reward) in waves → prepare (old / reference log-probs, advantages) → train → sync weights

Every controller runs this same program (SPMD) on its own shard; the only cross-controller
traffic is the FSDP collectives inside the trainer and the all-reduce of the step's metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from gcore_rl.algos import group_advantages
from gcore_rl.algos.config import AlgoConfig
from gcore_rl.controller.waves import Group, StepBatch, WaveSampler
from gcore_rl.records import Completion, TokenBatch, build_token_batch
from gcore_rl.rewards.judge_role import JudgeRewarder
from gcore_rl.rewards.rule import RewardInput, RuleRewards
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.telemetry.metrics import PhaseTimer
from gcore_rl.training.actor import Actor, compute_logprobs
from gcore_rl.training.distributed import barrier


@dataclass
class Roles:
    """The role objects one controller drives (in-process runtime: plain Python objects)."""

    rollout: GenerationEngine
    actor: Actor
    reference: nn.Module | None
    rewards: RuleRewards
    tokenizer: PreTrainedTokenizerBase
    judge: JudgeRewarder | None = None


def rl_step(draw_rows: Callable[[int], list[dict]], waves: WaveSampler, roles: Roles, sampling: SamplingConfig,
            algo: AlgoConfig, timer: PhaseTimer, seed: int) -> dict[str, float]:
    """Run one RL step on this controller; returns local (un-reduced) metrics.

    `draw_rows(k)` yields the next k prompt rows of this controller's shard. Generation and
    rewarding run in waves until `waves` has its target of groups (one wave when dynamic sampling
    is off); padding groups of the last wave are masked out of the loss.
    """
    batch_groups, wave_stats = collect_groups(draw_rows, waves, roles, sampling, timer, seed)
    with timer.phase("rollout/wait"):  # controllers meet here; the time is what the fastest ones idle
        barrier()
    completions = [c for group in batch_groups.groups for c in group.payload.completions]
    rewards = torch.tensor([r for group in batch_groups.groups for r in group.rewards], dtype=torch.float32)
    with timer.phase("update/prepare"):
        batch = prepare_batch(completions, rewards, roles, sampling, algo)
        keep = torch.tensor(batch_groups.mask, dtype=torch.float32).repeat_interleave(sampling.n)
        batch.response_mask = batch.response_mask * keep.unsqueeze(-1)
    with timer.phase("update/train"):
        train_stats = roles.actor.update(batch)
    with timer.phase("update/sync"):
        roles.rollout.load_weights(roles.actor.full_weights())
    return {**wave_stats, **rollout_metrics(completions, batch), **train_stats}


@dataclass
class GroupPayload:
    """What a `Group` carries for the trainer: the prompt row and its n completions."""

    row: dict
    completions: list[Completion]


def collect_groups(draw_rows: Callable[[int], list[dict]], waves: WaveSampler, roles: Roles, sampling: SamplingConfig,
                   timer: PhaseTimer, seed: int) -> tuple[StepBatch, dict[str, float]]:
    """Generate and reward wave after wave until the step's groups are complete.

    Returns the step's groups and the statistics of everything generated this step (reward and
    accuracy of all samples, waves, valid fraction), so metrics describe the policy, not the filter.
    """
    waves.begin_step()
    all_rewards: list[float] = []
    all_accuracy: list[float] = []
    errors = 0
    judge_unparsed = 0
    judge_scores: list[float] = []
    wave = 0
    while (count := waves.next_wave_size()) > 0:
        rows = draw_rows(count)
        with timer.phase("rollout/generate"):
            prompt_ids = [roles.tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows]
            completions = roles.rollout.generate(prompt_ids, sampling, seed=seed * 31 + wave)
        with timer.phase("rollout/reward"):
            texts = decode_completions(roles.tokenizer, completions)
            inputs = [RewardInput(prompt=rows[c.prompt_index]["prompt"], completion=text, row=rows[c.prompt_index])
                      for c, text in zip(completions, texts, strict=True)]
            scored = roles.rewards(inputs)
        wave_rewards = list(scored.rewards)
        if roles.judge is not None:
            with timer.phase("rollout/judge"):
                verdicts, verdict_stats = roles.judge.score(inputs)
            judge_unparsed += verdict_stats.unparsed
            judge_scores.extend(v.reward for v in verdicts)
            wave_rewards = [r + roles.judge.cfg.weight * v.reward for r, v in zip(wave_rewards, verdicts, strict=True)]
        all_rewards.extend(wave_rewards)
        all_accuracy.extend(scored.accuracy or [])
        errors += scored.error_count
        n = sampling.n
        waves.add_wave([Group(key=i, rewards=tuple(wave_rewards[i * n:(i + 1) * n]),
                              payload=GroupPayload(row=row, completions=completions[i * n:(i + 1) * n]))
                        for i, row in enumerate(rows)])
        wave += 1
    step_groups = waves.finish_step()
    rewards = torch.tensor(all_rewards) if all_rewards else torch.zeros(1)
    stats = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/errors": float(errors),
        "sampling/waves": float(step_groups.waves),
        "sampling/generated_groups": float(step_groups.generated_groups),
        "sampling/valid_fraction": step_groups.valid_fraction_observed,
        "sampling/padded_groups": float(len(step_groups.mask) - sum(step_groups.mask)),
        "sampling/ema_valid_fraction": waves.ema,
    }
    if all_accuracy:
        stats["accuracy"] = sum(all_accuracy) / len(all_accuracy)
    if roles.judge is not None:
        stats["judge/mean_score"] = sum(judge_scores) / max(len(judge_scores), 1)
        stats["judge/unparsed"] = float(judge_unparsed)
    return step_groups, stats


def decode_completions(tokenizer: PreTrainedTokenizerBase, completions: list[Completion]) -> list[str]:
    """Completion texts without special tokens (the EOS that ended a completion is dropped)."""
    return tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)


def prepare_batch(completions: list[Completion], rewards: torch.Tensor, roles: Roles, sampling: SamplingConfig,
                  algo: AlgoConfig) -> TokenBatch:
    """Lay out the trainer batch and fill old / reference log-probs and group advantages."""
    batch = build_token_batch(completions, roles.tokenizer.pad_token_id)
    batch.old_logprobs = roles.actor.compute_logprobs(batch)
    if roles.reference is not None:
        batch.ref_logprobs = compute_logprobs(roles.reference, batch, roles.actor.temperature,
                                              roles.actor.train_cfg.micro_batch_size, roles.actor.device)
    batch.advantages = group_advantages(rewards, sampling.n, scale_by_std=algo.scale_rewards)
    return batch


def rollout_metrics(completions: list[Completion], batch: TokenBatch) -> dict[str, float]:
    """Length, truncation and engine/trainer log-prob agreement of the step's trained completions."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    mask = batch.response_mask
    logprob_gap = ((batch.rollout_logprobs - batch.old_logprobs).abs() * mask).max()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response/truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "rollout/logprob_gap_max": float(logprob_gap),
        "rollout/generated_tokens": float(lengths.sum()),
    }


@torch.no_grad()
def greedy_accuracy(rows: list[dict], roles: Roles, max_new_tokens: int, seed: int) -> tuple[float, int]:
    """(sum of accuracy scores, count) of greedy completions on held-out rows of this controller."""
    if not rows:
        return 0.0, 0
    greedy = SamplingConfig(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
    prompt_ids = [roles.tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows]
    completions = roles.rollout.generate(prompt_ids, greedy, seed=seed)
    texts = decode_completions(roles.tokenizer, completions)
    scored = roles.rewards([RewardInput(prompt=row["prompt"], completion=text, row=row) for row, text in zip(rows, texts, strict=True)])
    scores = scored.accuracy if scored.accuracy is not None else scored.rewards
    return float(sum(scores)), len(scores)
