"""A diffusion (Flow-GRPO) run killed with SIGKILL and resumed from its newest checkpoint: the per-step record must
equal that of the uninterrupted run, bit for bit (every metric but the machine's timings), and the resumed
run's final policy must equal the uninterrupted one's.

Through the real command line, on the tiny flow model, saving every 2 steps (the save of step N is completed at
the end of step N + 1, so a kill in step 5 resumes from step 2): locally under `colocate`, and on Ray under
`disaggregated`, where each checkpoint holds the batches sampled ahead for the next steps (bounded staleness k = 1
and 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import REPO, gcore_rl
from safetensors.torch import load_file

from gcore_rl.models.flow import load_flow_model

STEPS = 6
JOB = [f"run.steps={STEPS}", "run.checkpoint_every=2", "run.keep_checkpoints=2", "run.prompts_per_step=2", "sampling.n=3",
       "sampling.resolution=8", "run.eval_every=3", "data.eval_prompts=2", "run.progress=false",
       "runtime.threads_per_process=1", "run.stop_at_eval_reward=0"]
UNTIMED = ("time", "throughput/", "util/", "memory/")
"""Metrics that measure the machine rather than the run (left out of the comparison)."""


def train(workdir: Path, model: Path, out: Path, *extra: str, fault: str | None = None):
    return gcore_rl("train", REPO / "recipes/flow_grpo_shapes.yaml", f"model.path={model}", f"run.output_dir={out}",
                    *JOB, *extra, cwd=workdir, fault=fault)


def record(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(UNTIMED)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out: Path, folder: str = "final") -> dict[str, torch.Tensor]:
    return load_file(str(next((out / folder / "transformer").glob("*.safetensors"))))


def killed_and_resumed(tmp_path: Path, model: Path, fault: str, *extra: str) -> tuple[Path, Path]:
    """An uninterrupted run and one killed at `fault` then resumed (`run.resume=auto`), both finished."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    proc = train(tmp_path, model, whole, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = train(tmp_path, model, cut, *extra, fault=fault)
    assert proc.returncode != 0 and not (cut / "final").exists()
    assert (cut / "checkpoints").is_dir()
    proc = train(tmp_path, model, cut, *extra, "run.resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resume: continuing from '{cut / 'checkpoints' / 'step-00000002'}'" in " ".join(proc.stdout.split())
    return whole, cut


def test_a_killed_diffusion_run_resumes_to_the_same_record(tmp_path, flow_dirs):
    whole, cut = killed_and_resumed(tmp_path, flow_dirs["sd3"], "train:5", "train.kl_coef=0.04")
    assert [line["step"] for line in record(cut)] == list(range(1, STEPS + 1))
    assert record(cut) == record(whole)
    expected, resumed = final_weights(whole), final_weights(cut)
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)
    saved = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert saved == ["step-00000004", "step-00000006"]
    manifest = json.loads((cut / "checkpoints" / "step-00000006" / "manifest.json").read_text())
    assert {"trainer/.metadata", "trainer.json", "controller-0.json"} <= {f["path"] for f in manifest["files"]}
    assert [m["role"] for m in manifest["frozen"]] == ["reference"]  # the KL's start transformer, by checksum
    # the last checkpoint exported as a diffusers folder holds the final policy's weights
    proc = gcore_rl("export", cut / "checkpoints" / "step-00000006", tmp_path / "exported", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = final_weights(tmp_path / "exported", "")
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    assert load_flow_model(tmp_path / "exported").arch == "sd3"


@pytest.mark.slow
@pytest.mark.parametrize(("k", "staleness"), [(1, [0.0, 1.0, 1.0, 1.0, 1.0]), (2, [0.0, 1.0, 2.0, 2.0, 2.0])])
def test_a_killed_disaggregated_diffusion_run_on_ray_resumes_to_the_same_record(tmp_path, models, k, staleness):
    """2 devices: one samples, one trains, with the language jobs' schedules: one step off (k = 1) or a producer thread
    under bounded staleness k = 2. Step 2's checkpoint (completed at the end of step 3) keeps the k batches sampled
    ahead for steps 3 .. 2 + k, their trajectories beside the controller's JSON; the kill comes in step 5's training,
    before step 4's save is completed, so the resume takes step 2's."""
    extra = ("runtime.kind=ray", "runtime.devices_per_controller=2", "placement.strategy=disaggregated",
             "run.steps=5", "run.eval_every=5", f"placement.max_staleness={k}")
    whole, cut = killed_and_resumed(tmp_path, models["policy"], "train:5", *extra)
    lines = record(whole)
    assert [line["rollout/staleness_max"] for line in lines] == staleness
    assert record(cut) == lines
    state = json.loads((cut / "checkpoints" / "step-00000002" / "controller-0.json").read_text())
    assert len(state["ahead"]) == k
    # step s's batch was sampled on the weights of update max(0, s - 1 - k)
    assert [{version for group in rollout["groups"] for version in group["payload"]["versions"]}
            for rollout in state["ahead"]] == ([{1}] if k == 1 else [{0}, {1}])
    assert (cut / "checkpoints" / "step-00000002" / "controller-0.safetensors").is_file()
