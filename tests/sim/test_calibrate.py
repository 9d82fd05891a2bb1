"""Calibration: constants fitted to telemetry that the cost formulas generated are recovered; run directories are read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gcore_rl.errors import ConfigError
from gcore_rl.sim.calibrate import RunTelemetry, StepSample, calibrate, predict, read_run, resolve_hardware
from gcore_rl.sim.cost import CostConstants
from gcore_rl.sim.models import ModelSpec

POLICY = ModelSpec("policy", params=8.0e5, layers=2, hidden=64, kv_heads=4, head_dim=16, vocab=99, bytes_per_param=4)
JUDGE = ModelSpec("judge", params=3.0e6, layers=6, hidden=64, kv_heads=4, head_dim=16, vocab=99, bytes_per_param=4)
TRUE = CostConstants(decode_mfu=0.1, step_overhead_s=0.004, layer_overhead_s=0.002, prefill_mfu=0.2, logprob_mfu=0.05,
                     train_mfu=0.03, pass_overhead_s=0.02, train_pass_overhead_s=0.05, optimizer_step_s=0.1,
                     sync_overhead_s=0.03, engine_wake_s=0.01)


def _work(step: int) -> dict[str, float]:
    """Work that varies from step to step, as response lengths and batch shapes do."""
    k = 1 + (step * 7) % 5
    return {
        "work/rollout/decode_steps": 6 + k, "work/rollout/tokens": 200 + 30 * k, "work/rollout/prefills": 1 + k % 3,
        "work/rollout/prefill_tokens": 300 + 40 * k,
        "work/judge/decode_steps": 8 + 2 * (k % 2), "work/judge/tokens": 60 + 5 * k, "work/judge/prefills": 2 + k % 2,
        "work/judge/prefill_tokens": 2000 + 150 * k, "work/judge/samples": 32,
        "work/actor/tokens": 3000 + 200 * k, "work/actor/prepare_tokens": 3000 + 200 * k,
        "work/actor/micro_batches": 1 + k % 2, "work/actor/prepare_micro_batches": 1 + (k + 1) % 2,
        "work/actor/optimiser_steps": 1 + (k % 3 == 0),
        "work/sync/bytes": 3.2e6, "work/swap/wakes": 1 + k % 2, "work/swap/sleeps": 1, "work/swap/released_bytes": 3.2e6,
    }


def _telemetry() -> RunTelemetry:
    hw = resolve_hardware("cpu")
    shell = RunTelemetry("synthetic", POLICY, JUDGE, ppo_epochs=1, judge_added_s_per_sample=0.001, samples=[])
    samples = []
    for step in range(2, 16):
        sample = StepSample(step, {}, _work(step))
        seconds = {phase: predict(sample, phase, shell, hw, TRUE)
                   for phase in ("generate", "judge", "prepare", "train", "sync", "swap")}
        samples.append(StepSample(step, seconds, sample.work))
    return dataclasses.replace(shell, samples=samples)


def test_calibration_recovers_the_constants_that_generated_the_telemetry():
    result = calibrate(_telemetry(), resolve_hardware("cpu"))
    assert [p.phase for p in result.phases] == ["generate", "judge", "prepare", "train", "sync", "swap"]
    assert all(p.error < 1e-6 and p.held_out_error < 1e-6 for p in result.phases)
    fitted = result.constants
    for key in ("step_overhead_s", "layer_overhead_s", "pass_overhead_s", "train_pass_overhead_s", "optimizer_step_s",
                "sync_overhead_s", "engine_wake_s", "logprob_mfu", "train_mfu", "prefill_mfu"):
        assert getattr(fitted, key) == pytest.approx(getattr(TRUE, key), rel=1e-4), key
    assert "costs:" in result.constants_yaml() and "| generate |" in result.table()


def test_a_stalled_step_does_not_pull_the_fit():
    telemetry = _telemetry()
    stalled = telemetry.samples[3]
    samples = list(telemetry.samples)
    samples[3] = StepSample(stalled.step, {**stalled.seconds, "train": stalled.seconds["train"] * 8}, stalled.work)
    result = calibrate(dataclasses.replace(telemetry, samples=samples), resolve_hardware("cpu"))
    assert result.constants.train_mfu == pytest.approx(TRUE.train_mfu, rel=1e-3)


def test_read_run_names_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="no config.yaml"):
        read_run(tmp_path)
    (tmp_path / "config.yaml").write_text("model: {path: nowhere}\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (tmp_path / "timeline").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        read_run(tmp_path)
    with pytest.raises(ConfigError, match="--hardware"):
        resolve_hardware("TPU")


def test_cli_calibrates_a_real_run(tmp_path, capsys):
    from gcore_rl.cli import main
    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.runtime.local import run_job

    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    run = tmp_path / "run"
    run_job(load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={run}", "run.steps=5", "run.prompts_per_step=4", "sampling.n=4",
        "sampling.max_new_tokens=6", "data.eval_prompts=0", "run.progress=false", "runtime.threads_per_process=1",
        "run.save_final=false"]))
    capsys.readouterr()
    assert main(["simulate", "--calibrate", str(run), "--constants-out", str(tmp_path / "costs.yaml")]) == 0
    out = capsys.readouterr().out
    for phase in ("generate", "train", "sync", "swap"):
        assert f"| {phase} |" in out
    assert "costs:" in (tmp_path / "costs.yaml").read_text()


def test_cli_refuses_options_that_calibration_would_ignore(tmp_path):
    from gcore_rl.cli import main

    assert main(["simulate", "scenarios/gpus8_judge.yaml", "--calibrate", str(tmp_path)]) == 2
    assert main(["simulate", "scenarios/gpus8_judge.yaml", "--hardware", "H100"]) == 2


def test_calibration_prices_the_update_as_the_simulator_does():
    """The same work and constants give the same prepare and train seconds in `predict` and the simulator."""
    from conftest import make_scenario

    from gcore_rl.sim import phases, resolve_job
    from gcore_rl.sim.simulator import workload_steps
    from gcore_rl.training.shapes import forward_micro_batches, update_shape

    scenario = make_scenario("workload.micro_batch_size=3", "workload.mini_batches=2", "costs.pass_overhead_s=0.2",
                             "costs.train_pass_overhead_s=0.5", "costs.optimizer_step_s=0.7")
    job, work = resolve_job(scenario), workload_steps(scenario)[0]
    devices, tokens = job.slice_devices, float(work.trained_tokens.max())
    prepare, train = phases.update_seconds(job, work, tokens, devices, passes=2)
    rows = -(-work.trained_groups * job.workload.group_size // devices)
    steps, micro = update_shape(rows, 3, 2, job.workload.ppo_epochs)
    sample = StepSample(1, {}, {"work/actor/tokens": tokens / devices, "work/actor/prepare_tokens": 2 * tokens / devices,
                                "work/actor/micro_batches": micro, "work/actor/optimiser_steps": steps,
                                "work/actor/prepare_micro_batches": 2 * forward_micro_batches(rows, 3)})
    run = RunTelemetry("sim", job.policy, None, job.workload.ppo_epochs, 0.0, [])
    assert predict(sample, "prepare", run, job.hardware, job.costs) == pytest.approx(prepare)
    assert predict(sample, "train", run, job.hardware, job.costs) == pytest.approx(train)
    assert micro > 1 and steps == 2
