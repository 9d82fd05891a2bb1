"""The Ray runtime: clean shutdown on success and on failure (each test starts and stops its own Ray)."""

from __future__ import annotations

import json

import pytest

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.errors import GcoreError
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job

ray = pytest.importorskip("ray")


def _cfg(tmp_path, model, *extra):
    return load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "run.prompts_per_step=4",
        "sampling.n=2", "sampling.max_new_tokens=4", "data.eval_prompts=4", "run.progress=false",
        "runtime.kind=ray", "runtime.controllers=2", "runtime.threads_per_process=1", *extra,
    ])


@pytest.mark.slow
def test_two_ray_controllers_train_export_and_shut_ray_down(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths must resolve in the actors as in the driver
    write_tiny_model("base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    summary = run_job(_cfg(tmp_path, "base"))
    assert summary.steps == 2
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["rollout/logprob_gap_max"] < 1e-4 for line in lines)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert not ray.is_initialized()


@pytest.mark.slow
def test_a_failing_controller_is_reported_and_ray_shuts_down(tmp_path, monkeypatch):
    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    # a reward that fails inside the controllers surfaces as one GcoreError in the driver
    (tmp_path / "flaky.py").write_text("def boom(prompt, completion, **row):\n    raise RuntimeError('judge down')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for the Ray worker processes
    with pytest.raises(GcoreError, match="flaky:boom"):
        run_job(_cfg(tmp_path, model, "reward.rules.0.fn=flaky:boom"))
    assert not ray.is_initialized()
