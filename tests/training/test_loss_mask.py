"""The trainer honours a completion's loss mask: tokens a rollout function inserted (mask 0) are context the
policy reads, never trained on. Checked where the mask enters: the policy losses under every aggregation with
the KL and entropy terms, packed passes, token counts, GAE and the critic's loss, and the log-prob gap metric."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from gcore_rl.algos.advantages import gae_advantages, last_token_rewards
from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.policy_loss import logprob_gap_max
from gcore_rl.algos.value_loss import clipped_value_loss
from gcore_rl.models.tiny import TinyModelConfig, build_tiny_model
from gcore_rl.records import Completion, TokenBatch, build_token_batch
from gcore_rl.training.actor import Actor, TrainConfig
from gcore_rl.training.logprobs import first_response_column

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
MASKS = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0]]
"""Per completion: 1 = the policy's token, 0 = inserted (a tool's answer in the middle, or at the end)."""

pytestmark = pytest.mark.usefixtures("process_group")


def _model(tokenizer):
    return build_tiny_model(SMALL, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)


def _batch(tokenizer, actor: Actor) -> TokenBatch:
    """Completions with the loss masks of `MASKS`, old / reference log-probs near the policy's (so ratios clip)
    and arbitrary values on the inserted tokens, where nothing may read them."""
    gen = torch.Generator().manual_seed(0)
    completions = []
    for i, mask in enumerate(MASKS):
        prompt = tokenizer.encode(f"{3 * i + 1}+{i}=", add_special_tokens=False)
        tokens = torch.randint(3, len(tokenizer), (len(mask),), generator=gen).tolist()
        logprobs = [-1.5 * m for m in mask]
        completions.append(Completion(i, prompt, tokens, logprobs, "length", loss_mask=mask))
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    current = actor.compute_logprobs(batch)
    noise = torch.randn(current.shape, generator=gen)
    inserted = batch.attention_mask.bool() & ~batch.response_mask.bool()
    inserted[:, : first_response_column(batch.response_mask)] = False
    batch.old_logprobs = torch.where(inserted, torch.full_like(current, 7.0), current + 0.3 * noise)
    batch.ref_logprobs = torch.where(inserted, torch.full_like(current, -9.0), current - 0.2 * noise.abs())
    batch.advantages = torch.tensor([1.0, -0.5, 2.0, -1.0])
    return batch


@pytest.mark.parametrize("policy_loss, aggregation", [
    ("ppo_clip", "token_mean"), ("ppo_clip", "seq_mean_token_mean"), ("ppo_clip", "seq_mean_token_sum_norm"),
    ("dual_clip", "token_mean"), ("gspo", "seq_mean_token_mean"), ("cispo", "token_mean")])
def test_inserted_tokens_get_exactly_zero_gradient(tokenizer, policy_loss, aggregation):
    """The gradient of the whole loss (policy term, KL in the loss, entropy bonus) with respect to the logits
    that predict an inserted token is exactly 0; the policy's tokens get a gradient."""
    algo = AlgoConfig(policy_loss=policy_loss, loss_aggregation=aggregation, kl_coef=0.1,
                      entropy_coef=0.01).resolved(max_new_tokens=16)
    actor = Actor(_model(tokenizer), TrainConfig(grad_clip=0.0), algo, temperature=1.0, device=CPU)
    batch = _batch(tokenizer, actor)
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = actor.model.lm_head.register_forward_hook(keep)
    loss, stats = actor._loss(batch)
    handle.remove()
    loss.backward()
    first = first_response_column(batch.response_mask)
    predicts = batch.response_mask[:, first:]
    # the head's output: the chunked head's [B, T - first, 2] (log-prob, entropy), of which the logits' gradient
    # is a multiple per position (training/chunked_head.py), or [B, T - first + 1, V] logits; either way column
    # j predicts the token of column first + j
    grad = captured["logits"].grad[:, :predicts.shape[1]]
    inserted = (batch.attention_mask[:, first:] == 1) & (predicts == 0)
    assert int(inserted.sum()) == sum(m.count(0) for m in MASKS)
    assert torch.count_nonzero(grad[inserted]) == 0
    assert grad[predicts.bool()].abs().sum(dim=-1).min() > 0
    assert stats["kl"] > 0


def test_packed_passes_and_token_counts_follow_the_mask(tokenizer):
    """Packed and padded passes give the same loss and gradients on a masked batch, and the loss averages over
    the policy's tokens only (token_mean's units)."""
    algo = AlgoConfig(kl_coef=0.1, entropy_coef=0.01).resolved(max_new_tokens=16)
    model = _model(tokenizer)
    padded = Actor(copy.deepcopy(model), TrainConfig(grad_clip=0.0), algo, temperature=1.0, device=CPU)
    packed = Actor(copy.deepcopy(model), TrainConfig(grad_clip=0.0, packing=True), algo, temperature=1.0, device=CPU)
    batch = _batch(tokenizer, padded)
    assert padded._loss_units(batch) == sum(map(sum, MASKS))
    losses = []
    for actor in (padded, packed):
        loss, _ = actor._loss(batch)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(padded.model.named_parameters(), packed.model.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_gae_skips_inserted_tokens_as_if_they_were_not_there():
    """GAE over a row with inserted tokens equals GAE over the same row with those columns removed, at the
    policy's tokens; the outcome reward sits on the last policy token, even when inserted tokens end the row."""
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    values = torch.randn(mask.shape, generator=gen)
    rewards = torch.tensor([1.0, -0.5])
    token_rewards = last_token_rewards(rewards, mask)
    assert token_rewards[0, 6] == 1.0 and token_rewards[1, 5] == -0.5 and token_rewards.count_nonzero() == 2
    advantages, returns = gae_advantages(token_rewards, values, mask, gamma=0.9, lam=0.8)
    for row in range(2):
        keep = mask[row].bool()
        compact_adv, compact_ret = gae_advantages(token_rewards[row, keep][None], values[row, keep][None],
                                                  torch.ones(1, int(keep.sum())), gamma=0.9, lam=0.8)
        torch.testing.assert_close(advantages[row, keep], compact_adv[0])
        torch.testing.assert_close(returns[row, keep], compact_ret[0])
        assert not advantages[row, ~keep].any() and not returns[row, ~keep].any()


def test_the_critics_loss_gives_inserted_tokens_no_gradient():
    gen = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 1, 0]], dtype=torch.float32)
    values = torch.randn(mask.shape, generator=gen, requires_grad=True)
    old = values.detach() + 0.05 * torch.randn(mask.shape, generator=gen)  # within the clip: every policy token learns
    returns = torch.randn(mask.shape, generator=gen)
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        values.grad = None
        loss, _ = clipped_value_loss(values, old, returns, mask, value_clip=0.2, aggregation=aggregation)
        loss.backward()
        assert torch.count_nonzero(values.grad[mask == 0]) == 0 and values.grad[mask == 1].abs().min() > 0


def test_the_logprob_gap_ignores_inserted_tokens():
    """Inserted tokens carry log-prob 0 from the rollout and a real one from the trainer: no gap is counted there."""
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    rollout = torch.tensor([[-1.0, 0.0, 0.0, -2.0]])
    trainer = torch.tensor([[-1.001, -6.0, -4.0, -2.002]])
    assert logprob_gap_max(rollout, trainer, mask, None) == pytest.approx(0.002, abs=1e-6)
    assert logprob_gap_max(rollout, trainer, torch.ones_like(mask), None) == pytest.approx(6.0)


def test_a_completion_without_a_mask_trains_every_token(tokenizer):
    c = Completion(0, [5, 6], [7, 8, 9], [-1.0, -1.0, -1.0], "stop")
    masked = replace(c, loss_mask=[1, 0, 1], logprobs=[-1.0, 0.0, -1.0])
    assert build_token_batch([c], 0).response_mask.tolist() == [[0, 0, 1, 1, 1]]
    assert build_token_batch([masked], 0).response_mask.tolist() == [[0, 0, 1, 0, 1]]
