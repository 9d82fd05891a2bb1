"""A project-generated chat-format JSONL (`gcore-rl write-task addition_chat`) trains through SFT and GRPO."""

from __future__ import annotations

import json

import pytest

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.data.tasks import write_task_jsonl
from gcore_rl.models.loading import load_tokenizer
from gcore_rl.models.tiny import TINY_CHAT_TEMPLATE, TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job
from gcore_rl.training.sft import SftConfig, run_sft

ONE_DIGIT = "data.task_options={digits: 1}"


def sft(model, out, *overrides) -> SftConfig:
    return load_config(SftConfig, None, [f"model.path={model}", f"output_dir={out}", "lr=0.003", "progress=false",
                                         "threads=1", *overrides])


def grpo(model, chat_file, out, *overrides) -> JobConfig:
    return load_config(JobConfig, None, [
        f"model.path={model}", "data.task=null", f"data.path={chat_file}", f"run.output_dir={out}",
        "run.prompts_per_step=64", "sampling.n=8", "sampling.max_new_tokens=4", "train.lr=0.001",
        "train.micro_batch_size=256", "run.progress=false", "run.save_final=false", "run.eval_every=0",
        "runtime.threads_per_process=1", *overrides])


def rewards(out) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_chat_jsonl_runs_through_sft_then_grpo(tmp_path):
    """End to end on chat rows: SFT on the file's final assistant turns, then GRPO prompted with the turns before."""
    chat_file = write_task_jsonl("addition_chat", tmp_path / "chat.jsonl", 64, seed=1, digits=1)
    write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    result = run_sft(sft(tmp_path / "base", tmp_path / "sft", "data.task=null", f"data.path={chat_file}", "steps=2",
                         "batch_size=8", "warmup_steps=1"))
    assert result.steps == 2 and result.loss > 0
    assert load_tokenizer(str(tmp_path / "sft")).chat_template == TINY_CHAT_TEMPLATE
    summary = run_job(grpo(tmp_path / "sft", chat_file, tmp_path / "run", "run.steps=2", "run.prompts_per_step=4",
                           "sampling.n=4", "run.stop_at_eval_accuracy=0"))
    assert summary.steps == 2
    assert all(0.0 <= reward <= 1.0 for reward in rewards(tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_raises_reward_on_chat_rows(tmp_path, seed):
    """From a weak start (SFT on addition_chat rows stopped at 15% held-out greedy accuracy, a measured criterion
    as in tests/controller/test_learning.py), 40 GRPO steps on the chat JSONL: the last 8 steps' mean reward
    beats the first 8's by 0.05, for three seeds (model initialisation, SFT and GRPO sampling)."""
    chat_file = write_task_jsonl("addition_chat", tmp_path / "chat.jsonl", 2000, seed=seed, digits=1)
    write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=seed))
    run_sft(sft(tmp_path / "base", tmp_path / "sft", "data.task=addition_chat", ONE_DIGIT, "steps=600",
                "eval_every=5", "target_accuracy=0.15", "data.eval_prompts=100", f"seed={seed}"))
    run_job(grpo(tmp_path / "sft", chat_file, tmp_path / "run", "run.steps=40", "run.stop_at_eval_accuracy=0",
                 f"run.seed={seed}"))
    reward = rewards(tmp_path / "run")
    first, last = sum(reward[:8]) / 8, sum(reward[-8:]) / 8
    assert len(reward) == 40 and last > first + 0.05, (first, last, reward)
