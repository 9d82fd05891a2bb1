"""SD3 and FLUX release layouts (several text encoders, a VAE): conditioning equal to diffusers' own
`encode_prompt`, loading, a Flow-GRPO run through the CLI whose saved policy reloads, and the errors for
missing or mismatched parts. The folders are tiny and random, written by `write_tiny_diffusion` with
``text_encoders="release"`` (CLIP-L 32 wide, CLIP-G 64, T5 128; 24 CLIP and 24 T5 tokens)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_helpers import REPO, gcore_rl

from gcore_rl.errors import ConfigError, ModelLoadError
from gcore_rl.models.flow import (
    MODEL_PARTS,
    RELEASE_PIPELINES,
    TinyDiffusionConfig,
    load_flow_model,
    write_tiny_diffusion,
)
from gcore_rl.models.flow_text import FluxTextEncoders, SD3TextEncoders

TOKENS = 24
"""The tiny folders' CLIP length (tokenizer model_max_length) and T5 max_sequence_length."""
PROMPTS = ["a red circle", "a blue square on the left", "", "a green triangle above a yellow square, small"]
"""The last prompt is longer than 24 tokens: cut, as the pipelines cut it."""


@pytest.fixture(scope="module")
def release_dirs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("release")
    dirs = {arch: write_tiny_diffusion(root / arch, TinyDiffusionConfig(arch=arch, text_encoders="release",
                                                                         resolution=8, num_layers=1))
            for arch in ("sd3", "flux")}
    no_t5 = shutil.copytree(dirs["sd3"], root / "sd3_no_t5")
    for part in ("text_encoder_3", "tokenizer_3"):
        shutil.rmtree(no_t5 / part)
    return {**dirs, "sd3_no_t5": no_t5, "root": root}


def _diffusers_embeddings(arch: str, folder, prompts: list[str], **parts) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds, pooled_prompt_embeds) of diffusers' own pipeline loaded from `folder`."""
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    pipeline = getattr(diffusers, RELEASE_PIPELINES[arch]).from_pretrained(folder, dtype=torch.float32, **parts)
    with torch.no_grad():
        if arch == "sd3":
            embeds, _, pooled, _ = pipeline.encode_prompt(prompts, None, None, do_classifier_free_guidance=False,
                                                          max_sequence_length=TOKENS)
        else:
            embeds, pooled, _ = pipeline.encode_prompt(prompts, max_sequence_length=TOKENS)
    return embeds, pooled


@pytest.mark.parametrize("name", ["sd3", "sd3_no_t5", "flux"])
def test_conditioning_equals_the_diffusers_pipelines_encode_prompt(release_dirs, name):
    arch = name.split("_")[0]
    parts = {"text_encoder_3": None, "tokenizer_3": None} if name == "sd3_no_t5" else {}
    ours = load_flow_model(release_dirs[name]).text(PROMPTS)
    embeds, pooled = _diffusers_embeddings(arch, release_dirs[name], PROMPTS, **parts)
    torch.testing.assert_close(ours.tokens, embeds, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.pooled, pooled, atol=1e-6, rtol=0)
    if arch == "sd3":  # 24 CLIP tokens (32 + 64 wide, zero-padded to 128) then 24 T5 tokens; pooled 32 + 64
        assert ours.tokens.shape == (4, 2 * TOKENS, 128) and ours.pooled.shape == (4, 96)
        assert not ours.tokens[:, :TOKENS, 96:].any()
        assert ours.tokens[:, TOKENS:].any() == (name == "sd3")  # without T5 its part is zeros
    else:  # T5's 24 tokens, 128 wide; CLIP's pooled output, 32 wide
        assert ours.tokens.shape == (4, TOKENS, 128) and ours.pooled.shape == (4, 32)


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_a_release_folder_loads_with_a_vae_and_caches_each_prompt(release_dirs, arch):
    model = load_flow_model(release_dirs[arch])
    assert model.arch == arch and model.vae is not None
    assert isinstance(model.text, {"sd3": SD3TextEncoders, "flux": FluxTextEncoders}[arch])
    assert model.latent_shape(8) == (16, 4, 4)  # the VAE halves the side; 16 latent channels
    with pytest.raises(ConfigError, match="not a multiple of 4"):
        model.latent_shape(6)
    together = model.text(["a longer prompt, this", "a cyan square"])
    model.text._cache.clear()
    alone = model.text(["a cyan square"])
    torch.testing.assert_close(together.tokens[1], alone.tokens[0])
    torch.testing.assert_close(together.pooled[1], alone.pooled[0])
    encoded, encode = [], model.text.encode
    model.text.encode = lambda prompts: encoded.append(prompts) or encode(prompts)
    model.text(["a cyan square", "a red circle", "a red circle"])
    assert encoded == [["a red circle"]]  # the cached prompt is not encoded again, a repeated one once


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_a_release_folder_trains_through_the_cli_and_its_policy_reloads(tmp_path, arch):
    proc = gcore_rl("init-tiny-diffusion", "base", f"arch={arch}", "text_encoders=release", "resolution=8",
                    "num_layers=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "release layout" in proc.stdout
    proc = gcore_rl("train", REPO / "recipes/flow_grpo_shapes.yaml", "model.path=base", "run.output_dir=grpo",
                    "run.steps=2", "run.eval_every=2", "run.prompts_per_step=2", "sampling.n=2", "sampling.resolution=8",
                    "sampling.eval_steps=2", "data.eval_prompts=2", "run.progress=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout
    final, base = tmp_path / "grpo" / "final", tmp_path / "base"
    assert sorted(p.name for p in final.iterdir()) == sorted(p.name for p in base.iterdir())
    assert {part for part in MODEL_PARTS if (base / part).exists()} >= {"text_encoder_2", "tokenizer_2", "vae"}
    reloaded, started = load_flow_model(final), load_flow_model(base)
    assert type(reloaded.text) is type(started.text)
    torch.testing.assert_close(reloaded.text(PROMPTS).tokens, started.text(PROMPTS).tokens, atol=0, rtol=0)


def _copy(release_dirs, arch: str, name: str):
    return shutil.copytree(release_dirs[arch], release_dirs["root"] / name)


def _refused(folder, *needles: str) -> str:
    with pytest.raises(ModelLoadError) as raised:
        load_flow_model(folder)
    message = str(raised.value)
    assert "\n" not in message, message  # one paragraph
    for needle in needles:
        assert needle in message, message
    return message


def test_a_missing_text_encoder_is_named(release_dirs):
    folder = _copy(release_dirs, "sd3", "no_te2")
    shutil.rmtree(folder / "text_encoder_2")
    _refused(folder, str(folder), "lists text_encoder_2", "model_index.json", "no text_encoder_2/")
    (folder / "model_index.json").unlink()  # without model_index.json: the widths tell
    _refused(folder, str(folder / "text_encoder"), "32-wide states", "joint_attention_dim=128",
             "pooled_projection_dim=96", "text_encoder_2/")
    folder = _copy(release_dirs, "flux", "no_tok2")
    shutil.rmtree(folder / "tokenizer_2")
    _refused(folder, str(folder), "FLUX release", "lacks tokenizer_2/")


def test_parts_of_other_widths_or_types_are_named(release_dirs):
    narrow = write_tiny_diffusion(release_dirs["root"] / "narrow", TinyDiffusionConfig(
        arch="flux", text_encoders="release", resolution=8, num_layers=1, text_hidden=16))
    folder = _copy(release_dirs, "flux", "narrow_t5")
    shutil.rmtree(folder / "text_encoder_2")
    shutil.copytree(narrow / "text_encoder_2", folder / "text_encoder_2")
    _refused(folder, str(folder), "text_encoder_2/ (T5) gives states 64 wide", "joint_attention_dim=128")
    folder = _copy(release_dirs, "sd3", "t5_for_clip_g")
    shutil.rmtree(folder / "text_encoder_2")
    shutil.copytree(release_dirs["sd3"] / "text_encoder_3", folder / "text_encoder_2")
    _refused(folder, str(folder / "text_encoder_2"), "'t5' model", "CLIPTextModelWithProjection")
    folder = _copy(release_dirs, "sd3", "long_tokenizer")
    _edit_json(folder / "tokenizer" / "tokenizer_config.json", model_max_length=77)
    _refused(folder, str(folder / "tokenizer"), "model_max_length=77", "24 positions")


def test_flux_dev_style_parts_are_refused_by_name(release_dirs):
    folder = _copy(release_dirs, "flux", "dynamic_shift")
    _edit_json(folder / "scheduler" / "scheduler_config.json", use_dynamic_shifting=True)
    _refused(folder, str(folder / "scheduler"), "use_dynamic_shifting")
    folder = _copy(release_dirs, "flux", "guidance_distilled")
    _edit_json(folder / "transformer" / "config.json", guidance_embeds=True)
    _refused(folder, str(folder / "transformer"), "guidance_embeds=true")


def _edit_json(path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_the_release_option_is_checked():
    with pytest.raises(ConfigError, match="resolution.*multiple of 4"):
        TinyDiffusionConfig(text_encoders="release", resolution=6).validate()
    with pytest.raises(ConfigError, match="channels"):
        TinyDiffusionConfig(text_encoders="release", channels=1).validate()
