"""DAPO's overlong shaping wired into the controller: the penalty joins the reward, filtering the loss mask."""

from __future__ import annotations

import pytest
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
SAMPLING = SamplingConfig(n=2, max_new_tokens=2)


class Policy:
    """Answers "5" (1 token, stopped by EOS) and "45" (2 tokens, stopped by the length limit)."""

    def generate_stream(self, prompt_ids, sampling, seed):
        for index, prompt in enumerate(prompt_ids):
            yield [Completion(prompt_index=index, sample_index=k, prompt_ids=prompt, logprobs=[0.0] * len(text),
                              token_ids=TOKENIZER.encode(text, add_special_tokens=False), finish_reason=reason)
                   for k, (text, reason) in enumerate((("5", "stop"), ("45", "length")))]


class Trainer:
    def start_train(self, batch):
        self.batch = batch
        return []


def _context(workers, reward: RewardConfig) -> ControllerContext:
    return ControllerContext(workers=workers, rewards=RuleRewards(reward), tokenizer=TOKENIZER)


def _rollout(reward: RewardConfig):
    layout = plan("colocate", 1, ["actor", "rollout"])
    client = SliceClient([LocalHandle(Policy())], [WorkerSpec(0, 0, ("rollout", "actor"), 0, 1, True, False)], layout)
    rows = [{"prompt": "2+3=", "answer": "5"}]
    waves = WaveSampler(DynamicSamplingConfig(), target_groups=1)
    return rollout_phase(ListedRows(rows), waves, _context(client, reward), SAMPLING, PhaseTimer(),
                         step_seeds(0, 1, 0))


def test_soft_punishment_is_added_to_the_reward():
    out = _rollout(RewardConfig(overlong_buffer=1, overlong_penalty=0.5))
    # buffer starts after 2 - 1 = 1 token: "5" (1 token) gets 1 + 0; "45" (2 tokens, the limit) 0 - 0.5 × 1/1
    assert out.groups.groups[0].rewards == pytest.approx((1.0, -0.5))
    assert out.stats["overlong/mean_penalty"] == pytest.approx(-0.25)
    assert "overlong/mean_penalty" not in _rollout(RewardConfig()).stats


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_filtering_masks_truncated_completions_out_of_the_loss(overlong_filter):
    rollout, trainer = _rollout(RewardConfig()), Trainer()
    _, stats = start_update(rollout, _context(trainer, RewardConfig()), SAMPLING, AlgoConfig(overlong_filter=overlong_filter),
                            trainer_version=0)
    assert trainer.batch.response_mask.sum(dim=-1).tolist() == [1.0, 0.0 if overlong_filter else 2.0]
    assert stats.get("overlong/filtered_samples") == (1.0 if overlong_filter else None)
    assert stats["response/truncated_fraction"] == 0.5
