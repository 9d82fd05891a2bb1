"""Agents that learn (slow: `make test-slow`), each over three seeds:

- a verifiers environment trained through the chat endpoint: the environment (tests/agents/vf_digits.py) asks a
  question, asks again as the user, and rewards the share of digits in the policy's last reply; a tiny random
  model starts near 0.1;
- a textarena game, the environment demo's (`make demo-env`): GuessTheNumber on 1..16 in four guesses, from the
  demo's warm start (65 SFT steps on bisecting traces: it follows the hints in about half of its later guesses
  and one episode in four ends on an invalid guess), played and scored by textarena; GRPO raises the game's
  score by about 0.2 in 30 steps (BENCHMARKS.md, "The textarena demo")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gcore_rl.config import load_job_config
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job
from gcore_rl.training.sft import load_sft_config, run_sft

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE = RECIPES / "grpo_addition.yaml"


def rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_verifiers_environment_trains_through_the_endpoint(tmp_path, seed):
    pytest.importorskip("verifiers.v1")
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
    rewards_ = rewards(tmp_path / "run")
    assert mean(rewards_[-5:]) > mean(rewards_[:5]) + 0.1, rewards_


@pytest.fixture(scope="module")
def guess_warm_start(tmp_path_factory):
    """The environment demo's warm start (recipes/sft_textarena_guess.yaml on the demo's tiny model, seed 0)."""
    pytest.importorskip("textarena")
    root = tmp_path_factory.mktemp("guess")
    model = write_tiny_model(root / "tiny", TinyModelConfig(max_positions=1024))
    run_sft(load_sft_config(RECIPES / "sft_textarena_guess.yaml", [
        f"model.path={model}", f"output_dir={root / 'sft'}", "threads=1", "progress=false"]))
    return root / "sft"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_textarena_game_trains(tmp_path, guess_warm_start, seed):
    cfg = load_job_config(RECIPES / "grpo_textarena_guess.yaml", [
        f"model.path={guess_warm_start}", f"run.output_dir={tmp_path / 'run'}", f"run.seed={seed}",
        "run.progress=false", "runtime.threads_per_process=1"])
    run_job(cfg)
    rewards_ = rewards(tmp_path / "run")
    assert mean(rewards_[-5:]) > mean(rewards_[:5]) + 0.1, rewards_
