"""PPO's critic on devices of its own (`CriticTrainer`, `placement.critic_devices`) against the critic next to
the actor (world size 1, gloo): the same batches give the same values, the same actor and critic weights
and the same statistics, step after step, so moving the critic changes where it runs and nothing else.
And its state resumes exactly. The Ray run with a critic device is tests/runtime/test_ray_critic.py.
"""

from __future__ import annotations

import pytest
import torch
from critic_helpers import ragged_batch

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.records import TokenBatch
from gcore_rl.training.actor import TrainConfig, full_tensor
from gcore_rl.training.critic import CriticConfig
from gcore_rl.training.critic_trainer import CriticTrainer
from gcore_rl.training.policy_trainer import PolicyTrainer

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=7)
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0]
CRITIC = CriticConfig(lr=1e-2, warmup_steps=2, actor_freeze_steps=1)
TRAIN = TrainConfig(lr=1e-2, grad_clip=1.0, mini_batches=2, ppo_epochs=2)

pytestmark = pytest.mark.usefixtures("process_group")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), SMALL)


def _algo() -> AlgoConfig:
    algo = AlgoConfig(advantage="gae", gamma=0.95, lam=0.9, kl_coef=0.05)
    algo.validate()
    return algo


def _policy(model_dir, with_critic: bool) -> PolicyTrainer:
    return PolicyTrainer.build(model_dir, dtype="float32", attn_implementation="sdpa", reference_path=None,
                               train=TRAIN, algo=_algo(), logprob_temperature=1.0, device=CPU, bf16=False,
                               critic=CRITIC, with_critic=with_critic)


def _critic(model_dir) -> CriticTrainer:
    return CriticTrainer.build(model_dir, CRITIC, dtype="float32", attn_implementation="sdpa", train=TRAIN,
                               algo=_algo(), device=CPU, bf16=False)


def _batch(tokenizer, seed: int) -> TokenBatch:
    return ragged_batch(tokenizer, REWARDS, seed)


def _full(model) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p.detach()).clone() for name, p in model.named_parameters()}


def _apart_step(policy: PolicyTrainer, critic: CriticTrainer, tokenizer, seed: int) -> dict[str, float]:
    """One step as the slice runs it with a critic device: values first, then both updates."""
    for_critic, for_actor = _batch(tokenizer, seed), _batch(tokenizer, seed)
    values = critic.values(for_critic)
    for_actor.old_values = values
    stats = policy.update(for_actor, policy.prepare(for_actor))
    return {**stats, **critic.update(for_critic, values)}


def test_a_critic_apart_trains_exactly_as_the_critic_next_to_the_actor(model_dir, tokenizer):
    together = _policy(model_dir, with_critic=True)
    actor, critic = _policy(model_dir, with_critic=False), _critic(model_dir)
    assert actor.critic is None and actor.prepare_passes == together.prepare_passes - 1
    for seed in range(3):  # step 1 trains only the critic (actor_freeze_steps=1)
        batch = _batch(tokenizer, seed)
        expected = together.update(batch, together.prepare(batch))
        got = _apart_step(actor, critic, tokenizer, seed)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7, nan_ok=True), key
        assert got["actor/frozen"] == float(seed == 0)
    for ours, theirs in ((together.model, actor.model), (together.critic.model, critic.model)):
        for (name, a), b in zip(_full(ours).items(), _full(theirs).values(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert critic.updates == 3 and actor.updates == 3


def test_without_values_from_its_critic_the_actor_refuses_to_prepare(model_dir, tokenizer):
    with pytest.raises(ValueError, match="critic's values"):
        _policy(model_dir, with_critic=False).prepare(_batch(tokenizer, 0))


def test_a_critic_apart_resumes_exactly_from_its_state_dict(model_dir, tokenizer):
    first = _critic(model_dir)
    batch = _batch(tokenizer, 0)
    first.update(batch, first.values(batch))
    resumed = _critic(model_dir)
    resumed.load_state_dict(first.state_dict())
    assert resumed.updates == 1

    def step(critic: CriticTrainer, seed: int) -> dict[str, float]:
        batch = _batch(tokenizer, seed)
        return critic.update(batch, critic.values(batch))

    assert [step(resumed, s) for s in (1, 2)] == [step(first, s) for s in (1, 2)]
    for a, b in zip(_full(first.model).values(), _full(resumed.model).values(), strict=True):
        assert torch.equal(a, b)
