"""Loading flow model folders (SD3- and FLUX-shaped), their errors, and the velocity call."""

import json
import shutil

import pytest
import torch

from gcore_rl.errors import ConfigError, ModelLoadError
from gcore_rl.models.flow import (
    TinyDiffusionConfig,
    load_flow_model,
    pack_flux,
    predict_velocity,
    unpack_flux,
)
from gcore_rl.models.tiny import write_tiny_model


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_tiny_folder_loads_and_predicts_a_velocity_per_pixel(flow_dirs, arch):
    model = load_flow_model(flow_dirs[arch])
    assert model.arch == arch and model.vae is None
    assert model.latent_shape(8) == (3, 8, 8)
    cond = model.text(["a red circle", "a blue square"])
    assert cond.tokens.shape == (2, 24, 32) and cond.pooled.shape == (2, 32)
    v = predict_velocity(model.transformer, model.arch, torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.9]), cond)
    assert v.shape == (2, 3, 8, 8) and torch.isfinite(v).all()
    # the parts load with diffusers' own classes too (the folder is an ordinary diffusers layout)
    import diffusers

    cls = {"sd3": diffusers.SD3Transformer2DModel, "flux": diffusers.FluxTransformer2DModel}[arch]
    assert isinstance(cls.from_pretrained(flow_dirs[arch] / "transformer"), cls)


def test_a_prompts_conditioning_does_not_depend_on_its_batch(flow_dirs):
    text = load_flow_model(flow_dirs["sd3"]).text
    alone = text(["a cyan square"])
    text._cache.clear()
    together = text(["a longer prompt, this", "a cyan square"])
    torch.testing.assert_close(together.tokens[1], alone.tokens[0])
    torch.testing.assert_close(together.pooled[1], alone.pooled[0])
    assert not torch.allclose(together.pooled[0], together.pooled[1])


def test_flux_packing_round_trips():
    x = torch.randn(2, 3, 6, 8)
    packed = pack_flux(x)
    assert packed.shape == (2, 12, 12)
    torch.testing.assert_close(unpack_flux(packed, 3, 6, 8), x)
    torch.testing.assert_close(packed[0, 0], x[0, :, :2, :2].reshape(-1))  # one 2×2 patch, channel-major


def test_resolutions_the_model_cannot_take_are_named(flow_dirs):
    model = load_flow_model(flow_dirs["sd3"])
    with pytest.raises(ConfigError, match="sampling.resolution.*not a multiple of 2"):
        model.latent_shape(7)
    with pytest.raises(ConfigError, match="position embeddings"):
        model.latent_shape(64)


def test_folders_that_are_not_flow_models_are_refused(flow_dirs, tmp_path):
    lm = write_tiny_model(tmp_path / "lm")
    with pytest.raises(ModelLoadError, match="transformers model.*transformer/"):
        load_flow_model(lm)
    ddpm = shutil.copytree(flow_dirs["sd3"], tmp_path / "ddpm")
    config = ddpm / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "_class_name": "DDPMScheduler"}))
    with pytest.raises(ModelLoadError, match="DDPMScheduler.*FlowMatchEulerDiscreteScheduler"):
        load_flow_model(ddpm)
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_flow_model(tmp_path / "nowhere")


def test_tiny_config_is_checked():
    with pytest.raises(ConfigError, match="head_dim"):
        TinyDiffusionConfig(arch="flux", head_dim=12).validate()
    with pytest.raises(ConfigError, match="resolution"):
        TinyDiffusionConfig(resolution=9).validate()
