"""The image rollout engine: batched Flow-GRPO sampling with each denoising step's log-probability.

`FlowSampler` holds its own copy of the policy's transformer (the trainer syncs weights into it
with `load_weights`, as the text engine's) and sleeps in host memory like every swappable model
(`HostOffload`). `sample` runs the scheduler's time grid from noise to data with the SDE step of
`gcore_rl.models.flow_sde` and records the whole trajectory, which is what training replays:

    latents  [B, S + 1, C, h, w]   x_{t_0} (noise) ... x_{t_S} (the sample)
    logprobs [B, S]                log p(x_{t_{j+1}} | x_{t_j}) under the sampling weights
    times    [S + 1]               t_0 = 1 > ... > t_S = 0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn

from gcore_rl.errors import ConfigError
from gcore_rl.models.flow import FlowModel, TextCondition, guided_velocity
from gcore_rl.models.flow_sde import check_time_grid, sample_step, sde_law, step_log_prob
from gcore_rl.models.residency import HostOffload
from gcore_rl.rollout.graphs import GraphCapture, Replay
from gcore_rl.rollout.transfer import upload


@dataclass
class ImageSamplingConfig:
    """How the policy samples images."""

    n: int = field(default=8, metadata={"help": "Images per prompt (the GRPO group)."})
    steps: int = field(default=10, metadata={"help": "Denoising steps per image (Flow-GRPO samples 10 in training)."})
    eval_steps: int = field(default=20, metadata={"help": "Denoising steps of the deterministic (ODE) evaluation samples."})
    noise_level: float = field(default=0.7, metadata={"help": "a in the SDE's σ_t = a·√(t/(1-t)) (Flow-GRPO: 0.7); larger explores more."})
    guidance: float = field(default=1.0, metadata={"help": "Classifier-free guidance scale (1 = off; the unconditional branch uses the empty prompt and doubles the forwards)."})
    resolution: int = field(default=16, metadata={"help": "Image side in pixels."})
    batch_size: int = field(default=64, metadata={"help": "Images denoised together in one batch (and the chunk a controller deals to one rollout device)."})
    cuda_graphs: bool = field(default=True, metadata={"help": "On CUDA, replay each batch's denoising step (velocity, SDE step, log-prob) as a CUDA graph: one launch instead of one per kernel, the same images. A CPU runs the steps eagerly whatever this says."})
    added_seconds_per_chunk: float = field(default=0.0, metadata={"help": "Testing and demonstration: the rollout device waits this long after each chunk it samples (a slower engine, as judge.added_seconds_per_sample makes a slower judge)."})

    def validate(self) -> None:
        if not (math.isfinite(self.added_seconds_per_chunk) and self.added_seconds_per_chunk >= 0):
            raise ConfigError("added_seconds_per_chunk", f"must be a finite number >= 0, got {self.added_seconds_per_chunk}")
        for key in ("n", "steps", "eval_steps", "resolution", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.n < 2:
            raise ConfigError("n", f"GRPO compares images of the same prompt: needs at least 2 per group, got {self.n}")
        if not (math.isfinite(self.noise_level) and self.noise_level > 0):
            raise ConfigError("noise_level", f"must be a finite number > 0 (0 is the deterministic sampler, which has "
                              f"no log-probability to train on), got {self.noise_level}")
        if not (math.isfinite(self.guidance) and self.guidance >= 1.0):
            raise ConfigError("guidance", f"must be >= 1 (1 = no classifier-free guidance), got {self.guidance}")


@dataclass(frozen=True)
class ImageRollout:
    """What a device's image engine is asked to do in one call besides the prompts and the seed (the `sampling`
    of `WorkerAPI.generate_stream`): the job's sampling settings, and whether to sample deterministically (the
    ODE of the held-out evaluation) rather than with the SDE that training replays."""

    sampling: ImageSamplingConfig
    deterministic: bool = False


@dataclass
class Trajectory:
    """Sampled images with their denoising trajectories (shapes in the module docstring)."""

    latents: Tensor
    logprobs: Tensor
    times: Tensor
    images: Tensor  # [B, 3, H, W] in [0, 1]
    version: int = 0  # the update whose weights sampled them (the engine's `version`)

    def __len__(self) -> int:
        return self.latents.shape[0]


def cat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    """One trajectory of the parts' images, in order (they share the time grid; the oldest version is kept)."""
    return Trajectory(latents=torch.cat([p.latents for p in parts]), logprobs=torch.cat([p.logprobs for p in parts]),
                      times=parts[0].times, images=torch.cat([p.images for p in parts]),
                      version=min(p.version for p in parts))


def select_rows(trajectory: Trajectory, rows: slice) -> Trajectory:
    """The images `rows` of a trajectory, in tensors of their own: a view would carry its parent's whole storage
    wherever it is pickled (an engine's per-image samples sent from a Ray actor)."""
    return Trajectory(latents=trajectory.latents[rows].clone(), logprobs=trajectory.logprobs[rows].clone(),
                      times=trajectory.times, images=trajectory.images[rows].clone(), version=trajectory.version)


@dataclass
class ImageSample:
    """One sampled image, as the image engine streams it (a language engine's `Completion`): its prompt's index in the
    call and its index among that prompt's images, the prompt, and its trajectory (one row; `trajectory.version` is
    the update whose weights sampled it)."""

    prompt_index: int
    sample_index: int
    prompt: str
    trajectory: Trajectory

    @property
    def policy_version(self) -> int:
        return self.trajectory.version


def time_grid(scheduler, steps: int) -> Tensor:
    """The scheduler's ``[steps + 1]`` flow times from 1 to 0 (diffusers' sigmas, its shift applied)."""
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.to(torch.float32).clone()


def t_cap(times: Tensor) -> float:
    """Flow-GRPO's cap on t in σ_t: the second time of the grid (the first is 1, where σ_t is infinite)."""
    return float(times[1]) if len(times) > 2 else 0.5


def decode_images(model: FlowModel, latents: Tensor) -> Tensor:
    """``[B, 3, H, W]`` images in [0, 1] from final latents (the VAE's decoder, or the pixels themselves in [-1, 1])."""
    if model.vae is not None:
        config = model.vae.config
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        latents = model.vae.decode(latents, return_dict=False)[0]
    return ((latents.clamp(-1.0, 1.0) + 1.0) / 2.0).float()


class FlowSampler(HostOffload):
    """Batched SDE (training) and ODE (evaluation) sampling of a flow model; weights loaded by the trainer."""

    def __init__(self, model: FlowModel, transformer: nn.Module, device: torch.device | str = "cpu",
                 cuda_graphs: bool = True, static_shapes: bool | None = None):
        """`cuda_graphs`: on CUDA, each batch's denoising step (velocity, SDE step, log-prob) is replayed as a CUDA
        graph (`gcore_rl/rollout/graphs.py`); `static_shapes`: run the steps through the replays' static buffers
        (None: where graphs are used; True on a CPU runs that path without graphs, for tests)."""
        self.flow = model
        self.device = torch.device(device)
        self.model = transformer.eval().requires_grad_(False).to(self.device)
        if model.vae is not None:  # the decoder runs where the latents end up
            model.vae.to(self.device)
        self.version = 0
        self.capture = GraphCapture(cuda_graphs and self.device.type == "cuda", "the image engine's denoising step")
        self.static_shapes = self.capture.enabled if static_shapes is None else static_shapes
        self._replays: dict[tuple, Replay] = {}

    def sleep(self, level: str = "offload") -> int:
        """As `HostOffload.sleep`; the replays go too (the weights they read move)."""
        self._replays.clear()
        return super().sleep(level)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]], final: bool = True, version: int = 0) -> int:
        """Copy (some of) the trainer's transformer weights, by name, into the engine's copy, as the text engines
        take them (`RolloutEngine.load_weights`); `final` ends the update: the engine then holds update `version`.
        Returns the tensors copied."""
        own = self.model.state_dict()
        copied = 0
        for name, tensor in weights:
            if name not in own:
                raise KeyError(f"the image engine's transformer has no weight {name!r}")
            own[name].copy_(tensor)
            copied += 1
        if final:
            self.version = version
        return copied

    @torch.no_grad()
    def sample(self, prompts: list[str], cfg: ImageSamplingConfig, seed: int, *, deterministic: bool = False) -> Trajectory:
        """Images for `prompts` (one per entry; repeat a prompt for its group) with their trajectories.

        `deterministic`: the ODE (noise level 0, `cfg.eval_steps` steps; the log-probs are then 0);
        otherwise the SDE with `cfg.noise_level` over `cfg.steps` steps. The same seed gives the
        same images for the same prompts whatever `cfg.batch_size` (the model runs on batches of that
        many images; the noise of every step is drawn for all images at once, by a CPU generator, so the
        device does not change the draws). The trajectory stays on the engine's device until the images are
        decoded (`denoise`), then comes back to the host in one copy per tensor.
        """
        if self.state != "awake":
            raise RuntimeError("the image engine is asleep: wake() it before sampling")
        latents, logprobs, images, times = self.denoise(prompts, cfg, seed, deterministic=deterministic)
        return Trajectory(latents=latents.cpu(), logprobs=logprobs.cpu(), times=times, images=images.cpu(),
                          version=self.version)

    def denoise(self, prompts: list[str], cfg: ImageSamplingConfig, seed: int, *,
                deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`sample`'s work, its results on the engine's device: latents ``[B, S + 1, C, h, w]``, log-probs ``[B, S]``,
        images ``[B, 3, H, W]``, and the host's time grid ``[S + 1]``.

        What the steps need from the host goes up before the first one: the starting latents and every step's
        noise (drawn by the CPU generator in the order the steps use them, so the images are the same as when
        each step drew its own), each batch's text conditioning and the time grid (checked on the host). The
        steps themselves read nothing back, so on a GPU the host queues them without waiting; with
        `static_shapes` each batch's step runs through a `Replay` (on CUDA: one CUDA graph launch).
        """
        channels, height, width = self.flow.latent_shape(cfg.resolution)
        steps = cfg.eval_steps if deterministic else cfg.steps
        times = time_grid(self.flow.scheduler, steps)
        grid, cap = times.tolist(), t_cap(times)
        noise_level = 0.0 if deterministic else cfg.noise_level
        law = _StepLaw(cfg.guidance, noise_level, cap, check_time_grid(grid, noise_level, cap))
        generator = torch.Generator().manual_seed(seed)
        shape = (len(prompts), channels, height, width)
        draws = [torch.randn(shape, generator=generator) for _ in range(1 + (steps if noise_level > 0 else 0))]
        x, *noise = upload(torch.stack(draws), self.device).unbind()
        batches = self._batches(prompts, cfg)
        t_device = upload(times, self.device)
        path, logprobs = [x], []
        for j in range(steps):
            x_next, logprob = torch.empty_like(x), x.new_empty(len(prompts))
            for rows, *text in batches:  # copied out at once: batches of one size share a replay's outputs
                step_noise = [noise[j][rows]] if noise else []  # the ODE has none
                x_next[rows], logprob[rows] = self._step(law, [x[rows], t_device[j], t_device[j + 1], *step_noise,
                                                               *text])
            x = x_next
            logprobs.append(logprob)
            path.append(x)
        return torch.stack(path, dim=1), torch.stack(logprobs, dim=1), decode_images(self.flow, x), times

    def _step(self, law: _StepLaw, inputs: list[Tensor]) -> tuple[Tensor, Tensor]:
        """One batch's denoising step (`denoise_step`), at static shapes through a replay when `static_shapes`."""
        if not self.static_shapes:
            return denoise_step(self.model, self.flow.arch, law, *inputs)
        key = (law, *(tuple(t.shape) for t in inputs))
        if key not in self._replays:
            buffers = [torch.empty_like(t) for t in inputs]
            self._replays[key] = Replay(partial(denoise_step, self.model, self.flow.arch, law), buffers, self.capture)
        replay = self._replays[key]
        replay.load(inputs)  # a batch's text, unchanged since its last step, is not copied again
        return replay.run()

    def _batches(self, prompts: list[str], cfg: ImageSamplingConfig) -> list[tuple]:
        """The model's batches of `cfg.batch_size` images: each one's rows, then its text conditioning as tensors on
        the engine's device (tokens and pooled, then the empty prompt's, one row per image, under guidance)."""
        cond = self.flow.text(prompts)
        uncond = self.flow.text([""]) if cfg.guidance != 1.0 else None
        batches = []
        for first in range(0, len(prompts), cfg.batch_size):
            rows = slice(first, min(first + cfg.batch_size, len(prompts)))
            text = [cond.select(rows)] + ([uncond.repeat(rows.stop - rows.start)] if uncond is not None else [])
            batches.append((rows, *(t.to(self.device) for part in text for t in (part.tokens, part.pooled))))
        return batches


@dataclass(frozen=True)
class _StepLaw:
    """What a denoising step is besides its tensors (constants a captured step records): the guidance scale, the
    SDE's noise level (0: the ODE), Flow-GRPO's cap on t, and whether every std is known positive."""

    guidance: float
    noise_level: float
    t_cap: float
    std_positive: bool


def denoise_step(model: nn.Module, arch: str, law: _StepLaw, x: Tensor, t: Tensor, t_next: Tensor,
                 *rest: Tensor) -> tuple[Tensor, Tensor]:
    """One batch's step from flow time `t` to `t_next` (0-d tensors on the model's device): the next latents
    ``[b, *latent]`` and the step's log-prob ``[b]`` (zeros for the ODE). `rest`: the step's noise ``[b, *latent]``
    (the SDE only), then the prompts' text tokens and pooled vectors, then the empty prompt's (under guidance).
    Reads nothing back to the host, so a CUDA graph can record it."""
    noise, text = (rest[0], rest[1:]) if law.noise_level > 0 else (None, rest)
    cond = TextCondition(*text[:2])
    uncond = TextCondition(*text[2:]) if len(text) > 2 else None
    velocity = guided_velocity(model, arch, x, t.expand(len(x)), cond, uncond, law.guidance).float()
    step = sde_law(x, velocity, t, t_next, law.noise_level, law.t_cap, std_positive=law.std_positive)
    if noise is None:
        return step.mean, torch.zeros(len(x), device=x.device)
    x_next = sample_step(step, noise)
    return x_next, step_log_prob(x_next, step)
