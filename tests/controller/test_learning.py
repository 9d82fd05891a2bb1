"""In-process GRPO runs on a learnable task: the sampled reward must rise, and a run stops on its measured target."""

from __future__ import annotations

import json

import pytest

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job
from gcore_rl.training.sft import SftConfig, run_sft

ONE_DIGIT = "data.task_options={digits: 1}"


@pytest.fixture(scope="module")
def weak_start(tmp_path_factory):
    """A policy with 15% held-out greedy accuracy on one-digit sums: SFT stopped on that measured criterion.

    Stopping on accuracy rather than on a step count gives the same competence on every machine,
    seed and thread count (how many steps it takes is what varies).
    """
    root = tmp_path_factory.mktemp("learning")
    write_tiny_model(root / "base", TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128))
    run_sft(load_config(SftConfig, None, [
        f"model.path={root / 'base'}", ONE_DIGIT, f"output_dir={root / 'sft'}", "steps=600", "lr=0.003",
        "eval_every=5", "target_accuracy=0.15", "data.eval_prompts=100", "progress=false"]))
    return root / "sft"


def grpo(model, out, *overrides) -> JobConfig:
    return load_config(JobConfig, None, [
        f"model.path={model}", ONE_DIGIT, f"run.output_dir={out}", "run.prompts_per_step=64", "sampling.n=8",
        "sampling.max_new_tokens=4", "train.lr=0.001", "train.micro_batch_size=256", "run.progress=false",
        "run.save_final=false", *overrides])


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_raises_reward_on_one_digit_addition(weak_start, tmp_path):
    """40 GRPO steps with exact-match reward from the weak start: mean reward of the last 8 steps beats the first 8."""
    summary = run_job(grpo(weak_start, tmp_path / "run", "run.steps=40", "run.eval_every=0", "data.eval_prompts=0"))
    rewards = [row["reward/mean"] for row in metrics(tmp_path / "run")]
    assert len(rewards) == 40 and summary.steps == 40
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, (first, last, rewards)


def test_run_ends_at_the_first_evaluation_that_reaches_its_target(weak_start, tmp_path):
    """`run.stop_at_eval_accuracy`: the run ends after the first evaluation at or above the target.

    The weak start already has ~0.15 held-out accuracy, so a target of 0.05 is met at the first evaluation.
    """
    target = 0.05
    summary = run_job(grpo(weak_start, tmp_path / "run", "run.steps=30", "run.eval_every=2", "data.eval_prompts=100",
                           f"run.stop_at_eval_accuracy={target}"))
    rows = metrics(tmp_path / "run")
    evals = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    assert summary.steps == len(rows) == rows[-1]["step"] == 2
    assert evals == [summary.eval_accuracy_after] and evals[-1] >= target
