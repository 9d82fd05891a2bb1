"""Agents that learn (slow: `make test-slow`): a verifiers environment trained through the chat endpoint raises its
reward over three seeds. The environment (tests/agents/vf_digits.py) asks a question, asks again as the user, and
rewards the share of digits in the policy's last reply; a tiny random model starts near 0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gcore_rl.config import load_job_config
from gcore_rl.models.tiny import write_tiny_model
from gcore_rl.runtime.driver import run_job

pytest.importorskip("verifiers.v1")
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_addition.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_verifiers_environment_trains_through_the_endpoint(tmp_path, seed):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"task {i}", "env": {"task": i % 4}}) + "\n" for i in range(64)))
    model = write_tiny_model(tmp_path / "tiny")
    cfg = load_job_config(RECIPE, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", f"run.seed={seed}", "run.steps=30",
        "run.prompts_per_step=4", "sampling.n=8", "sampling.max_new_tokens=32", "run.progress=false",
        "data.task=null", f"data.path={rows}", "data.answer_field=null", "data.eval_prompts=0", "run.eval_every=0",
        "run.stop_at_eval_accuracy=0", "reward.rules=[]", "reward.accuracy_fn=null",
        "rollout.function=gcore_rl.agents.agent_loop:agent_loop",
        "rollout.options={agent: gcore_rl.agents.verifiers_env:run_episode, "
        "agent_options: {env: 'vf_digits:make_env', max_tokens: 8}}"])
    run_job(cfg)
    rewards = [json.loads(line)["reward/mean"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards
