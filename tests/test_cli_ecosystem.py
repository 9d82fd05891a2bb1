"""One GRPO step through the real command line on each ecosystem piece (the tasks extra): a reasoning-gym task
(as chat rows, with held-out evaluation by its own scorer) and the math-verify reward in the worker pool."""

from __future__ import annotations

import json

import pytest
from cli_helpers import NO_STOP, RECIPE, SHORT, gcore_rl

from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.telemetry.metrics import read_metrics

pytest.importorskip("reasoning_gym")
pytest.importorskip("math_verify")

GYM = ["data.task=reasoning_gym:basic_arithmetic",
       "data.task_options={min_terms: 2, max_terms: 2, max_digits: 1, operators: ['+'], chat: 1}"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("eco") / "tiny",
                            TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))


def test_a_reasoning_gym_task_trains_a_step_scored_by_its_own_scorer(tiny, tmp_path):
    out = tmp_path / "run"
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", *GYM,
                    "run.steps=1", "data.eval_prompts=4", NO_STOP, "run.save_final=false", f"run.output_dir={out}",
                    *SHORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    config = (out / "config.yaml").read_text()
    assert "gcore_rl.rewards.ecosystem:reasoning_gym_score" in config
    (record,) = read_metrics(out)
    assert record["reward/count"] == 16.0 and record["reward/errors"] == 0.0
    assert 0.0 <= record["eval/accuracy"] <= 1.0
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert "Calculate" in sample["prompt"]  # the question, rendered through the chat template


def test_math_verify_scores_a_step_in_the_reward_pool(tiny, tmp_path):
    out = tmp_path / "run"
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", "reward.rules.0.fn=gcore_rl.rewards.ecosystem:math_verify",
                    "reward.accuracy_fn=gcore_rl.rewards.ecosystem:math_verify", "reward.workers=1", "reward.timeout_s=30",
                    "reward.on_timeout=zero", "run.steps=1", "data.eval_prompts=0", NO_STOP, "run.save_final=false",
                    f"run.output_dir={out}", *SHORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (record,) = read_metrics(out)
    assert record["reward/count"] == 16.0 and record["reward/errors"] == 0.0 and record["reward/timeouts"] == 0.0
