"""The image engine and the Flow-GRPO update: log-prob parity, determinism, weight sync, sleep/wake, learning direction."""

import copy

import pytest
import torch

from gcore_rl.algos.advantages import group_advantages
from gcore_rl.models.flow import load_flow_model
from gcore_rl.models.flow_sde import step_log_prob
from gcore_rl.rollout.flow_sampler import FlowSampler, ImageSamplingConfig
from gcore_rl.training.flow_trainer import (
    FlowGrpoTrainer,
    FlowTrainConfig,
    ImageBatch,
    replay_step,
    trained_steps,
)

PROMPTS = ["a red circle", "a red circle", "a blue square", "a blue square"]


def _setup(flow_dirs, arch, **train):
    model = load_flow_model(flow_dirs[arch])
    trainer = FlowGrpoTrainer(model, FlowTrainConfig(**train))
    return model, trainer, FlowSampler(model, copy.deepcopy(trainer.transformer))


@pytest.mark.parametrize("arch,guidance", [("sd3", 1.0), ("sd3", 3.0), ("flux", 1.0)])
def test_trainer_recomputes_the_engines_step_log_probs(flow_dirs, arch, guidance):
    """The ground rule of the project for diffusion: what the engine sampled with, the trainer recomputes (1e-4)."""
    model, trainer, engine = _setup(flow_dirs, arch)
    cfg = ImageSamplingConfig(n=2, steps=4, resolution=8, guidance=guidance, batch_size=3)
    traj = engine.sample(PROMPTS, cfg, seed=0)
    assert traj.latents.shape == (4, 5, 3, 8, 8) and traj.logprobs.shape == (4, 4)
    assert traj.images.min() >= 0 and traj.images.max() <= 1
    batch = ImageBatch(traj, model.text(PROMPTS), torch.zeros(4), guidance=guidance,
                       uncond=model.text([""]) if guidance != 1.0 else None, noise_level=cfg.noise_level)
    rows = torch.arange(4)
    with torch.no_grad():
        for j in range(4):
            recomputed = step_log_prob(traj.latents[rows, j + 1], replay_step(trainer.transformer, model, batch, rows, j))
            torch.testing.assert_close(recomputed, traj.logprobs[:, j], rtol=0, atol=1e-4)


def test_sampling_is_seeded_and_the_ode_is_deterministic(flow_dirs):
    _, _, engine = _setup(flow_dirs, "sd3")
    cfg = ImageSamplingConfig(n=2, steps=3, eval_steps=3, resolution=8)
    a, b, c = (engine.sample(PROMPTS, cfg, seed=s) for s in (1, 1, 2))
    torch.testing.assert_close(a.latents, b.latents)
    assert not torch.allclose(a.latents, c.latents)
    ode = engine.sample(PROMPTS, cfg, seed=1, deterministic=True)
    assert torch.all(ode.logprobs == 0)
    # the batch size of the engine changes nothing
    torch.testing.assert_close(engine.sample(PROMPTS, ImageSamplingConfig(n=2, steps=3, resolution=8, batch_size=1), seed=1).latents,
                               a.latents)


def test_update_moves_log_probs_towards_positive_advantages_and_syncs_the_engine(flow_dirs):
    model, trainer, engine = _setup(flow_dirs, "sd3", lr=1e-3, mini_batches=1, clip_range=10.0)
    cfg = ImageSamplingConfig(n=2, steps=3, resolution=8)
    traj = engine.sample(PROMPTS, cfg, seed=3)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)  # samples 0 and 3 are the better ones
    batch = ImageBatch(traj, model.text(PROMPTS), advantages, noise_level=cfg.noise_level)
    stats = trainer.train(batch, seed=0)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the first step's ratio is 1
    rows = torch.arange(4)
    with torch.no_grad():
        after = torch.stack([step_log_prob(traj.latents[rows, j + 1], replay_step(trainer.transformer, model, batch, rows, j))
                             for j in range(3)], dim=1).sum(1)
    change = after - traj.logprobs.sum(1)
    assert change[0] > change[1] and change[3] > change[2]
    engine.load_weights(trainer.sync_weights(), version=trainer.version)
    assert engine.version == 1
    for (name, p), q in zip(trainer.transformer.state_dict().items(), engine.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_kl_to_the_reference_is_zero_before_training_and_positive_after(flow_dirs):
    model, trainer, engine = _setup(flow_dirs, "sd3", kl_coef=0.1, lr=1e-3, mini_batches=1)
    cfg = ImageSamplingConfig(n=2, steps=2, resolution=8)
    traj = engine.sample(PROMPTS, cfg, seed=4)
    batch = ImageBatch(traj, model.text(PROMPTS), torch.tensor([1.0, -1.0, 1.0, -1.0]), noise_level=cfg.noise_level)
    assert trainer.train(batch, seed=0)["kl"] == 0  # one optimiser step: it ran on the reference's weights
    assert trainer.train(batch, seed=1)["kl"] > 0


def test_denoising_reduction_picks_a_seeded_subset():
    assert trained_steps(10, 0, 0) == list(range(10))
    picked = trained_steps(10, 4, 7)
    assert len(picked) == 4 and picked == sorted(set(picked)) and picked == trained_steps(10, 4, 7)
    assert trained_steps(3, 5, 0) == [0, 1, 2]


def test_engine_sleeps_in_host_memory_and_wakes(flow_dirs):
    _, _, engine = _setup(flow_dirs, "sd3")
    assert engine.sleep() > 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.sample(PROMPTS, ImageSamplingConfig(resolution=8), seed=0)
    engine.wake()
    assert engine.sample(PROMPTS, ImageSamplingConfig(n=2, steps=2, resolution=8), seed=0).images.shape == (4, 3, 8, 8)


@pytest.mark.parametrize("arch,guidance,deterministic", [("sd3", 1.0, False), ("sd3", 3.0, False), ("flux", 3.0, False),
                                                          ("flux", 1.0, True)])
def test_the_static_denoising_steps_give_the_eager_images_bit_for_bit(flow_dirs, arch, guidance, deterministic):
    """Issue 49: the path CUDA graphs replay (each batch's step through a `Replay`'s static buffers; two batches of
    one size share one) gives the eager engine's latents, log-probs and images exactly, call after call; sleeping
    drops the replays (the weights they read move) and the next call builds them again."""
    model = load_flow_model(flow_dirs[arch])
    eager, static = (FlowSampler(model, copy.deepcopy(model.transformer), static_shapes=flag) for flag in (False, True))
    cfg = ImageSamplingConfig(n=2, steps=4, eval_steps=3, resolution=8, guidance=guidance, batch_size=3)
    prompts = [*PROMPTS, "a green ring", "a red circle"]  # 6 images: two batches of 3
    for seed in (0, 1):
        first, second = (e.sample(prompts, cfg, seed=seed, deterministic=deterministic) for e in (eager, static))
        for a, b in ((first.latents, second.latents), (first.logprobs, second.logprobs), (first.images, second.images)):
            assert torch.equal(a, b)
    assert len(static._replays) == 1 and next(iter(static._replays.values())).runs == 2 * 2 * (3 if deterministic else 4)
    static.sleep()
    assert not static._replays
    static.wake()
    again = static.sample(prompts, cfg, seed=1, deterministic=deterministic)
    assert torch.equal(again.latents, second.latents) and len(static._replays) == 1


@pytest.mark.parametrize("arch,guidance,static", [("sd3", 1.0, False), ("flux", 3.0, False), ("sd3", 3.0, True)])
def test_the_image_engine_uploads_its_inputs_once_and_reads_nothing_back(flow_dirs, arch, guidance, static):
    """Issue 49: the denoising steps neither wait on the device nor copy from the host, so a GPU's host queues
    them without a round trip per step. The `meta` device stands in for the GPU (it holds no data: reading a
    value from it fails, and every copy to it is counted): 2 steps and 6 steps upload the same tensors (the
    starting latents with every step's noise, the time grid, each batch's text conditioning), and come back
    on the device for `sample`'s one copy per tensor."""
    from tests.rollout.host_reads import DeviceTraffic

    model = load_flow_model(flow_dirs[arch])
    engine = FlowSampler(model, copy.deepcopy(model.transformer), device="meta", static_shapes=static)
    uploads = []
    for steps in (2, 6):
        cfg = ImageSamplingConfig(n=2, steps=steps, resolution=8, guidance=guidance, batch_size=3)
        with DeviceTraffic() as traffic:
            latents, logprobs, images, _ = engine.denoise([*PROMPTS, "a green ring"], cfg, seed=0)
        assert traffic.downloads == 0
        assert latents.device.type == logprobs.device.type == images.device.type == "meta"
        assert latents.shape == (5, steps + 1, 3, 8, 8) and logprobs.shape == (5, steps)
        uploads.append(traffic.uploads)
    batches, text_parts = 2, 2 if guidance == 1.0 else 4  # tokens and pooled, of the prompts (and the empty one)
    assert uploads == [2 + batches * text_parts] * 2
