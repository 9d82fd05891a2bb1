"""Every placement strategy × step schedule × (fresh, resumed), in this process, on fake workers
(tests/controller/fake_slice.py): the controller's loop, schedules, sampler, rewards, checkpoints and
`SliceClient` are the real ones; only the device workers are fakes that count what they do.

Schedules: `synchronous` (each step rolls out, then trains: every strategy but `disaggregated`),
`one-step-off` (`disaggregated`, k = 1: the next rollout runs in the main thread during the update) and
`producer` (`disaggregated`, k = 2: rollouts made ahead in a thread). For each cell a run saved at step 2
and resumed with `run.resume=auto` gives the uninterrupted run's records and the same events on the
workers, and each step's samples were generated with the weights the schedule says: version
max(0, s - 1 - k), k = 0 for the synchronous schedule. What only Ray shows (actors, the object store,
placement groups) stays in tests/runtime.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from fake_slice import FakeWorker, FakeWorld, run_fake

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.controller.worker_api import WorkerAPI
from gcore_rl.models.tiny import write_tiny_model

STEPS = 4
UNTIMED = ("time", "throughput/", "util/", "memory/")

CELLS = {  # (strategy, staleness bound k): the schedule follows from them
    "colocate": ("colocate", 1, 2),
    "partial": ("partial", 1, 2),
    "interleave": ("interleave", 1, 2),
    "dynamic": ("dynamic", 1, 3),
    "disaggregated-one-step-off": ("disaggregated", 1, 2),
    "disaggregated-producer": ("disaggregated", 2, 2),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fake-slice") / "tiny")


def job(tiny: Path, out: Path, cell: str, steps: int = STEPS, *extra: str) -> JobConfig:
    strategy, k, devices = CELLS[cell]
    return load_config(JobConfig, None, [
        f"model.path={tiny}", f"run.output_dir={out}", f"run.steps={steps}", "run.prompts_per_step=6", "sampling.n=2",
        "sampling.max_new_tokens=3", "data.eval_prompts=4", "run.eval_every=2", "run.progress=false",
        "run.save_final=false", "run.checkpoint_every=2", "reward.rules.0.fn=fake_rewards:ones_share",
        "judge.enabled=true", f"judge.model_path={tiny}", "judge.weight=0.5", "algo.kl_coef=0.01",
        "runtime.kind=ray", f"runtime.devices_per_controller={devices}", f"placement.strategy={strategy}", f"placement.max_staleness={k}",
        *extra])


def records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(UNTIMED)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def generated_versions(events: list[tuple]) -> dict[int, set[int]]:
    """The weights versions the training rollouts of each step were generated with (greedy evaluations
    are made with the trained policy and are not counted)."""
    out: dict[int, set[int]] = {}
    for _device, kind, *rest in events:
        if kind == "train":
            step, _, staleness = rest
            out.setdefault(step, set()).update(step - 1 - s for s in staleness)
    return out


@pytest.mark.parametrize("cell", list(CELLS))
def test_each_step_trains_on_the_weights_the_schedule_says(tiny, tmp_path, cell):
    _, world = run_fake(job(tiny, tmp_path / "run", cell))
    k = 0 if CELLS[cell][0] != "disaggregated" else CELLS[cell][1]
    assert generated_versions(world.events) == {s: {max(0, s - 1 - k)} for s in range(1, STEPS + 1)}
    lines = records(tmp_path / "run")
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert [line["rollout/staleness_max"] for line in lines] == [float(min(s - 1, k)) for s in range(1, STEPS + 1)]
    assert world.skill > FakeWorld().skill  # the updates moved the fake policy towards its reward


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_run_resumed_from_its_checkpoint_gives_the_uninterrupted_record(tiny, tmp_path, cell):
    _, whole = run_fake(job(tiny, tmp_path / "whole", cell))
    run_fake(job(tiny, tmp_path / "part", cell, 2))
    _, resumed = run_fake(job(tiny, tmp_path / "part", cell, STEPS, "run.resume=auto"))
    assert records(tmp_path / "part") == records(tmp_path / "whole")
    assert trained_after(resumed.events, 2) == trained_after(whole.events, 2)
    assert resumed.skill == whole.skill


def trained_after(events: list[tuple], step: int) -> list[tuple]:
    """The trainers' events of the steps after `step`: (device, "train", step, rows, each row's staleness)."""
    return [e for e in events if e[1] == "train" and e[2] > step]


def test_the_fake_worker_has_every_worker_api_method_with_its_parameters():
    for name, declared in vars(WorkerAPI).items():
        if inspect.isfunction(declared) and not name.startswith("_"):
            faked = inspect.signature(getattr(FakeWorker, name)).parameters
            assert list(faked) == list(inspect.signature(declared).parameters), name


def test_the_dynamic_cell_moves_a_device_and_its_resume_keeps_the_plan(tiny, tmp_path):
    """The resume cell of `dynamic` is only worth having if the split moved before the checkpoint."""
    run_fake(job(tiny, tmp_path / "run", "dynamic", 2))
    lines = records(tmp_path / "run")
    assert lines[0]["placement/next_rollout_devices"] != lines[0]["placement/rollout_devices"]
    assert lines[1]["placement/rollout_devices"] == lines[0]["placement/next_rollout_devices"]
