"""LoRA diffusion policies (`model.lora` of a diffusion job): only the adapters train, the KL's reference is the
transformer with its adapters off, the image engine gets merged weights it samples with as the trainer computes,
checkpoints hold the adapters and resume exactly, and export writes the merged transformer or a peft folder."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from cli_helpers import REPO, gcore_rl
from safetensors.torch import load_file

from gcore_rl.algos.advantages import group_advantages
from gcore_rl.configlib import load_config
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.errors import ConfigError
from gcore_rl.faults import ENV as FAULT_ENV
from gcore_rl.models.flow import load_flow_model
from gcore_rl.models.flow_sde import step_log_prob
from gcore_rl.models.lora import LoraSettings, is_adapter_name
from gcore_rl.rollout.flow_sampler import FlowSampler, ImageSamplingConfig
from gcore_rl.runtime.driver import run_job
from gcore_rl.training.flow_trainer import FlowGrpoTrainer, FlowTrainConfig, ImageBatch, replay_step

PROMPTS = ["a red circle", "a red circle", "a blue square", "a blue square"]
LORA = LoraSettings(enabled=True, rank=4, alpha=8.0)
RECIPE = REPO / "recipes" / "flow_grpo_shapes.yaml"


def _setup(flow_dirs, **train):
    model = load_flow_model(flow_dirs["sd3"])
    start = copy.deepcopy(model.transformer)
    trainer = FlowGrpoTrainer(model, FlowTrainConfig(**train), lora=LORA)
    engine = FlowSampler(model, copy.deepcopy(start))
    return model, start, trainer, engine


def _batch(model, engine, seed: int, advantages=None):
    cfg = ImageSamplingConfig(n=2, steps=3, resolution=8)
    traj = engine.sample(PROMPTS, cfg, seed=seed)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2) if advantages is None else advantages
    return ImageBatch(traj, model.text(PROMPTS), advantages, noise_level=cfg.noise_level)


def _step_logprobs(transformer, model, batch) -> torch.Tensor:
    rows = torch.arange(len(batch))
    with torch.no_grad():
        return torch.stack([step_log_prob(batch.trajectory.latents[rows, j + 1],
                                          replay_step(transformer, model, batch, rows, j)) for j in range(3)], dim=1)


def test_only_the_adapters_train_and_the_engine_samples_with_the_merged_weights_as_the_trainer_computes(flow_dirs):
    model, start, trainer, engine = _setup(flow_dirs, lr=3e-3, mini_batches=1, clip_range=10.0)
    trained = {name for name, p in trainer.transformer.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter_name(name) for name in trained)
    for seed in (3, 4):  # two updates, each synced
        trainer.train(_batch(model, engine, seed), seed=seed)
        engine.load_weights(trainer.sync_weights(), version=trainer.version)
    base = dict(trainer.transformer.get_base_model().named_parameters())
    for name, param in start.named_parameters():  # the frozen base did not move
        key = name if name in base else name.rsplit(".", 1)[0] + ".base_layer." + name.rsplit(".", 1)[1]
        assert torch.equal(base[key], param), name
    assert engine.model.state_dict().keys() == start.state_dict().keys()  # the plain transformer's names
    assert any(not torch.equal(engine.model.state_dict()[k], v) for k, v in start.state_dict().items())
    fresh = _batch(model, engine, seed=9)  # sampled by the engine on the merged weights
    torch.testing.assert_close(_step_logprobs(trainer.transformer, model, fresh), fresh.trajectory.logprobs,
                               rtol=0, atol=1e-5)


def test_the_reference_is_the_base_with_its_adapters_off(flow_dirs):
    model, start, trainer, engine = _setup(flow_dirs, kl_coef=0.1, lr=3e-3, mini_batches=1)
    assert trainer.reference is None  # no copy of the transformer
    batch = _batch(model, engine, seed=4, advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert trainer.train(batch, seed=0)["kl"] == 0  # one optimiser step: it ran on the base's weights
    assert trainer.train(batch, seed=1)["kl"] > 0
    rows = torch.arange(4)
    reference = trainer._reference_step(batch, rows, 1)
    with torch.no_grad():
        plain = replay_step(start, model, batch, rows, 1)
    torch.testing.assert_close(reference.mean, plain.mean, rtol=0, atol=1e-6)


def test_the_trainer_state_is_the_adapters_and_their_optimiser_and_resumes_to_the_same_update(flow_dirs):
    model, _, trainer, engine = _setup(flow_dirs, lr=3e-3, mini_batches=2)
    first, second = _batch(model, engine, seed=5), _batch(model, engine, seed=6)
    trainer.train(first, seed=0)
    state = copy.deepcopy(trainer.state_dict())
    assert state["model"] and all(is_adapter_name(name) for name in state["model"])
    resumed = FlowGrpoTrainer(load_flow_model(flow_dirs["sd3"]), FlowTrainConfig(lr=3e-3, mini_batches=2), lora=LORA)
    resumed.load_state_dict(state)
    assert trainer.train(second, seed=1) == resumed.train(second, seed=1)
    for (name, a), b in zip(trainer.sync_weights(), dict(resumed.sync_weights()).values(), strict=True):
        assert torch.equal(a, b), name


def test_a_diffusion_job_cannot_sync_adapters_alone(flow_dirs):
    with pytest.raises(ConfigError, match="model.lora.sync"):
        load_config(FlowGrpoJobConfig, RECIPE, [f"model.path={flow_dirs['sd3']}", "model.lora.enabled=true",
                                                 "model.lora.sync=adapters"])


UNTIMED = ("time", "throughput/", "util/", "memory/")


def _records(run) -> list[dict]:
    return [{key: value for key, value in json.loads(line).items() if not key.startswith(UNTIMED)}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _job(tmp_path, models, name: str, *extra: str) -> FlowGrpoJobConfig:
    return load_config(FlowGrpoJobConfig, RECIPE, [
        f"model.path={models['policy']}", f"run.output_dir={tmp_path / name}", "run.steps=4", "run.eval_every=4",
        "run.progress=false", "run.stop_at_eval_reward=0", "run.save_final=false", "data.eval_prompts=2",
        "sampling.eval_steps=2", "sampling.steps=3", "sampling.resolution=8", "sampling.n=2", "sampling.batch_size=4",
        "run.prompts_per_step=4", "runtime.threads_per_process=1", "model.lora.enabled=true", "model.lora.rank=4",
        "model.lora.alpha=8", "train.lr=0.003", "run.checkpoint_every=2", "run.max_restarts=1", "runtime.controllers=2",
        *extra])


def test_a_lora_diffusion_job_checkpoints_its_adapters_and_exports_them_merged_or_alone(tmp_path, models):
    run_job(_job(tmp_path, models, "run", "run.steps=2", "runtime.controllers=1"))
    records = _records(tmp_path / "run")
    assert records[0]["rollout/logprob_gap_max"] < 1e-4  # the engine samples with what the trainer computes
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert "base" in {frozen["role"] for frozen in manifest["frozen"]}
    # merged: a diffusers folder whose transformer has the start's names, its weights moved by the adapters
    proc = gcore_rl("export", checkpoint, tmp_path / "merged", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    merged = load_flow_model(tmp_path / "merged").transformer
    start = load_flow_model(models["policy"]).transformer
    assert merged.state_dict().keys() == start.state_dict().keys()
    assert any(not torch.equal(merged.state_dict()[k], v) for k, v in start.state_dict().items())
    # the adapters alone: a peft folder that loads onto the start transformer and computes as the merged one
    proc = gcore_rl("export", checkpoint, tmp_path / "adapters", "--adapter", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    from peft import PeftModel

    assert all(".lora_A." in n or ".lora_B." in n for n in load_file(tmp_path / "adapters" / "adapter_model.safetensors"))
    adapted = PeftModel.from_pretrained(start, tmp_path / "adapters").eval()
    inputs = {"hidden_states": torch.randn(2, 3, 8, 8), "timestep": torch.tensor([500.0, 100.0]),
              "encoder_hidden_states": torch.randn(2, 4, merged.config.joint_attention_dim),
              "pooled_projections": torch.randn(2, merged.config.pooled_projection_dim)}
    with torch.no_grad():
        torch.testing.assert_close(adapted(**inputs).sample, merged(**inputs).sample, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_lora_diffusion_job_killed_in_training_resumes_to_the_same_record(tmp_path, models, monkeypatch):
    """One of two local controller processes is SIGKILLed in step 4's training, after the save of step 2: the job
    resumes from the adapters and their optimiser state and records what the uninterrupted job did."""
    run_job(_job(tmp_path, models, "uninterrupted"))
    expected = _records(tmp_path / "uninterrupted")
    assert len({line["pg_loss"] for line in expected}) > 1, "the job must train, or equality proves nothing"
    monkeypatch.setenv(FAULT_ENV, "train:4")
    run_job(_job(tmp_path, models, "killed"))
    assert _records(tmp_path / "killed") == expected
