"""PPO's critic next to the actor (PolicyTrainer with algo.advantage=gae, world size 1, gloo):
what prepare fills in against the pure functions, the critic learning its targets, the warm-up that
keeps the actor still, one PPO update raising the best completion, and exact resume of both models.

Whitening and explained variance over several trainer ranks are in test_critic_ranks.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from critic_helpers import ragged_batch

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.kl import kl_divergence
from gcore_rl.algos.masked import masked_mean, masked_whiten
from gcore_rl.algos.value_loss import explained_variance, value_targets
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.records import TokenBatch
from gcore_rl.training.actor import TrainConfig, full_tensor
from gcore_rl.training.critic import CriticConfig, global_explained_variance, global_whiten
from gcore_rl.training.policy_trainer import PolicyTrainer

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=5)
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


pytestmark = pytest.mark.usefixtures("process_group")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), SMALL)



def _trainer(model_dir, algo: AlgoConfig | None = None, critic: CriticConfig | None = None, **train) -> PolicyTrainer:
    algo = algo or AlgoConfig(advantage="gae")
    algo.validate()
    return PolicyTrainer.build(model_dir, dtype="float32", attn_implementation="sdpa", reference_path=None,
                               train=TrainConfig(**{"lr": 1e-2, "grad_clip": 0.0, **train}), algo=algo,
                               logprob_temperature=1.0, device=CPU, bf16=False, critic=critic or CriticConfig(lr=1e-2))


def _batch(tokenizer, seed: int = 0) -> TokenBatch:
    """Six ragged rows with outcome rewards (a fresh object each call)."""
    return ragged_batch(tokenizer, REWARDS, seed)


def _full(model) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters()}


def test_a_critic_started_from_the_policy_values_every_state_at_zero(model_dir, tokenizer):
    trainer = _trainer(model_dir)
    batch = _batch(tokenizer)
    trainer.prepare(batch)
    assert torch.equal(batch.old_values, torch.zeros_like(batch.old_values))
    # with V = 0 every TD residual is the reward, which sits on the last token: A_t = R * (gamma lam)^(tokens after t),
    # and the returns A + V are the same (gamma = 1, lam = 0.95 by default)
    after = batch.response_mask.flip(-1).cumsum(-1).flip(-1) - 1
    expected = batch.rewards[:, None] * 0.95 ** after * batch.response_mask
    torch.testing.assert_close(batch.returns, expected, rtol=0, atol=1e-6)


def test_prepare_fills_values_and_the_gae_targets_of_the_pure_functions(model_dir, tokenizer):
    algo = AlgoConfig(advantage="gae", gamma=0.9, lam=0.8, kl_coef=0.1, kl_in_reward=True)
    trainer = _trainer(model_dir, algo, mini_batches=2)
    batch = _batch(tokenizer)
    _update(trainer, batch)  # the values, the policy and the reference now differ from one another
    batch = _batch(tokenizer, seed=1)
    current = trainer.prepare(batch)
    assert batch.old_values is not None and batch.old_values.abs().sum() > 0
    assert torch.equal(batch.old_values, trainer.critic.values(batch))
    kl = kl_divergence(current, batch.ref_logprobs, algo.kl_estimator)
    assert (kl * batch.response_mask).abs().sum() > 0, "the policy moved: the KL in the reward is not vacuous"
    advantages, returns = value_targets(batch.rewards, batch.old_values, batch.response_mask, 0.9, 0.8, kl=kl,
                                        kl_coef=0.1, whiten_advantages=True)
    torch.testing.assert_close(batch.returns, returns, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.advantages, advantages, rtol=0, atol=1e-5)
    assert trainer.prepare_passes == 3  # current log-probs (ratio and KL), reference, values
    stats = trainer.update(batch, current)
    assert stats["kl"] == pytest.approx(float(masked_mean(kl, batch.response_mask)), rel=1e-6)
    assert stats["critic/returns_mean"] == pytest.approx(float(masked_mean(returns, batch.response_mask)), rel=1e-6)


def test_the_critic_learns_its_targets(model_dir, tokenizer):
    trainer = _trainer(model_dir, critic=CriticConfig(lr=1e-2, value_clip=None, actor_freeze_steps=100))
    errors = []
    for _ in range(15):
        batch = _batch(tokenizer)
        stats = _update(trainer, batch)
        errors.append(stats["critic/squared_error"])
    assert errors[-1] < 0.25 * errors[0], errors
    batch = _batch(tokenizer)
    trainer.prepare(batch)
    assert explained_variance(batch.old_values, batch.returns, batch.response_mask) > 0.5


def test_warm_up_trains_only_the_critic(model_dir, tokenizer):
    trainer = _trainer(model_dir, critic=CriticConfig(lr=1e-2, actor_freeze_steps=2))
    actor_before, critic_before = _full(trainer.model), _full(trainer.critic.model)
    for step in range(2):
        stats = _update(trainer, _batch(tokenizer, seed=step))
        assert stats["actor/frozen"] == 1.0 and "pg_loss" not in stats
    assert all(torch.equal(actor_before[n], p) for n, p in _full(trainer.model).items())
    assert any(not torch.equal(critic_before[n], p) for n, p in _full(trainer.critic.model).items())
    assert trainer.optimiser_steps == 0
    stats = _update(trainer, _batch(tokenizer, seed=2))
    assert stats["actor/frozen"] == 0.0 and math.isfinite(stats["pg_loss"])
    assert any(not torch.equal(actor_before[n], p) for n, p in _full(trainer.model).items())


def test_one_ppo_update_raises_the_best_completion(model_dir, tokenizer):
    trainer = _trainer(model_dir)
    batch = _batch(tokenizer)
    trainer.prepare(batch)
    best = int((batch.advantages * batch.response_mask).sum(-1).argmax())
    assert REWARDS[best] == 1.0

    def sequence_logprob() -> float:
        return float((trainer.actor.compute_logprobs(batch) * batch.response_mask).sum(-1)[best])

    before = sequence_logprob()
    stats = trainer.update(batch, None)
    assert all(math.isfinite(stats[key]) for key in ("pg_loss", "critic/value_loss", "critic/grad_norm"))
    assert sequence_logprob() > before


def test_critic_and_actor_resume_exactly_from_the_state_dict(model_dir, tokenizer):
    def run(trainer: PolicyTrainer, seeds) -> list[dict[str, float]]:
        return [_update(trainer, _batch(tokenizer, seed)) for seed in seeds]

    critic = CriticConfig(lr=1e-2, warmup_steps=3, actor_freeze_steps=2)
    first = _trainer(model_dir, critic=critic, mini_batches=2, warmup_steps=2)
    run(first, [0])
    resumed = _trainer(model_dir, critic=critic, mini_batches=2, warmup_steps=2)
    resumed.load_state_dict(first.state_dict())
    assert resumed.updates == 1
    # step 2 still has the actor frozen, step 3 trains it: the warm-up count is part of the state
    assert run(resumed, [1, 2]) == run(first, [1, 2])
    for ours, theirs in ((first.model, resumed.model), (first.critic.model, resumed.critic.model)):
        assert all(torch.equal(a, b) for a, b in zip(_full(ours).values(), _full(theirs).values(), strict=True))


def test_whitening_and_explained_variance_of_one_rank_are_the_local_ones():
    gen = torch.Generator().manual_seed(0)
    values, returns = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).float()
    torch.testing.assert_close(global_whiten(values, mask, CPU), masked_whiten(values, mask), rtol=0, atol=1e-6)
    assert global_explained_variance(values, returns, mask, CPU) == pytest.approx(
        float(explained_variance(values, returns, mask)), abs=1e-6)


def _update(trainer: PolicyTrainer, batch: TokenBatch) -> dict[str, float]:
    return trainer.update(batch, trainer.prepare(batch))


def test_a_lora_critic_trains_its_adapters_and_head_and_resumes(model_dir, tokenizer):
    """`critic.lora`: the critic's body stays frozen, its adapters and value head train and are its whole state,
    and it still learns its targets."""
    from gcore_rl.models.lora import LoraSettings

    critic = CriticConfig(lr=5e-3, value_clip=None, actor_freeze_steps=100, lora=LoraSettings(enabled=True, rank=4))
    torch.manual_seed(0)
    trainer = _trainer(model_dir, critic=critic)
    trained = {name for name, p in trainer.critic.model.named_parameters() if p.requires_grad}
    assert any(".lora_A." in name for name in trained) and any("score" in name for name in trained)
    assert all(".lora_" in name or "score" in name for name in trained)
    errors = [_update(trainer, _batch(tokenizer))["critic/squared_error"] for _ in range(15)]
    assert errors[-1] < 0.25 * errors[0], errors
    state = trainer.state_dict()["critic"]
    assert set(state["model"]) == trained
    torch.manual_seed(0)
    resumed = _trainer(model_dir, critic=critic)
    resumed.load_state_dict(trainer.state_dict())
    assert _update(resumed, _batch(tokenizer, 3)) == _update(trainer, _batch(tokenizer, 3))
