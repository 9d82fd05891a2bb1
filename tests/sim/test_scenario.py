"""Scenario files: loading, errors that name the key, sweeps, presets and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from gcore_rl.errors import ConfigError
from gcore_rl.sim.scenario import load_scenario, resolve_job, variants

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("path", sorted((REPO / "scenarios").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_scenarios_load(path):
    scenario = load_scenario(path)
    # a published run is reproduced as it ran (rule reward, no filter); an agent's environment or tools score it
    if not path.name.startswith("published_verl") and not scenario.workload.agent.enabled:
        assert scenario.models.judge is not None
        # a diffusion reward model scores on a continuous scale: every group has a spread, nothing to filter
        assert scenario.workload.dynamic_sampling.enabled or scenario.workload.kind == "diffusion"
    for _, variant in variants(scenario):
        resolve_job(variant)


@pytest.mark.parametrize(("text", "key"), [
    ("gpus: 8\nworkload: {prompts_per_stp: 8}\n", "workload.prompts_per_stp"),
    ("gpus: many\n", "gpus"),
    ("hardware: {preset: B300}\n", "hardware.preset"),
    ("models: {policy: {preset: Qwen2.5-72B, tp: 1}}\n", "models.policy.tp"),
    ("gpus: 8\ncontrollers: 3\n", "controllers"),
    ("models: {judge: {preset: Qwen2.5-7B}}\nplacement: {rollout_devices: 8}\n", "placement.rollout_devices"),
    ("workload: {response_tokens: {median: 100, max: 0}}\n", "workload.response_tokens.max"),
    ("costs: {train_mfu: 1.5}\n", "costs.train_mfu"),
    ("strategies: [colocate, spread]\n", "strategies.1"),
    ("models: {policy: {preset: Qwen2.5-7B, shape: {name: x, params: 1, layers: 1, hidden: 1, kv_heads: 1, "
     "head_dim: 1, vocab: 1}}}\n", "models.policy.preset"),
])
def test_errors_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load_scenario(write(tmp_path, text))
    assert info.value.key == key


def test_overrides_and_hardware_fields(tmp_path):
    scenario = load_scenario(write(tmp_path, "hardware: {preset: A100, host_link_bandwidth: 1.0e10}\n"),
                             ["gpus=16", "controllers=2"])
    job = resolve_job(scenario)
    assert job.hardware.host_link_bandwidth == 1e10
    assert job.hardware.peak_flops == 312e12
    assert job.slice_devices == 8


def test_explicit_shape_and_hf_config(tmp_path):
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text('{"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, '
                      '"num_key_value_heads": 2, "intermediate_size": 384, "vocab_size": 99, '
                      '"tie_word_embeddings": true, "model_type": "llama", "dtype": "float32"}', encoding="utf-8")
    text = (f"models:\n  policy: {{hf_config: {config}}}\n  judge: {{shape: {{name: j, params: 1.0e9, layers: 16, "
            "hidden: 2048, kv_heads: 8, head_dim: 64, vocab: 32000}}\n")
    job = resolve_job(load_scenario(write(tmp_path, text)))
    assert job.policy.params == 800_256 and job.policy.name == "tiny"
    assert job.judge is not None and job.judge.params == 1e9


def test_sweep_makes_one_variant_per_value(tmp_path):
    scenario = load_scenario(write(tmp_path, "gpus: 8\nworkload: {prompts_per_step: 16}\n"
                                             "sweep: {controllers: [1, 2], seed: [0, 1]}\n"))
    found = variants(scenario)
    assert [label for label, _ in found] == ["controllers=1 seed=0", "controllers=1 seed=1",
                                             "controllers=2 seed=0", "controllers=2 seed=1"]
    assert [v.controllers for _, v in found] == [1, 1, 2, 2]


def test_tensor_parallel_raises_the_rebalance_unit(tmp_path):
    text = "models: {policy: {preset: Qwen2.5-7B, tp: 2}, judge: {preset: Qwen2.5-7B, tp: 2}}\n"
    job = resolve_job(load_scenario(write(tmp_path, text)))
    assert job.rebalance.unit == 2 and job.rollout_devices == 4


def test_every_rebalance_setting_reaches_the_job(make):
    job = resolve_job(make("rebalance.max_units=5", "rebalance.memory=3", "rebalance.min_gain=0.1",
                           "models.judge.tp=2", "placement.rollout_devices=2", "strategies=[partial, dynamic]"))
    assert (job.rebalance.max_units, job.rebalance.memory, job.rebalance.min_gain, job.rebalance.unit) == (5, 3, 0.1, 2)
