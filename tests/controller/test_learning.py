"""An in-process GRPO run on a learnable task: the sampled reward must rise."""

from __future__ import annotations

import json

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.local import run_job
from gcore_rl.training.sft import SftConfig, run_sft


def test_grpo_raises_reward_on_one_digit_addition(tmp_path):
    """Weak SFT start (~15% sampled accuracy) → 40 GRPO steps with exact-match reward.

    Measured on 2 CPU cores: mean reward of the first 8 steps ≈ 0.19, of the last 8 ≈ 0.28.
    """
    write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128))
    sft = load_config(SftConfig, None, [f"model.path={tmp_path / 'base'}", "data.task_options={digits: 1}",
                                         f"output_dir={tmp_path / 'sft'}", "steps=60", "lr=0.003", "progress=false"])
    run_sft(sft)
    job = load_config(JobConfig, None, [
        f"model.path={tmp_path / 'sft'}", "data.task_options={digits: 1}", f"run.output_dir={tmp_path / 'run'}",
        "run.steps=40", "run.prompts_per_step=64", "sampling.n=8", "sampling.max_new_tokens=4",
        "run.eval_every=0", "data.eval_prompts=0", "train.lr=0.001", "train.micro_batch_size=256",
        "run.progress=false", "run.save_final=false",
    ])
    summary = run_job(job)
    rewards = [json.loads(line)["reward/mean"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 40 and summary.steps == 40
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, (first, last, rewards)
