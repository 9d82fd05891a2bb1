"""Environment jobs through the driver: a textarena game's episodes played in the loop, GRPO and PPO (GAE with the
game's reward at the turn that ended it) training a step, the counts in the step's record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gcore_rl.config import load_job_config
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job

pytest.importorskip("textarena")
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_textarena_guess.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", TinyModelConfig(hidden_size=32, num_layers=2,
                                                                                 intermediate_size=64, max_positions=1024))


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_a_textarena_game_is_played_and_trained_on_in_the_loop(tmp_path, tiny, advantage):
    cfg = load_job_config(RECIPE, [
        f"model.path={tiny}", f"run.output_dir={tmp_path / 'run'}", "run.steps=1", "run.prompts_per_step=2",
        "run.progress=false", "runtime.threads_per_process=1", "sampling.n=4", "engine.backend=move_backend:build",
        f"algo.advantage={advantage}"])
    assert cfg.reward.rules == [] and cfg.reward.accuracy_fn is None  # the game's score is the reward
    run_job(cfg)
    [record] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # random moves in 1..16 with 4 guesses: episodes run several turns, the game's answers inserted between them
    assert record["rollout/turns"] > 1.0 and record["rollout/inserted_tokens"] > 0
    # (a repeated guess is an invalid move, which textarena lets the player retry: not every episode ends in 6)
    assert record["rollout/env_errors"] == 0.0 and record["rollout/episodes_done"] > 0
    assert record["reward/mean"] == pytest.approx(record["rollout/env_reward"]) and record["reward/mean"] > 0
    assert record["rollout/logprob_gap_max"] < 1e-4 and record["grad_norm"] > 0
    if advantage == "gae":
        assert record["critic/returns_mean"] != 0.0
