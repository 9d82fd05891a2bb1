"""Two diffusion controllers with FSDP2 over a gloo group: the sharded update on two halves of a batch equals the
single-process update on the whole batch, and `runtime.controllers=2` runs the job end to end."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
import torch.multiprocessing as mp
from cli_helpers import REPO, gcore_rl
from process_helpers import run_processes

from gcore_rl.distributed import destroy_process_group, init_process_group
from gcore_rl.models.flow import load_flow_model
from gcore_rl.rollout.flow_sampler import FlowSampler, ImageSamplingConfig
from gcore_rl.training.flow_trainer import FlowGrpoTrainer, FlowTrainConfig, ImageBatch

PROMPTS = ["a red circle"] * 2 + ["a blue square"] * 2 + ["a green circle"] * 2 + ["a cyan square"] * 2
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.2, 1.2, 0.3, -0.3])
TRAIN = {"lr": 1e-3, "mini_batches": 2, "micro_batch": 3, "train_steps": 2, "clip_range": 0.01, "kl_coef": 0.05}


def _batch(model):
    engine = FlowSampler(model, copy.deepcopy(model.transformer))
    cfg = ImageSamplingConfig(n=2, steps=3, resolution=8)
    traj = engine.sample(PROMPTS, cfg, seed=5)
    return ImageBatch(traj, model.text(PROMPTS), ADVANTAGES, noise_level=cfg.noise_level)


def _half(batch: ImageBatch, rank: int) -> ImageBatch:
    rows = torch.arange(len(batch))[rank * 4:(rank + 1) * 4]
    traj = copy.copy(batch.trajectory)
    traj.latents, traj.logprobs, traj.images = traj.latents[rows], traj.logprobs[rows], traj.images[rows]
    return ImageBatch(traj, batch.cond.select(rows), batch.advantages[rows], noise_level=batch.noise_level)


def _to_bytes(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor.clone(), buffer)
    return buffer.getvalue()


def _rank_main(rank: int, nprocs: int, port: int, folder: str, out: dict) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, nprocs, port, torch.device("cpu"))
    try:
        model = load_flow_model(folder)
        batch = _half(_batch(model), rank)
        trainer = FlowGrpoTrainer(model, FlowTrainConfig(**TRAIN), shard=True)
        for step in range(2):
            trainer.train(batch, seed=step)
        weights = dict(trainer.sync_weights())
        if rank == 0:  # as bytes: a tensor through a Manager passes file descriptors, which crashed the manager once
            out.update({name: _to_bytes(tensor) for name, tensor in weights.items()})
    finally:
        destroy_process_group()


def test_two_sharded_controllers_update_like_one_process_on_the_whole_batch(flow_dirs):
    """Each rank splits its half of the batch into 2 mini-batches (a permutation seeded by the step) and takes 2
    optimiser steps per RL step, with KL to the reference and a denoising-step subset; one process reproduces the
    update by training each optimiser step on the union of the rows the two ranks use in it."""
    folder = str(flow_dirs["sd3"])
    with mp.Manager() as manager:
        out = manager.dict()
        # each rank ends by os._exit (run_processes), so gloo's teardown abort at exit cannot fail the test
        run_processes(_rank_main, (folder, out), 2, 300, "sharded diffusion trainer")
        sharded = {name: torch.load(io.BytesIO(data)) for name, data in out.items()}
    torch.set_num_threads(1)
    model = load_flow_model(folder)
    whole = _batch(model)
    trainer = FlowGrpoTrainer(model, FlowTrainConfig(**{**TRAIN, "mini_batches": 1}))
    for step in range(2):
        for share in range(2):  # the rows each rank's mini-batch `share` holds, both ranks together
            rows = torch.cat([_shares(rank, step)[share] + 4 * rank for rank in range(2)])
            trainer._optimizer_step(whole, rows, _steps(whole, step), whole.advantages.clamp(-5, 5))
    for name, tensor in trainer.sync_weights():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _shares(rank: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The rows (within a rank's half) of its mini-batches in step `seed`, as `FlowGrpoTrainer.train` orders them."""
    return torch.randperm(4, generator=torch.Generator().manual_seed(seed)).chunk(2)


def _steps(batch: ImageBatch, seed: int) -> list[int]:
    from gcore_rl.training.flow_trainer import trained_steps

    return trained_steps(batch.trajectory.logprobs.shape[1], TRAIN["train_steps"], seed)


@pytest.mark.slow
def test_two_controllers_run_the_job_from_the_command_line(tmp_path):
    proc = gcore_rl("init-tiny-diffusion", "base", "resolution=8", "num_layers=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = gcore_rl("train", REPO / "recipes/flow_grpo_shapes.yaml", "model.path=base", "run.output_dir=grpo",
                    "run.steps=2", "run.eval_every=2", "run.prompts_per_step=4", "sampling.n=2", "sampling.resolution=8",
                    "run.progress=false", "runtime.controllers=2", "runtime.threads_per_process=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "grpo/metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert load_flow_model(tmp_path / "grpo/final").arch == "sd3"
