"""An environment's per-turn rewards in the controller: they join each sample's reward, group estimators see the
sum, and GAE gets them at their turns' tokens with only the rest of the reward on the last token."""

from __future__ import annotations

import pytest
import torch
from listed_rows import ListedRows

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.dynamic_sampling import DynamicSamplingConfig, WaveSampler
from gcore_rl.controller.handles import LocalHandle
from gcore_rl.controller.program import ControllerContext, rollout_phase, start_update
from gcore_rl.controller.seeds import step_seeds
from gcore_rl.controller.slice import SliceClient
from gcore_rl.models.tiny import build_char_tokenizer
from gcore_rl.placement.plan import WorkerSpec, plan
from gcore_rl.records import Completion
from gcore_rl.rewards.rule import RewardConfig, RuleRewards
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.telemetry.metrics import PhaseTimer

TOKENIZER = build_char_tokenizer()
SAMPLING = SamplingConfig(n=2, max_new_tokens=8)
TURNS = {0: [(0, 0.5), (3, 0.25)], 1: None}  # sample 0: two rewarded turns ("5", then "5" after 2 inserted ids)


class Policy:
    """Sample 0 is a two-turn episode "5" + 2 inserted ids + "5" rewarded 0.5 and 0.25 by its environment;
    sample 1 a single turn "4" the environment never rewarded."""

    def generate_stream(self, prompt_ids, sampling, seed):
        five, four = (TOKENIZER.encode(t, add_special_tokens=False) for t in ("5", "4"))
        for index, prompt in enumerate(prompt_ids):
            episode = Completion(prompt_index=index, sample_index=0, prompt_ids=prompt, token_ids=five + [7, 8] + five,
                                 logprobs=[-0.1, 0.0, 0.0, -0.1], finish_reason="stop", loss_mask=[1, 0, 0, 1],
                                 turn_rewards=TURNS[0])
            single = Completion(prompt_index=index, sample_index=1, prompt_ids=prompt, token_ids=four, logprobs=[-0.1],
                                finish_reason="stop")
            yield [episode, single]


class Trainer:
    def start_train(self, batch):
        self.batch = batch
        return []


def _context(workers) -> ControllerContext:
    return ControllerContext(workers=workers, rewards=RuleRewards(RewardConfig()), tokenizer=TOKENIZER)


def _rollout():
    layout = plan("colocate", 1, ["actor", "rollout"])
    client = SliceClient([LocalHandle(Policy())], [WorkerSpec(0, 0, ("rollout", "actor"), 0, 1, True, False)], layout)
    waves = WaveSampler(DynamicSamplingConfig(), target_groups=1)
    return rollout_phase(ListedRows([{"prompt": "2+3=", "answer": "5"}]), waves, _context(client), SAMPLING,
                         PhaseTimer(), step_seeds(0, 1, 0))


def test_the_environments_rewards_join_the_samples_reward():
    out = _rollout()
    # exact match reads the final turn: "5" scores 1, "4" scores 0; the environment adds 0.75 to sample 0
    assert out.groups.groups[0].rewards == pytest.approx((1.75, 0.0))


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_group_estimators_see_the_sum_and_gae_each_turns_reward_at_its_token(advantage):
    trainer = Trainer()
    start_update(_rollout(), _context(trainer), SAMPLING, AlgoConfig(advantage=advantage), trainer_version=0)
    batch = trainer.batch
    if advantage == "grpo":
        assert batch.turn_rewards is None and batch.rewards is None
        assert batch.advantages.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)  # (1.75, 0) normalised in the group
        return
    start = batch.input_ids.shape[1] - 4  # completions start at the same column
    assert batch.rewards.tolist() == pytest.approx([1.0, 0.0])  # the rule's part, for the last token
    expected = torch.zeros_like(batch.turn_rewards)
    expected[0, start], expected[0, start + 3] = 0.5, 0.25
    torch.testing.assert_close(batch.turn_rewards, expected)
