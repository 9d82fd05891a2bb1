"""A GRPO step through the real command line with every logger and a reward function that hangs in a worker pool."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import NO_STOP, RECIPE, SHORT, gcore_rl

from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.telemetry.metrics import read_metrics

HANGING_REWARD = '''
import time

def hang(prompt, completion, **row):
    time.sleep(60)  # only the pool's timeout ends it
    return 1.0
'''


@pytest.mark.slow
def test_step_completes_with_hanging_rewards_counted_and_every_logger_written(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
                       "WANDB_CACHE_DIR": tmp_path / "wandb-cache", "MLFLOW_ALLOW_FILE_STORE": "true",
                       "MLFLOW_DISABLE_TELEMETRY": "true"}.items():  # no network: W&B offline, no MLflow telemetry
        monkeypatch.setenv(var, str(value))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "hangreward.py").write_text(HANGING_REWARD)
    tiny = write_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    out = tmp_path / "run"
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", "reward.rules.0.fn=hangreward:hang", "reward.accuracy_fn=null",
                    "reward.workers=2", "reward.timeout_s=0.5", "reward.on_timeout=zero",
                    "run.loggers=[jsonl,tensorboard,wandb,mlflow]", "run.steps=1", "data.eval_prompts=0", NO_STOP,
                    "run.save_final=false", f"run.output_dir={out}", *SHORT, cwd=tmp_path, extra_pythonpath=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (record,) = read_metrics(out)
    assert record["reward/timeouts"] == 16.0  # 4 prompts x 4 samples, every call killed at its timeout
    assert record["reward/errors"] == 0.0 and record["reward/mean"] == 0.0

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    numeric = {k for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
    assert set(events.Tags()["scalars"]) == numeric  # the same names as metrics.jsonl
    assert [e.value for e in events.Scalars("reward/timeouts")] == [16.0]
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gcore-rl").experiment_id])
    # the file store writes '/' as '.' (a metric's name is its file's path there)
    assert set(run.data.metrics) == {k.replace("/", ".") for k in numeric}
    assert run.data.metrics["reward.timeouts"] == 16.0
    assert len(list(Path(out / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
