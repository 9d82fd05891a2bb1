"""The worker of one device in a diffusion job: the image engine, the image reward model and the trainer shard
that the placement plan puts there (`WorkerSpec.roles`, `trainer_rank`).

The same object serves every runtime: in-process (one controller, or one per local process) and as a
Ray actor (`runtime/ray_runtime.py`, `worker_actor`). Its controller calls it through a `WorkerHandle`
(`diffusion/slice.py`), naming methods by reference (``handle.call(FlowWorker.sample, ...)``).
"""

from __future__ import annotations

import copy
import os
import time

import torch
from torch import Tensor

from gcore_rl.checkpoint.layout import TRAINER_DIR, TRAINER_STATE
from gcore_rl.configlib import from_dict
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.diffusion.images import to_arrays
from gcore_rl.diffusion.model import load_flow_model
from gcore_rl.diffusion.sampler import FlowSampler, Trajectory
from gcore_rl.diffusion.trainer import FlowGrpoTrainer, ImageBatch
from gcore_rl.distributed import destroy_process_group, init_process_group, resolve_device
from gcore_rl.errors import ConfigError
from gcore_rl.placement.plan import WorkerSpec
from gcore_rl.records import RewardInput
from gcore_rl.rewards.image_model import ImageRewardModel
from gcore_rl.rewards.judge import JudgeConfig
from gcore_rl.rewards.judge_role import JudgeRewarder
from gcore_rl.training.trainer_checkpoint import TrainerCheckpointer


class FlowWorker:
    """Hosts what the plan puts on one device, built as a language job's `DeviceWorker` is: `trainer_group` is the
    (address, port) of the trainer group's rank 0 when this worker must join a group of its own (Ray), None when
    the process's default group is the trainer group already (the local runtime) or there is a single trainer;
    its models run on `runtime.device` (CUDA device `cuda_index`, default the device's index in the plan; the text
    encoder stays on the host; trajectories and images come back on the host)."""

    def __init__(self, spec: WorkerSpec, cfg_dict: dict, trainer_group: tuple[str, int] | None = None,
                 cuda_index: int | None = None):
        self.spec = spec
        self.cfg = from_dict(FlowGrpoJobConfig, cfg_dict)
        runtime = self.cfg.runtime
        torch.set_num_threads(runtime.threads_per_process or max(1, (os.cpu_count() or 1) // runtime.devices))
        self.device = resolve_device(runtime.device, local_rank=spec.device if cuda_index is None else cuda_index)
        self._own_group = False
        if spec.trainer_rank is not None and spec.trainer_world > 1 and trainer_group is not None:
            init_process_group(spec.trainer_rank, spec.trainer_world, trainer_group[1], self.device, trainer_group[0])
            self._own_group = True
        model = load_flow_model(self.cfg.model.path)
        model.latent_shape(self.cfg.sampling.resolution)  # a resolution the model cannot take fails before any step
        self.flow = model
        self.engine = (FlowSampler(model, copy.deepcopy(model.transformer), self.device)
                       if "rollout" in spec.roles else None)
        self.scorer = (ImageRewardModel(self.cfg.reward_model, self.device)
                       if "reward_model" in spec.roles and self.cfg.reward_model.enabled else None)
        if self.scorer is not None:  # a model with the wrong head or broken weights fails here, before any step
            resolution = self.cfg.sampling.resolution
            self.scorer(torch.zeros(1, 3, resolution, resolution), [""])
        self.judge = (image_judge(self.cfg.judge, self.device)
                      if "reward_model" in spec.roles and self.cfg.judge.enabled else None)
        self.trainer = (FlowGrpoTrainer(model, self.cfg.train, shard=spec.trainer_world > 1, device=self.device)
                        if spec.trainer_rank is not None else None)
        self.checkpointer = TrainerCheckpointer(self.cfg.run.checkpoint_write) if self.trainer is not None else None
        self._published: dict[str, Tensor] | None = None
        self._timeline: list[tuple[str, float, float]] = []

    def sample(self, prompts: list[str], seed: int, deterministic: bool = False) -> Trajectory:
        """Images (and trajectories) for `prompts` from this device's engine (see `FlowSampler.sample`)."""
        start = time.time()
        out = self.engine.sample(prompts, self.cfg.sampling, seed, deterministic=deterministic)
        time.sleep(self.cfg.sampling.added_seconds_per_chunk)
        self._timeline.append(("sample", start, time.time()))
        return out

    def score(self, images: Tensor, prompts: list[str]) -> list[float]:
        """The image reward model's score, or the judge's reward, of each image ``[B, 3, H, W]`` in [0, 1]
        (`prompts[i]` the prompt of image i, for the judge's template)."""
        start = time.time()
        if self.judge is not None:
            samples = [RewardInput(prompt=p, completion=image, row={}) for p, image in zip(prompts, to_arrays(images),
                                                                                          strict=True)]
            out = [verdict.reward for verdict in self.judge.score(samples)[0]]
            time.sleep(self.cfg.judge.added_seconds_per_sample * len(images))
        else:
            out = self.scorer(images, prompts)
            time.sleep(self.cfg.reward_model.added_seconds_per_image * len(images))
        self._timeline.append(("score", start, time.time()))
        return out

    def timeline(self, since: int = 0) -> list[tuple[str, float, float]]:
        """The `sample` and `score` calls from the `since`-th on: (what, start, end) in Unix-epoch seconds."""
        return list(self._timeline[since:])

    def calls_made(self) -> int:
        """How many `sample` and `score` calls this worker has recorded (a mark for `timeline(since=...)`)."""
        return len(self._timeline)

    def train(self, prompts: list[str], trajectory: Trajectory, advantages: Tensor, seed: int) -> dict[str, float]:
        """This trainer's share of the step's update (every trainer of the group calls it with as many rows)."""
        uncond = self.flow.text([""]) if self.cfg.sampling.guidance != 1.0 else None
        batch = ImageBatch(trajectory, self.flow.text(prompts), advantages, guidance=self.cfg.sampling.guidance,
                           uncond=uncond, noise_level=self.cfg.sampling.noise_level)
        return self.trainer.train(batch, seed=seed)

    def sync(self, version: int) -> None:
        """Gather the trainer's whole weights (a collective over the trainer group) into this device's engine,
        and keep them for `publish` when this trainer publishes to separate rollout devices."""
        weights = self.trainer.weights()
        if self.engine is not None:
            self.engine.load_weights(weights, version)
        self._published = weights if self.spec.publishes_weights else None

    def publish(self) -> dict[str, Tensor]:
        """The weights the last `sync` gathered (the slice's publishing trainer only)."""
        if self._published is None:
            raise RuntimeError(f"device {self.spec.device} does not publish weights, or has not synced yet")
        return self._published

    def load_weights(self, weights: dict[str, Tensor], version: int) -> None:
        """Load published weights into this device's engine (rollout devices without a trainer)."""
        self.engine.load_weights(weights, version)

    def save_checkpoint(self, directory: str) -> None:
        """Stage this trainer's state and start writing it into the checkpoint folder `directory` (as a language
        job's trainers do: `TrainerCheckpointer`); devices without a trainer do nothing."""
        if self.checkpointer is not None:
            self.checkpointer.save(self.trainer, directory, TRAINER_DIR, TRAINER_STATE)

    def finish_checkpoint(self) -> float:
        """Wait for the checkpoint write in flight; the seconds waited."""
        return self.checkpointer.wait() if self.checkpointer is not None else 0.0

    def load_checkpoint(self, directory: str) -> None:
        """Restore this trainer from the checkpoint folder `directory`, resharded to this trainer group (the engine
        gets the weights at the next `sync`)."""
        if self.checkpointer is not None:
            self.checkpointer.load(self.trainer, directory, TRAINER_DIR, TRAINER_STATE)

    def save_policy(self, path: str) -> None:
        """Write the engine's (whole, synced) transformer as a model folder."""
        from gcore_rl.diffusion.sft import save_flow_model

        save_flow_model(self.engine.model, self.cfg.model.path, path)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._own_group:
            destroy_process_group()


def image_judge(cfg: JudgeConfig, device: torch.device | str = "cpu") -> JudgeRewarder:
    """The job's judge on `device`, which must see images (ConfigError for a text-only model, before any step)."""
    judge = JudgeRewarder.from_config(cfg, device)
    if judge.processor is None:
        raise ConfigError("judge.model_path", f"'{cfg.model_path}' is a text-only model and a diffusion policy's samples "
                          "are images; use a vision-language judge (e.g. `gcore-rl init-tiny DIR arch=qwen2_vl`)")
    return judge
