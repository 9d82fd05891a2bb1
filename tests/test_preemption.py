"""SIGTERM, as a scheduler preempts a job: the run stops at the next step boundary with a complete checkpoint
and exits 143, and `run.resume=auto` continues to the record an uninterrupted run writes; when the grace
period runs out first, it exits 143 with no new checkpoint.

The signal goes to a real `gcore-rl train` process at a moment drawn from a seed (after the record of a
chosen step appears), to one controller and to a job of two spawned controllers (the driver forwards it).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from cli_helpers import NO_STOP, RECIPE, REPO, SHORT, gcore_rl, init_tiny, terminate_after

from gcore_rl.checkpoint.manifest import verify

STEPS = 4
UNTIMED = ("time", "throughput/", "util/", "memory/")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("preempt"))


def command(tiny: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gcore_rl.cli", "train", str(RECIPE), f"model.path={tiny}", f"run.output_dir={out}",
            f"run.steps={STEPS}", "run.checkpoint_every=3", "data.eval_prompts=0", NO_STOP, "run.save_final=false",
            *SHORT, *extra]


def records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(UNTIMED)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    """The uninterrupted run's records, by the job's runtime options (each run once)."""
    runs: dict[tuple[str, ...], list[dict]] = {}

    def records_of(runtime: tuple[str, ...]) -> list[dict]:
        if runtime not in runs:
            out = tmp_path_factory.mktemp("straight") / "run"
            done = gcore_rl(*command(tiny, out, *runtime)[3:], cwd=REPO)  # forked from a warm server: no imports
            assert done.returncode == 0, done.stderr
            runs[runtime] = records(out)
        return runs[runtime]
    return records_of


RUNTIMES = {
    "one-controller": ("runtime.controllers=1",),
    "two-controllers": ("runtime.controllers=2",),  # the driver passes SIGTERM on to the spawned controllers
    # by file; each generate call made at least 0.5 s longer, so the request is seen while the run has steps left
    "ray": ("runtime.kind=ray", "runtime.devices_per_controller=2", "placement.strategy=disaggregated",
            "engine.added_seconds_tail=0.5"),
}


@pytest.mark.parametrize("runtime", [
    "one-controller", pytest.param("two-controllers", marks=pytest.mark.slow), pytest.param("ray", marks=pytest.mark.slow)])
def test_sigterm_saves_at_the_step_boundary_exits_143_and_resumes_to_the_straight_record(tiny, tmp_path, straight,
                                                                                          runtime):
    at = random.Random(runtime).choice([1, 2])  # a seeded moment: after the record of step 1 or 2
    out = tmp_path / "run"
    args = command(tiny, out, *RUNTIMES[runtime])
    stopped = terminate_after(args, out, at)
    assert stopped.returncode == 143, stopped.stderr
    assert "preempted:" in stopped.stderr and "run.resume=auto" in stopped.stderr and "Traceback" not in stopped.stderr
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved and not saved[-1].name.endswith(".incomplete")
    verify(saved[-1])
    resumed = gcore_rl(*args[3:], "run.resume=auto", cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr
    assert records(out) == straight(RUNTIMES[runtime])


@pytest.mark.slow
def test_a_grace_period_that_runs_out_exits_143_without_a_new_checkpoint(tiny, tmp_path):
    out = tmp_path / "run"
    stopped = terminate_after(command(tiny, out, "run.preempt_grace_s=0.001"), out, 1)
    assert stopped.returncode == 143, stopped.stderr
    assert "no checkpoint was complete within run.preempt_grace_s" in stopped.stderr
    assert not [p for p in (out / "checkpoints").glob("step-*") if not p.name.endswith(".incomplete")] \
        if (out / "checkpoints").exists() else True
