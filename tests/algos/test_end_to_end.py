"""Every registry entry drives a real actor update: a few steps of the tiny model on a fixed batch on CPU.

Per estimator (with the PPO clip loss) and per loss (with GRPO advantages): the loss stays finite, and one
update raises the log-probability of the completion with the highest advantage.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.registry import ADVANTAGES, POLICY_LOSSES, AdvantageInputs, compute_advantages
from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from gcore_rl.records import Completion, TokenBatch, build_token_batch
from gcore_rl.training.actor import Actor, TrainConfig

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
GROUP = 3
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 1.0])  # 2 prompts x 3 completions
GREEDY = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5, 0.5])  # ReMax: each prompt's greedy completion's reward, per row
# estimators computed on the trainer (GAE, from the critic's values) have their end-to-end test in tests/training/test_critic.py
WIRED = [name for name, spec in ADVANTAGES.items() if spec.unavailable is None and not spec.on_trainer]
CASES = ([(name, "ppo_clip") for name in WIRED] + [("grpo", name) for name in POLICY_LOSSES if name != "ppo_clip"])


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _batch(tokenizer) -> TokenBatch:
    gen = torch.Generator().manual_seed(0)
    completions = []
    for row in range(REWARDS.shape[0]):
        prompt = tokenizer.encode(f"{row // GROUP + 2}+{row // GROUP + 5}=", add_special_tokens=False)
        tokens = torch.randint(3, len(tokenizer), (3 + row % 2,), generator=gen).tolist()
        completions.append(Completion(row // GROUP, prompt, tokens, [0.0] * len(tokens), "length", sample_index=row % GROUP))
    return build_token_batch(completions, tokenizer.pad_token_id)


def _sequence_logprobs(actor: Actor, batch: TokenBatch) -> torch.Tensor:
    return (actor.compute_logprobs(batch) * batch.response_mask).sum(dim=-1)


@pytest.mark.parametrize(("advantage", "policy_loss"), CASES)
def test_one_update_raises_the_best_completion(tokenizer, advantage, policy_loss):
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_tiny_model(replace(SMALL, seed=0), len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
        aggregation = "seq_mean_token_mean" if policy_loss == "gspo" else "token_mean"
        algo = AlgoConfig(advantage=advantage, policy_loss=policy_loss, loss_aggregation=aggregation)
        algo.validate()
        actor = Actor(model, TrainConfig(lr=1e-2, grad_clip=0.0), algo, temperature=1.0, device=CPU)
        batch = _batch(tokenizer)
        advantages = compute_advantages(algo, AdvantageInputs(REWARDS, GROUP, batch.response_mask, greedy_rewards=GREEDY))
        batch.advantages = advantages
        per_row = advantages if advantages.dim() == 1 else (advantages * batch.response_mask).sum(-1)
        best = int(per_row.argmax())
        before = _sequence_logprobs(actor, batch)[best]
        losses = [actor.update(batch)["pg_loss"]]
        after_one = _sequence_logprobs(actor, batch)[best]
        losses += [actor.update(batch)["pg_loss"] for _ in range(2)]
        assert all(math.isfinite(loss) for loss in losses), losses
        assert after_one > before, (advantage, policy_loss, float(before), float(after_one))
    finally:
        torch.set_num_threads(threads)
