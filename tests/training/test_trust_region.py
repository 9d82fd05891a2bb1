"""The actor's trust region (`train.max_kl`): a step past the bound is halved back toward the weights before
it, or undone; a step within it is left as it is."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.errors import ConfigError
from gcore_rl.models.tiny import TinyModelConfig, build_tiny_model
from gcore_rl.records import Completion, TokenBatch, build_token_batch
from gcore_rl.training.actor import Actor, TrainConfig, full_tensor
from gcore_rl.training.fsdp import shard_model
from gcore_rl.training.trust_region import MAX_HALVINGS, backtrack, group_approx_kl

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)

pytestmark = pytest.mark.usefixtures("process_group")


def test_backtrack_halves_the_step_until_the_measure_fits():
    before = [torch.zeros(3), torch.ones(2)]
    params = [torch.full((3,), 4.0), torch.full((2,), 5.0)]  # a step of 4 in every coordinate
    measured = []

    def measure() -> float:  # a stand-in for the KL: the squared step length per coordinate
        measured.append(float((params[0] - before[0]).square().mean()))
        return measured[-1]

    result = backtrack(params, before, measure, max_kl=1.5)
    assert measured == [16.0, 4.0, 1.0]  # the full step, then two halvings
    assert (result.full_kl, result.halvings, result.undone) == (16.0, 2, False)
    assert torch.equal(params[0], torch.ones(3)) and torch.equal(params[1], torch.full((2,), 2.0))
    assert result.as_metrics() == {"kl_backtracks": 2.0, "kl_undone": 0.0, "kl_probe_max": 16.0}


def test_backtrack_undoes_a_step_no_halving_brings_within_the_bound():
    before = [torch.randn(4)]
    params = [before[0] + 1.0]
    calls = []
    result = backtrack(params, before, lambda: calls.append(1) or 1.0, max_kl=0.5)
    assert len(calls) == 1 + MAX_HALVINGS and result.undone and result.halvings == MAX_HALVINGS
    assert torch.equal(params[0], before[0])  # exactly the weights before the step


def test_group_approx_kl_is_the_token_mean_of_k2_over_the_mask():
    new = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0]])
    old = torch.tensor([[0.0, -1.5, -1.0], [0.0, -0.5, 0.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    assert group_approx_kl(new, old, mask, CPU) == pytest.approx((0.5 * 0.25 + 0.5 * 1.0 + 0.0) / 3)
    assert group_approx_kl(new, old, torch.zeros_like(mask), CPU) == 0.0
    # over parts (mini-batches), the largest part's mean: row 0 (0.625 over 2 tokens), row 1 (0 over 1 token)
    assert group_approx_kl(new, old, mask, CPU, [slice(0, 1), slice(1, 2)]) == pytest.approx(0.625 / 2)


def _tokenizer_batch(tokenizer, rows: int = 8, seed: int = 0) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    completions = []
    for i in range(rows):
        prompt = tokenizer.encode(f"{7 * i + 3}+{11 * i}=", add_special_tokens=False)
        tokens = torch.randint(3, len(tokenizer), (4 + i % 3,), generator=gen).tolist()
        completions.append(Completion(i, prompt, tokens, [0.0] * len(tokens), "length"))
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    batch.advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(rows)])
    return batch


def _actor(tokenizer, **train) -> Actor:
    model = shard_model(build_tiny_model(replace(SMALL, seed=0), len(tokenizer), tokenizer.pad_token_id,
                                         tokenizer.eos_token_id))
    algo = AlgoConfig(loss_aggregation="token_mean").resolved(max_new_tokens=16)
    return Actor(model, TrainConfig(grad_clip=0.0, **train), algo, temperature=1.0, device=CPU)


def _kl_on(actor: Actor, batch: TokenBatch, rows: slice) -> float:
    part = batch.select(rows)
    return group_approx_kl(actor.compute_logprobs(part), part.old_logprobs, part.response_mask, CPU)


def test_an_update_past_the_bound_ends_inside_it(tokenizer):
    """A rate that takes each step far past the bound: with `max_kl` every step is measured on every mini-batch and
    shrunk until each is within the bound, so the final policy is within it on each, and so is the KL the update
    reports (each mini-batch's, measured before its step on weights a probe kept); the update reports what the
    full steps reached and the halvings."""
    bound = 0.002
    batch = _tokenizer_batch(tokenizer)
    free = _actor(tokenizer, lr=0.01, mini_batches=2)
    batch.old_logprobs = free.compute_logprobs(batch)
    free_stats = free.update(batch)
    everything = slice(0, batch.size)
    assert _kl_on(free, batch, everything) > 2 * bound and free_stats["approx_kl"] > bound

    bounded = _actor(tokenizer, lr=0.01, mini_batches=2, max_kl=bound)
    assert not bounded.single_pass
    stats = bounded.update(batch)
    assert stats["kl_probe_max"] > 2 * bound and stats["kl_backtracks"] > 0
    for half in (slice(0, batch.size // 2), slice(batch.size // 2, batch.size)):
        assert _kl_on(bounded, batch, half) <= bound
    assert stats["approx_kl"] <= bound / 2  # 0 on the first mini-batch, at most the bound on the second


def test_an_update_within_the_bound_is_the_update_without_it(tokenizer):
    batch = _tokenizer_batch(tokenizer, seed=1)
    plain = _actor(tokenizer, lr=1e-3, mini_batches=2, ppo_epochs=2)
    batch.old_logprobs = plain.compute_logprobs(batch)
    plain_stats = plain.update(batch)
    bounded = _actor(tokenizer, lr=1e-3, mini_batches=2, ppo_epochs=2, max_kl=10.0)
    stats = bounded.update(batch)
    assert stats["kl_backtracks"] == 0 and stats["kl_undone"] == 0 and stats["kl_probe_max"] < 10.0
    assert stats["approx_kl"] == pytest.approx(plain_stats["approx_kl"], rel=1e-6, abs=1e-12)
    for (name, p), q in zip(plain.model.named_parameters(), bounded.model.parameters(), strict=True):
        assert torch.equal(full_tensor(p.detach()), full_tensor(q.detach())), name


def test_the_region_is_around_the_policy_before_the_update_not_a_stale_sampler(tokenizer):
    """Stale rows' old log-probs can be their older sampler's, already past the bound before any step: measured from
    them every step would be undone. The trainer passes the log-probs before the update, and the steps are kept."""
    batch = _tokenizer_batch(tokenizer, seed=2)
    probe = _actor(tokenizer, lr=1e-3, mini_batches=2)
    current = probe.compute_logprobs(batch)
    gen = torch.Generator().manual_seed(3)
    batch.old_logprobs = current + 0.5 * torch.randn(current.shape, generator=gen) * batch.response_mask
    frozen = _actor(tokenizer, lr=1e-3, mini_batches=2, max_kl=0.02)
    assert frozen.update(batch)["kl_undone"] == 1.0  # from the sampler's log-probs: nothing kept
    kept = _actor(tokenizer, lr=1e-3, mini_batches=2, max_kl=0.02)
    stats = kept.update(batch, start_logprobs=current)
    assert stats["kl_undone"] == 0.0
    assert group_approx_kl(kept.compute_logprobs(batch), current, batch.response_mask, CPU) <= 0.02


def test_max_kl_must_be_a_finite_non_negative_number():
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="max_kl"):
            TrainConfig(max_kl=bad).validate()
    TrainConfig(max_kl=0.05).validate()  # one optimiser step is fine: the probe is its own mini-batch
