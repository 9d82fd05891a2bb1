"""The supervised warm start: it stops on held-out accuracy, or holds its last step to it, and fails loudly at its cap."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers import AutoModelForCausalLM

from gcore_rl.configlib import load_config
from gcore_rl.errors import ConfigError
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.training.optim_step import rate_factor
from gcore_rl.training.sft import SftConfig, SftTargetNotReached, run_sft

# one-digit sums: a tiny model passes 5% held-out accuracy within a few dozen steps
TASK = ["data.task_options={digits: 1}", "data.eval_prompts=64", "eval_every=5", "lr=0.003", "progress=false",
        "threads=1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("sft") / "base",
                            TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))


def sft(base, out, *overrides):
    return load_config(SftConfig, None, [f"model.path={base}", f"output_dir={out}", *TASK, *overrides])


def evaluations(out) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["sft/eval_accuracy"]) for row in rows if "sft/eval_accuracy" in row]


def test_stops_at_the_first_evaluation_that_reaches_the_target(base, tmp_path):
    result = run_sft(sft(base, tmp_path / "out", "steps=400", "target_accuracy=0.05"))
    evals = evaluations(tmp_path / "out")
    assert result.target_reached is True
    assert evals[-1] == (result.steps, result.eval_accuracy)  # the run ended at an evaluation...
    assert result.eval_accuracy >= 0.05  # ...that met the target...
    assert all(accuracy < 0.05 for _, accuracy in evals[:-1])  # ...and at the first one that did
    assert result.eval_accuracy_before is not None and result.eval_accuracy_before < 0.05  # random init
    assert [step for step, _ in evals] == list(range(5, result.steps + 1, 5))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True) is not None


def test_hitting_the_cap_saves_the_model_and_fails_naming_target_and_cap(base, tmp_path):
    with pytest.raises(SftTargetNotReached, match=r"cap of 10 steps.*below target_accuracy=1\.0") as raised:
        run_sft(sft(base, tmp_path / "out", "steps=10", "target_accuracy=1.0"))
    assert str(tmp_path / "out") in str(raised.value)
    assert len(evaluations(tmp_path / "out")) == 2
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert yaml.safe_load((tmp_path / "out" / "sft_config.yaml").read_text())["steps"] == 10  # and its settings


def test_without_stopping_at_the_target_every_step_runs_and_the_last_evaluation_is_held_to_it(base, tmp_path):
    result = run_sft(sft(base, tmp_path / "out", "steps=62", "target_accuracy=0.05", "stop_at_target=false",
                         "lr_schedule=cosine"))
    evals = evaluations(tmp_path / "out")
    assert result.steps == 62 and evals[-1] == (62, result.eval_accuracy)  # evaluated at the last step, off the grid
    assert [step for step, _ in evals] == [*range(5, 61, 5), 62]
    assert result.target_reached is True and result.eval_accuracy >= 0.05
    assert any(accuracy >= 0.05 for _, accuracy in evals[:-1])  # it ran on past an evaluation that met the target


def test_a_missed_target_at_the_last_step_fails_with_the_model_saved(base, tmp_path):
    with pytest.raises(SftTargetNotReached, match=r"cap of 12 steps.*below target_accuracy=1\.0"):
        run_sft(sft(base, tmp_path / "out", "steps=12", "target_accuracy=1.0", "stop_at_target=false"))
    assert [step for step, _ in evaluations(tmp_path / "out")] == [5, 10, 12]
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_the_rate_follows_the_schedule(base, tmp_path):
    run_sft(sft(base, tmp_path / "out", "steps=30", "eval_every=0", "warmup_steps=10", "lr_schedule=linear"))
    rows = [json.loads(line) for line in (tmp_path / "out" / "sft_metrics.jsonl").read_text().splitlines()]
    assert [row["lr"] for row in rows] == pytest.approx([0.003 * rate_factor(s + 1, 10, 30, "linear") for s in range(30)])
    assert rows[-1]["lr"] == 0.0


def test_without_a_target_every_step_runs(base, tmp_path):
    result = run_sft(sft(base, tmp_path / "out", "steps=7", "eval_every=0", "loggers=[tensorboard]"))
    assert (result.steps, result.target_reached, result.eval_accuracy) == (7, None, None)
    assert len((tmp_path / "out" / "sft_metrics.jsonl").read_text().splitlines()) == 7  # always written
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))  # and the loggers asked for


@pytest.mark.parametrize("overrides, key", [
    (["target_accuracy=0.5", "eval_every=0"], "target_accuracy"),
    (["target_accuracy=0.5", "data.eval_prompts=0"], "target_accuracy"),
    (["target_accuracy=1.5"], "target_accuracy"),
    (["eval_every=-1"], "eval_every"),
    (["accuracy_fn=no_colon"], "accuracy_fn"),
    (["lr_schedule=step"], "lr_schedule"),
])
def test_bad_stop_settings_name_the_key(base, tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=f"`{key}`"):
        sft(base, tmp_path / "out", *overrides)
