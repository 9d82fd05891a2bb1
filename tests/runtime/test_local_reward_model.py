"""A job with a scalar reward model: the RM takes turns with generation and training on the device."""

from __future__ import annotations

import json

import pytest

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.errors import ModelLoadError
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model, write_tiny_reward_model
from gcore_rl.runtime.driver import run_job

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64)


def _cfg(tmp_path, rm_path):
    model = write_tiny_model(tmp_path / "base", SMALL)
    return load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "run.prompts_per_step=4",
        "sampling.n=2", "sampling.max_new_tokens=4", "data.eval_prompts=0", "run.progress=false",
        "runtime.threads_per_process=1", "reward_model.enabled=true", f"reward_model.model_path={rm_path}",
        "reward_model.weight=3.0", "reward_model.transform=raw", "reward.rules.0.weight=0.0",
    ])


def test_reward_model_scores_are_the_reward_on_a_time_shared_device(tmp_path):
    rm = write_tiny_reward_model(tmp_path / "rm", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64, seed=4))
    run_job(_cfg(tmp_path, rm))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["reward/mean"] == pytest.approx(3.0 * line["reward_model/mean_score"], abs=1e-5)
        assert line["util/reward_model/busy_s"] > 0
    events = [json.loads(x) for x in (tmp_path / "run" / "timeline" / "device-0.jsonl").read_text().splitlines()]
    assert {e["role"] for e in events} == {"rollout", "reward_model", "actor", "swap"}


def test_a_causal_lm_as_reward_model_is_refused_before_anything_runs(tmp_path):
    causal = write_tiny_model(tmp_path / "causal", SMALL)
    with pytest.raises(ModelLoadError, match="not a sequence-classification model"):
        run_job(_cfg(tmp_path, causal))
    assert not (tmp_path / "run").exists()
