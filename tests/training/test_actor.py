"""Actor update under FSDP2 (world size 1, gloo): accumulation, direction, clipping, weight export, warm-up."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

from gcore_rl.algos import ppo_clip_loss
from gcore_rl.algos.config import AlgoConfig
from gcore_rl.errors import ConfigError
from gcore_rl.models.tiny import TinyModelConfig, build_tiny_model
from gcore_rl.records import Completion, TokenBatch, build_token_batch
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.training.actor import Actor, TrainConfig, full_tensor
from gcore_rl.training.fsdp import shard_model
from gcore_rl.training.logprobs import token_logprobs
from gcore_rl.training.optim_step import MIN_KL_SCALE, kl_rate_scale

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, name: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda detail: f"{name}: {detail}")


pytestmark = pytest.mark.usefixtures("process_group")



def _model(tokenizer, seed: int = 0):
    return build_tiny_model(replace(SMALL, seed=seed), len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)


def _actor(model, *, sharded: bool = True, aggregation: str = "token_mean", **train) -> Actor:
    train.setdefault("grad_clip", 0.0)
    if sharded:
        model = shard_model(model)
    algo = AlgoConfig(loss_aggregation=aggregation).resolved(max_new_tokens=16)
    return Actor(model, TrainConfig(**train), algo, temperature=1.0, device=CPU)


def _batch(tokenizer, lengths: list[int], advantages: list[float], seed: int = 0) -> TokenBatch:
    """Prompts of different lengths (left padding) and random completions of the given (ragged) lengths."""
    gen = torch.Generator().manual_seed(seed)
    completions = []
    for i, length in enumerate(lengths):
        prompt = tokenizer.encode(f"{7 * i + 3}+{11 * i}=" + "x" * (i % 3), add_special_tokens=False)
        tokens = torch.randint(3, len(tokenizer), (length,), generator=gen).tolist()
        completions.append(Completion(i, prompt, tokens, [0.0] * length, "length"))
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    batch.advantages = torch.tensor(advantages, dtype=torch.float32)
    return batch


def _set_old_logprobs(actor: Actor, batch: TokenBatch, noise: float = 0.0, seed: int = 1) -> None:
    """Old log-probs = the current policy's, optionally perturbed so ratios differ from 1 (and some clip)."""
    old = actor.compute_logprobs(batch)
    if noise:
        gen = torch.Generator().manual_seed(seed)
        old = old + noise * torch.randn(old.shape, generator=gen) * batch.response_mask
    batch.old_logprobs = old


def _full_params(model) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters()}


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p.grad).clone() for name, p in model.named_parameters()}


def _response_logprob_sums(actor: Actor, batch: TokenBatch) -> torch.Tensor:
    return (actor.compute_logprobs(batch) * batch.response_mask).sum(-1)


# ---------------------------------------------------------------------------------------------- accumulation

RAGGED = [1, 6, 2, 9, 3, 5, 4]  # 7 rows: micro-batches of 2 leave a last one of 1 row
RAGGED_ADV = [1.0, -0.5, 2.0, -1.5, 0.3, 1.2, -0.8]


def _sgd_like(actor: Actor) -> Actor:
    """AdamW with eps=1: its first step is ~lr * grad, linear in the gradient like SGD.

    With the default eps=1e-8 the first step is ~lr * sign(grad), so float noise in a gradient
    component close to 0 could flip a whole lr-sized step and make exact comparisons flaky.
    """
    for group in actor.optimizer.param_groups:
        group["eps"] = 1.0
    return actor


def _one_step(tokenizer, micro_batch_size: int, aggregation: str):
    actor = _sgd_like(_actor(_model(tokenizer), aggregation=aggregation, lr=1e-2, micro_batch_size=micro_batch_size))
    batch = _batch(tokenizer, RAGGED, RAGGED_ADV)
    _set_old_logprobs(actor, batch, noise=0.3)
    stats = actor.update(batch)
    return stats, _full_params(actor.model), _full_grads(actor.model)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_accumulation_matches_whole_batch(tokenizer, aggregation):
    stats_small, params_small, grads_small = _one_step(tokenizer, 2, aggregation)
    stats_big, params_big, grads_big = _one_step(tokenizer, 64, aggregation)
    initial = dict(_model(tokenizer).named_parameters())

    assert params_small.keys() == params_big.keys() == initial.keys()
    moved = max(float((params_big[k] - initial[k].detach()).abs().max()) for k in initial)
    assert moved > 1e-5, "the optimiser step did not change the weights; the comparison would be vacuous"
    for name in params_big:
        # gradients left on the parameters are the accumulated (unclipped: grad_clip=0) ones
        _assert_close(grads_small[name], grads_big[name], rtol=1e-5, atol=1e-7, name=name)
        _assert_close(params_small[name], params_big[name], rtol=0, atol=1e-6, name=name)
    assert stats_small["pg_loss"] == pytest.approx(stats_big["pg_loss"], rel=1e-5, abs=1e-7)
    assert stats_small["grad_norm"] == pytest.approx(stats_big["grad_norm"], rel=1e-5)


def test_token_weighting_matters_for_ragged_batches(tokenizer):
    """Guard on the fixture above: with ragged lengths the two aggregations give different updates."""
    _, _, grads_token = _one_step(tokenizer, 64, "token_mean")
    _, _, grads_seq = _one_step(tokenizer, 64, "seq_mean_token_mean")
    diff = max(float((grads_token[k] - grads_seq[k]).abs().max()) for k in grads_token)
    assert diff > 1e-3


def test_token_level_metrics_do_not_depend_on_micro_batch_size(tokenizer):
    stats_small, _, _ = _one_step(tokenizer, 2, "seq_mean_token_mean")
    stats_big, _, _ = _one_step(tokenizer, 64, "seq_mean_token_mean")
    for key in ("approx_kl", "clip_fraction", "entropy"):
        assert stats_small[key] == pytest.approx(stats_big[key], rel=1e-5, abs=1e-7), key


def test_accumulation_with_a_row_without_response_tokens(tokenizer):
    def grads(micro_batch_size):
        batch = _batch(tokenizer, [2, 3, 4, 5], [1.0, 1.0, -1.0, 0.5])
        batch.response_mask[0] = 0.0  # a sample masked out of the loss
        actor = _actor(_model(tokenizer), aggregation="seq_mean_token_mean", micro_batch_size=micro_batch_size)
        _set_old_logprobs(actor, batch)
        actor.update(batch)
        return _full_grads(actor.model)

    small, big = grads(2), grads(64)
    for name in big:
        _assert_close(small[name], big[name], rtol=1e-5, atol=1e-7, name=name)


# ---------------------------------------------------------------------------------------------- direction


def test_update_raises_positive_and_lowers_negative_advantage_completions(tokenizer):
    advantages = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    batch = _batch(tokenizer, [4, 5, 3, 4, 6, 3], advantages, seed=5)
    actor = _actor(_model(tokenizer), lr=2e-3, micro_batch_size=4)
    _set_old_logprobs(actor, batch)
    before = _response_logprob_sums(actor, batch)
    stats = actor.update(batch)
    after = _response_logprob_sums(actor, batch)

    delta = after - before
    adv = torch.tensor(advantages)
    assert stats["clip_fraction"] == 0.0  # on-policy start: ratio 1 everywhere
    assert torch.all(delta[adv > 0] > 0), delta
    assert torch.all(delta[adv < 0] < 0), delta
    # a second pass from the new weights must see a better surrogate: sum_i A_i * logp_i went up
    assert float((adv * delta).sum()) > 0


def test_zero_advantages_leave_weights_unchanged(tokenizer):
    batch = _batch(tokenizer, [3, 4, 2], [0.0, 0.0, 0.0])
    actor = _actor(_model(tokenizer), lr=1e-2)
    _set_old_logprobs(actor, batch)
    before = _full_params(actor.model)
    stats = actor.update(batch)
    assert stats["grad_norm"] == 0.0
    for name, value in _full_params(actor.model).items():
        _assert_close(value, before[name], rtol=0, atol=0, name=name)


# ---------------------------------------------------------------------------------------------- clipping


def _manual_grad_norm(tokenizer, batch: TokenBatch) -> float:
    """Global grad norm of the same loss on an unsharded copy of the initial weights, computed by hand."""
    model = _model(tokenizer).train()
    logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)
    algo = AlgoConfig()
    loss, _ = ppo_clip_loss(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask,
                            clip_low=algo.clip_low, clip_high=algo.clip_high, aggregation="token_mean")
    loss.backward()
    # parameters() lists the tied embedding / lm_head matrix once, as the optimiser and the clip see it
    return float(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None).sqrt())


@pytest.mark.parametrize("grad_clip", [0.0, 1e-3])
def test_reported_grad_norm_is_the_pre_clip_norm(tokenizer, grad_clip):
    batch = _batch(tokenizer, [2, 5, 3, 6], [1.0, -1.0, 0.5, -0.5], seed=2)
    actor = _actor(_model(tokenizer), lr=1e-3, grad_clip=grad_clip, micro_batch_size=64)
    _set_old_logprobs(actor, batch, noise=0.1)
    expected = _manual_grad_norm(tokenizer, batch)
    stats = actor.update(batch)

    assert expected > 1e-2
    assert stats["grad_norm"] == pytest.approx(expected, rel=1e-5)
    post_clip = float(torch.sqrt(sum(full_tensor(p.grad).double().square().sum() for p in actor.model.parameters())))
    if grad_clip:
        assert expected > 10 * grad_clip, "the clip must be active for this test to mean anything"
        assert post_clip == pytest.approx(grad_clip, rel=1e-4)
    else:
        assert post_clip == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------------------------- weight export


def test_full_weights_cover_every_parameter_and_sync_into_an_engine(tokenizer):
    reference = dict(_model(tokenizer).named_parameters())
    actor = _actor(_model(tokenizer), lr=1e-3)
    assert any(isinstance(p, DTensor) for p in actor.model.parameters()), "the actor model should be FSDP-sharded"
    batch = _batch(tokenizer, [3, 5, 2, 4], [1.0, -1.0, 0.5, -0.5], seed=3)
    _set_old_logprobs(actor, batch)
    actor.update(batch)  # so that the synced weights differ from any freshly built model

    full = list(actor.full_weights())
    names = [name for name, _ in full]
    assert names == list(reference)
    assert len(set(names)) == len(names)
    for name, tensor in full:
        assert not isinstance(tensor, DTensor), name
        assert tensor.shape == reference[name].shape, name
        assert tensor.dtype == reference[name].dtype, name

    engine = GenerationEngine(_model(tokenizer, seed=7), tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert engine.load_weights(actor.full_weights()) == len(names)
    assert engine.policy_version == 1
    engine_params = dict(engine.model.named_parameters())
    assert engine_params.keys() == dict(full).keys()
    for name, tensor in full:
        _assert_close(engine_params[name], tensor, rtol=0, atol=0, name=name)
    # the tied output projection follows the embedding it shares storage with
    torch.testing.assert_close(engine.model.lm_head.weight, dict(full)["model.embed_tokens.weight"], rtol=0, atol=0)
    # and the engine now scores tokens exactly as the actor does
    with torch.no_grad():
        engine_lp, _ = token_logprobs(engine.model, batch.input_ids, batch.attention_mask, 1.0)
    gap = ((engine_lp - actor.compute_logprobs(batch)).abs() * batch.response_mask).max()
    assert float(gap) < 1e-5


# ---------------------------------------------------------------------------------------------- warm-up


def test_linear_warmup_schedule(tokenizer):
    lr, warmup = 1e-3, 4
    batch = _batch(tokenizer, [3, 4], [1.0, -1.0], seed=4)
    actor = _actor(_model(tokenizer), lr=lr, warmup_steps=warmup, mini_batches=1)
    _set_old_logprobs(actor, batch)

    before = _full_params(actor.model)
    applied = []
    for step in range(1, 7):
        applied.append(actor.optimizer.param_groups[0]["lr"])  # lr used by the step-th optimiser step
        actor.update(batch)
        if step == 1:
            # first AdamW step moves each weight by lr * g / (|g| + eps) ~= lr: measure the lr actually used
            moved = max(float((v - before[k]).abs().max()) for k, v in _full_params(actor.model).items())
            assert moved == pytest.approx(lr * 1 / warmup, rel=1e-3)
    assert applied == pytest.approx([lr * min(1.0, k / warmup) for k in range(1, 7)], rel=1e-9)


def test_no_warmup_uses_the_full_lr_from_the_first_step(tokenizer):
    actor = _actor(_model(tokenizer), lr=3e-4, warmup_steps=0)
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4)


def test_reported_lr_is_the_lr_the_step_used(tokenizer):
    lr, warmup = 1e-3, 4
    batch = _batch(tokenizer, [3, 4], [1.0, -1.0], seed=4)
    actor = _actor(_model(tokenizer), lr=lr, warmup_steps=warmup)
    _set_old_logprobs(actor, batch)
    reported = [actor.update(batch)["lr"] for _ in range(3)]
    assert reported == pytest.approx([lr * k / warmup for k in (1, 2, 3)])


# ---------------------------------------------------------------------------------------------- KL-adapted rate


def test_the_kl_rate_scale_steps_down_past_twice_the_target_and_back_up_below_half():
    target = 0.01
    assert kl_rate_scale(1.0, 0.021, target) == pytest.approx(1 / 1.5)
    assert kl_rate_scale(0.5, 0.015, target) == 0.5  # inside [target / 2, 2 target]: kept
    assert kl_rate_scale(0.5, 0.004, target) == pytest.approx(0.75)
    assert kl_rate_scale(0.9, 0.0, target) == 1.0  # never above the configured rate
    assert kl_rate_scale(MIN_KL_SCALE, 5.0, target) == MIN_KL_SCALE  # nor below the floor
    scale = 1.0
    for _ in range(3):
        scale = kl_rate_scale(scale, 0.5, target)
    assert scale == pytest.approx(1.5 ** -3)


def test_a_kl_target_moves_the_rate_of_the_next_step_and_survives_a_checkpoint(tokenizer):
    """An update past twice the target lowers the rate its next optimiser step uses (warm-up included); the
    scale is part of the scheduler's state, so a trainer loaded from it continues at the same rate."""
    lr, warmup = 1e-3, 4
    batch = _batch(tokenizer, [3, 4, 5, 6], [1.0, -1.0, 0.5, -0.5], seed=4)
    actor = _actor(_model(tokenizer), lr=lr, warmup_steps=warmup, mini_batches=2, target_kl=1e-9)
    _set_old_logprobs(actor, batch, noise=0.3)  # the batch's KL to its "sampling" policy is far past the target
    stats = actor.update(batch)
    assert stats["approx_kl"] > 2e-9 and stats["lr_kl_scale"] == pytest.approx(1 / 1.5)
    # two optimiser steps taken: the third uses warm-up 3/4, times the lowered scale
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 3 / warmup / 1.5)
    state = copy.deepcopy(actor.scheduler.state_dict())
    fresh = _actor(_model(tokenizer), lr=lr, warmup_steps=warmup, mini_batches=2, target_kl=1e-9)
    fresh.scheduler.load_state_dict(state)
    assert fresh.scheduler.lr_lambdas[0].kl_scale == pytest.approx(1 / 1.5)
    assert fresh.scheduler.get_last_lr() == pytest.approx(actor.scheduler.get_last_lr())
    assert "lr_kl_scale" not in _actor(_model(tokenizer), lr=lr, mini_batches=2).update(batch)  # no target: fixed


def test_a_kl_target_needs_more_than_one_optimiser_step_per_rl_step():
    with pytest.raises(ConfigError, match="target_kl"):
        TrainConfig(target_kl=0.01).validate()
    with pytest.raises(ConfigError, match="target_kl"):
        TrainConfig(target_kl=-1.0, mini_batches=2).validate()
    TrainConfig(target_kl=0.01, ppo_epochs=2).validate()


def test_single_pass_update_without_old_logprobs_equals_the_two_pass_update(tokenizer):
    """One optimiser step: taking old log-probs from the training forward itself (no extra pass)
    gives the same gradients and weights as recomputing them first, and reports the engine gap."""
    def run(precompute: bool):
        actor = _sgd_like(_actor(_model(tokenizer), lr=1e-2, micro_batch_size=3))
        batch = _batch(tokenizer, RAGGED, RAGGED_ADV)
        current = actor.compute_logprobs(batch)
        batch.rollout_logprobs = current + 0.01 * batch.response_mask  # the engine's, off by 0.01
        if precompute:
            batch.old_logprobs = current
        stats = actor.update(batch)
        return stats, _full_params(actor.model), _full_grads(actor.model), actor.logprob_gap_max

    stats_two, params_two, grads_two, _ = run(precompute=True)
    stats_one, params_one, grads_one, gap = run(precompute=False)
    for name in params_two:
        _assert_close(grads_one[name], grads_two[name], rtol=1e-5, atol=1e-7, name=name)
        _assert_close(params_one[name], params_two[name], rtol=0, atol=1e-6, name=name)
    assert stats_one["pg_loss"] == pytest.approx(stats_two["pg_loss"], rel=1e-5, abs=1e-7)
    assert stats_one["clip_fraction"] == 0.0
    assert gap == pytest.approx(0.01, abs=1e-5)


def test_multi_step_update_needs_old_logprobs(tokenizer):
    actor = _actor(_model(tokenizer), lr=1e-2, micro_batch_size=4, mini_batches=2)
    with pytest.raises(ValueError, match="old_logprobs are needed"):
        actor.update(_batch(tokenizer, RAGGED, RAGGED_ADV))
