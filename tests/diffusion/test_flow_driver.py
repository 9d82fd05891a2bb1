"""A diffusion job goes through the language jobs' driver and runtimes (`runtime/kinds.py`): the run folder gets the
summary, the environment record and the run report; two local controller processes killed in training are
restarted from the newest checkpoint, recording what the uninterrupted job recorded; a hung one is seen by the
watchdog, which has every process write its stacks."""

from __future__ import annotations

import json
import sys

import pytest
from cli_helpers import REPO, gcore_rl, terminate_after

from gcore_rl.checkpoint.manifest import verify
from gcore_rl.configlib import load_config
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.faults import ENV as FAULT_ENV
from gcore_rl.runtime.driver import run_job
from gcore_rl.runtime.healing import DEVICE_RESTARTS_FILE, RESTARTS_FILE, STACKS_DIR
from gcore_rl.runtime.kinds import FLOW, LANGUAGE, kind_of, policy_kind

RECIPE = REPO / "recipes" / "flow_grpo_shapes.yaml"
UNTIMED = ("time", "throughput/", "util/", "memory/")
"""Metrics that measure the machine rather than the run (left out of the comparison)."""


def _overrides(tmp_path, models, name: str, *extra: str) -> list[str]:
    return [f"model.path={models['policy']}", f"run.output_dir={tmp_path / name}", "run.steps=4", "run.eval_every=2",
            "run.progress=false", "run.stop_at_eval_reward=0", "run.save_final=false", "data.eval_prompts=2",
            "sampling.eval_steps=2", "sampling.steps=3", "sampling.resolution=8", "sampling.n=2", "sampling.batch_size=4",
            "run.prompts_per_step=4", "runtime.threads_per_process=1", *extra]


def _job(tmp_path, models, name: str, *extra: str) -> FlowGrpoJobConfig:
    return load_config(FlowGrpoJobConfig, RECIPE, _overrides(tmp_path, models, name, *extra))


def _records(run) -> list[dict]:
    return [{key: value for key, value in json.loads(line).items() if not key.startswith(UNTIMED)}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_diffusion_job_is_of_the_flow_kind_and_a_language_job_of_the_language_kind(models):
    assert kind_of(load_config(FlowGrpoJobConfig, RECIPE, [f"model.path={models['policy']}"])) is FLOW
    from gcore_rl.config import JobConfig

    assert kind_of(JobConfig()) is LANGUAGE and policy_kind("flow_grpo") is FLOW


def test_a_diffusion_run_folder_has_the_summary_the_environment_and_the_report(tmp_path, models, capsys):
    """A threshold no update meets (`run.health.max_approx_kl=0`) flags every step: warned of once on the console,
    listed in the report, as for a language run."""
    summary = run_job(_job(tmp_path, models, "run", "run.steps=2", "run.health.max_approx_kl=0"))
    run = tmp_path / "run"
    assert summary.steps == 2
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert "torch" in json.loads((run / "environment.json").read_text())["packages"]
    report = (run / "report.html").read_text()
    assert "reward/mean" in report and "flow_grpo" in report  # its curves and its config
    assert "Unhealthy steps (2)" in report and "held-out reward, before" in report
    assert capsys.readouterr().err.count("warning: unhealthy update") == 1  # the first of its kind only


def test_two_diffusion_controllers_killed_in_training_restart_from_the_checkpoint(tmp_path, models, monkeypatch, capsys):
    """One of two local controller processes is SIGKILLed in step 4's training (the fault fires once per job), after
    the save of step 2 was completed (in step 3): the job resumes from that save and records what the uninterrupted
    job did."""
    overrides = ("runtime.controllers=2", "run.checkpoint_every=2", "run.max_restarts=1")
    run_job(_job(tmp_path, models, "uninterrupted", *overrides))
    expected = _records(tmp_path / "uninterrupted")
    assert len({line["pg_loss"] for line in expected}) > 1, "the job must train, or equality proves nothing"
    monkeypatch.setenv(FAULT_ENV, "train:4")
    capsys.readouterr()
    summary = run_job(_job(tmp_path, models, "killed", *overrides))
    out = tmp_path / "killed"
    assert summary.steps == 4 and _records(out) == expected
    restarts = [json.loads(line) for line in (out / RESTARTS_FILE).read_text().splitlines()]
    assert [r["restart"] for r in restarts] == [1] and "died" in restarts[0]["cause"]
    printed = capsys.readouterr().out
    assert "restart 1 of 1" in printed and "continuing from" in printed and "step-00000002" in printed


@pytest.mark.slow
def test_a_hung_diffusion_job_dumps_every_stack_and_restarts(tmp_path, models, monkeypatch):
    """A controller process stops for good in step 2's training; the driver's watchdog sees no device finish a phase
    for `runtime.phase_timeout_s`, every process writes its stacks, and the job restarts and completes."""
    out = tmp_path / "hung"
    monkeypatch.setenv(FAULT_ENV, "hang-train:2")
    summary = run_job(_job(tmp_path, models, "hung", "runtime.controllers=2", "run.max_restarts=1",
                           "runtime.phase_timeout_s=10"))
    assert summary.steps == 4 and len(_records(out)) == 4
    restarts = [json.loads(line) for line in (out / RESTARTS_FILE).read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["cause"].startswith("hang: no progress")
    stacks = {path.stem: path.read_text() for path in (out / STACKS_DIR).glob("*.txt")}
    assert set(stacks) == {"controller-0", "controller-1"}
    assert sum("maybe_fail" in text for text in stacks.values()) == 1  # the hung one, in the fault point


def _rows_drawn(run) -> dict[int, list[int]]:
    """The global prompt rows each step drew, over all controllers (`prompts/controller-<k>.jsonl`)."""
    drawn: dict[int, list[int]] = {}
    for path in sorted((run / "prompts").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            drawn.setdefault(entry["step"], []).extend(entry["rows"])
    return drawn


def test_a_diffusion_job_resumes_on_another_number_of_controllers(tmp_path, models):
    """Two local controllers save at step 2; resumed on one, the job takes the trainers' state (resharded) and goes on
    with the data epoch's rows that neither controller drew: the shapes task has 12 rows, steps 1-2 drew 8 (2 per
    controller and step), step 3 draws the other 4, and only then a new epoch begins."""
    run_job(_job(tmp_path, models, "run", "runtime.controllers=2", "run.steps=2", "run.checkpoint_every=2"))
    summary = run_job(_job(tmp_path, models, "run", "runtime.controllers=1", "run.resume=auto"))
    run = tmp_path / "run"
    assert summary.steps == 4 and [line["step"] for line in _records(run)] == [1, 2, 3, 4]
    drawn = _rows_drawn(run)
    before = drawn[1] + drawn[2]
    assert len(set(before)) == 8 and sorted(drawn[3]) == sorted(set(range(12)) - set(before))


def test_sigterm_stops_a_diffusion_job_saved_at_a_step_boundary_and_it_resumes_to_the_straight_record(tmp_path, models):
    """SIGTERM after step 2's record: the job stops at the step boundary with a complete checkpoint of that step and exits
    143; `run.resume=auto` continues to what the uninterrupted job recorded."""
    run_job(_job(tmp_path, models, "straight"))
    args = [sys.executable, "-m", "gcore_rl.cli", "train", str(RECIPE), *_overrides(tmp_path, models, "run")]
    stopped = terminate_after(args, tmp_path / "run", 2)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "preempted:" in stopped.stderr and "run.resume=auto" in stopped.stderr and "Traceback" not in stopped.stderr
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved and not saved[-1].name.endswith(".incomplete")
    verify(saved[-1])
    resumed = gcore_rl(*args[3:], "run.resume=auto", cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _records(tmp_path / "run") == _records(tmp_path / "straight")


@pytest.mark.slow
def test_a_sampling_device_killed_in_the_rollout_is_revived_in_place_and_the_run_records_the_same(ray_instance, tmp_path,
                                                                                                  models, monkeypatch):
    """Ray `disaggregated`, one slice of 2 devices: device 1 samples and holds no trainer shard, so when it dies in its
    sampling the slice revives it in place (`SliceClient`, as for a language job) with the weights last published to
    it, and it samples its prompts again with the same seed: the run records what the uninterrupted run did, and the
    job is not restarted."""
    overrides = ("runtime.kind=ray", "runtime.devices_per_controller=2", "placement.strategy=disaggregated",
                 "run.max_restarts=1")
    run_job(_job(tmp_path, models, "straight", *overrides))
    monkeypatch.setenv(FAULT_ENV, "generate:2")
    run_job(_job(tmp_path, models, "killed", *overrides))
    out = tmp_path / "killed"

    def untimed(run) -> list[dict]:  # the revived device sampled one chunk twice: its work counts differ
        return [{k: v for k, v in line.items() if not k.startswith("work/")} for line in _records(run)]

    assert untimed(out) == untimed(tmp_path / "straight")
    restarted = [json.loads(line) for line in (out / DEVICE_RESTARTS_FILE).read_text().splitlines()]
    assert [(r["controller"], r["device"]) for r in restarted] == [(0, 1)]
    assert not (out / RESTARTS_FILE).exists()
