"""The device worker of a diffusion job: a `DeviceWorker` whose roles are a diffusion policy's.

What the plan puts on a device (roles `actor`, `rollout`, `reward_model`): the image engine (`FlowSampler`, its own
copy of the transformer, which the sync refills), the model that scores images — the image reward model
(`ImageModelScorer`, kind ``reward_model``) or a vision-language judge (`JudgeScorer`, kind ``judge``), both in the
``reward_model`` role — and the trainer's FSDP2 shard of the transformer (`FlowGrpoTrainer`). Everything else is the
language worker's: time sharing, the weight sync (gathered tensor by tensor, or published in buckets to separate
rollout devices), checkpoints, the timeline, heartbeats, work counters, utilisation and out-of-memory naming.

A controller calls it through the same `WorkerAPI` and `SliceClient` as a language job's: `generate_stream` with
prompts, an `ImageRollout` and a seed streams `ImageSample`s chunk by chunk (as an engine streams completions);
`score_samples` takes images as rule rewards see them; `train` takes an `ImageRows`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import torch

from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.disk import writing
from gcore_rl.errors import ConfigError
from gcore_rl.faults import maybe_fail
from gcore_rl.models.flow import load_flow_model
from gcore_rl.records import EngineRounds
from gcore_rl.rewards.image_model import ImageModelScorer, ImageRewardModel
from gcore_rl.rewards.judge import JudgeConfig
from gcore_rl.rewards.judge_role import JudgeRewarder, JudgeScorer
from gcore_rl.rewards.kinds import RewardScorer
from gcore_rl.rollout.flow_sampler import FlowSampler, ImageRollout, ImageSample, select_rows
from gcore_rl.runtime.device_worker import DeviceWorker, names_oom
from gcore_rl.training.flow_sft import save_flow_model
from gcore_rl.training.flow_trainer import FlowGrpoTrainer, ImageBatch, ImageRows
from gcore_rl.training.offload import TrainerOffload


class ImageDeviceWorker(DeviceWorker):
    """One device of a diffusion job (see the module docstring); built as `DeviceWorker` is."""

    config_type = FlowGrpoJobConfig
    cfg: FlowGrpoJobConfig

    def _build_roles(self) -> None:
        cfg, spec = self.cfg, self.spec
        model = load_flow_model(cfg.model.path)
        model.latent_shape(cfg.sampling.resolution)  # a resolution the model cannot take fails before any step
        self.flow = model
        self.tokenizer = None
        self.rollout_fn = None
        self.critic = None
        self.reference = None
        self.offload = TrainerOffload("none", self.device)
        self.engine = (FlowSampler(model, copy.deepcopy(model.transformer), self.device,
                                   cuda_graphs=cfg.sampling.cuda_graphs) if "rollout" in spec.roles else None)
        self.scorers: dict[str, RewardScorer] = image_scorers(cfg, self.device) if "reward_model" in spec.roles else {}
        self.trainer = (FlowGrpoTrainer(model, cfg.train, shard=spec.trainer_world > 1, device=self.device,
                                        lora=cfg.model.lora) if spec.trainer_rank is not None else None)

    @property
    def _syncs_adapters(self) -> bool:
        return False  # the whole transformer is synced (a LoRA transformer's merged)

    def _probe_engines(self) -> dict[str, EngineRounds]:
        return {}  # the image engine has no decode rounds to fit

    @names_oom("rollout", "generation")
    def generate_stream(self, prompt_ids: list[str], sampling: ImageRollout, seed: int) -> Iterator[list[ImageSample]]:
        """`sampling.sampling.n` images of each prompt (`prompt_ids` are prompt texts), in chunks of `batch_size` images
        (chunk c sampled with seed ``seed·1009 + c``, `FlowSampler.sample`, then the wait
        `added_seconds_per_chunk`); yields each chunk's `ImageSample`s as it is done."""
        self._use("rollout")
        cfg = sampling.sampling
        images = [(p, s) for p in range(len(prompt_ids)) for s in range(cfg.n)]
        for c, start in enumerate(range(0, len(images), cfg.batch_size)):
            chunk = images[start:start + cfg.batch_size]
            with self.timer.phase("rollout/generate"):
                trajectory = self.engine.sample([prompt_ids[p] for p, _ in chunk], cfg, seed * 1009 + c,
                                                deterministic=sampling.deterministic)
                time.sleep(cfg.added_seconds_per_chunk)
            self._count("rollout", calls=1, images=len(chunk))
            maybe_fail("generate", self.step)
            yield [ImageSample(p, s, prompt_ids[p], select_rows(trajectory, slice(i, i + 1)))
                   for i, (p, s) in enumerate(chunk)]

    @names_oom("actor", "update")
    def train(self, batch: ImageRows) -> dict[str, float]:
        """This trainer's share of the step's update (every trainer of the group calls it with as many rows)."""
        self._use("actor")
        cfg = self.cfg.sampling
        uncond = self.flow.text([""]) if cfg.guidance != 1.0 else None
        images = ImageBatch(batch.trajectory, self.flow.text(batch.prompts), batch.advantages, guidance=cfg.guidance,
                            uncond=uncond, noise_level=cfg.noise_level)
        self._count("actor", rows=len(batch.prompts))
        maybe_fail("train", self.step)
        with self.timer.phase("update/train"):
            return self.trainer.train(images, seed=batch.seed)

    def save_policy(self, path: str) -> None:
        """Write the engine's (whole, synced) transformer as a diffusers folder, the other parts copied from the start."""
        self._use("rollout")
        with writing(path, "the final model"):
            save_flow_model(self.engine.model, self.cfg.model.path, path)


def image_scorers(cfg: FlowGrpoJobConfig, device) -> dict[str, RewardScorer]:
    """The model that scores a diffusion job's images on a device of the ``reward_model`` role, by kind."""
    if cfg.judge.enabled:
        return {"judge": JudgeScorer(image_judge(cfg.judge, device))}
    if cfg.reward_model.enabled:
        model = ImageRewardModel(cfg.reward_model, device)
        resolution = cfg.sampling.resolution  # a model with the wrong head or broken weights fails here, before any step
        model(torch.zeros(1, 3, resolution, resolution), [""])
        return {"reward_model": ImageModelScorer(model)}
    return {}


def image_judge(cfg: JudgeConfig, device="cpu") -> JudgeRewarder:
    """The job's judge on `device`, which must see images (ConfigError for a text-only model, before any step)."""
    judge = JudgeRewarder.from_config(cfg, device)
    if judge.processor is None:
        raise ConfigError("judge.model_path", f"'{cfg.model_path}' is a text-only model and a diffusion policy's samples "
                          "are images; use a vision-language judge (e.g. `gcore-rl init-tiny DIR arch=qwen2_vl`)")
    return judge
