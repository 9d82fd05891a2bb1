"""The cost formulas against hand-computed values."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gcore_rl.costmodel import cost
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.hardware import HARDWARE
from gcore_rl.costmodel.models import MODELS, EngineFit, ModelSpec

H100 = HARDWARE["H100"]
QWEN7B = MODELS["Qwen2.5-7B"]
C = CostConstants()

# runs/tiny-base/config.json as `gcore-rl init-tiny` writes it (800,256 parameters in PyTorch)
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "dtype": "float32", "head_dim": 32,
               "hidden_size": 128, "intermediate_size": 384, "mlp_bias": False, "model_type": "llama",
               "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
               "tie_word_embeddings": True, "vocab_size": 99}


def test_model_shapes_match_published_sizes():
    assert QWEN7B.params == pytest.approx(7.62e9, rel=0.01)
    assert MODELS["Llama-3.1-8B"].params == pytest.approx(8.03e9, rel=0.01)
    assert MODELS["Qwen2.5-0.5B"].params == pytest.approx(0.494e9, rel=0.01)
    assert MODELS["Llama-3.1-70B"].params == pytest.approx(70.6e9, rel=0.01)
    assert QWEN7B.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert QWEN7B.weight_bytes == QWEN7B.params * 2


def test_from_hf_config_counts_the_tiny_model_exactly():
    spec = ModelSpec.from_hf_config(TINY_CONFIG, name="tiny")
    assert spec.params == 800_256  # sum(p.numel()) of the model transformers builds from this config
    assert spec.bytes_per_param == 4  # float32
    assert spec.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4


def test_decode_step_is_bandwidth_bound_for_a_small_batch():
    seconds = cost.decode_step_seconds(1, 1000, QWEN7B, H100, C)
    memory = (QWEN7B.weight_bytes + 1000 * QWEN7B.kv_bytes_per_token) / (0.75 * 3.35e12)
    assert float(seconds) == pytest.approx(memory + 0.003)
    # tensor parallelism splits the bytes over the devices
    assert float(cost.decode_step_seconds(1, 1000, QWEN7B, H100, C, tp=2)) == pytest.approx(memory / 2 + 0.003)


def test_decode_step_is_compute_bound_for_a_huge_batch():
    seconds = cost.decode_step_seconds(4096, 0, QWEN7B, H100, C)
    assert float(seconds) == pytest.approx(2 * QWEN7B.params * 4096 / (989e12 * 0.5) + 0.003)


def test_segment_sum_equals_the_step_by_step_sum():
    begin, end, active, offset = 3, 40, 200, 5000  # the KV grows by `active` tokens per step
    steps = np.arange(begin, end)
    brute = cost.decode_step_seconds(active, offset + active * steps, QWEN7B, H100, C).sum()
    seconds, compute_steps = cost.decode_segment_seconds(begin, end, active, offset, QWEN7B, H100, C)
    assert float(seconds) == pytest.approx(float(brute), rel=1e-12)
    # the first steps are compute bound, the later ones (more KV) memory bound
    expected = sum(1 for s in steps if 2 * QWEN7B.params * active / (989e12 * 0.5)
                   > (QWEN7B.weight_bytes + QWEN7B.kv_bytes_per_token * (offset + active * s)) / (0.75 * 3.35e12))
    assert float(compute_steps) == expected


def test_compute_phases_follow_their_flop_formulas():
    tokens = 1_000_000
    assert float(cost.train_seconds(tokens, QWEN7B, H100, C, devices=8)) == pytest.approx(
        6 * QWEN7B.params * tokens / (0.4 * 989e12 * 8))
    assert float(cost.train_seconds(tokens, QWEN7B, H100, C, devices=8, epochs=2)) == pytest.approx(
        2 * 6 * QWEN7B.params * tokens / (0.4 * 989e12 * 8))
    assert float(cost.logprob_seconds(tokens, QWEN7B, H100, C, devices=4)) == pytest.approx(
        2 * QWEN7B.params * tokens / (0.45 * 989e12 * 4))
    assert float(cost.prefill_seconds(tokens, QWEN7B, H100, C, tp=2)) == pytest.approx(
        2 * QWEN7B.params * tokens / (0.5 * 989e12 * 2))


def test_moving_bytes():
    shard = QWEN7B.weight_bytes
    assert cost.offload_seconds(shard, H100) == pytest.approx(shard / 50e9)
    assert cost.wake_seconds(shard, H100, C) == pytest.approx(shard / 50e9 + 5.0)
    # NVLink inside a node, the NIC across nodes
    assert cost.weight_sync_seconds(QWEN7B, H100, C, devices=8) == pytest.approx(shard / 450e9 + 1.0)  # one direction
    assert cost.weight_sync_seconds(QWEN7B, H100, C, devices=16) == pytest.approx(shard / 50e9 + 1.0)
    assert float(cost.data_plane_seconds(3e9, C)) == pytest.approx(2.0)
    state = QWEN7B.params * 16 + QWEN7B.weight_bytes
    assert cost.trainer_swap_seconds(QWEN7B, H100, C, 8, reference=True) == pytest.approx(state / 8 / 50e9)


def test_kv_capacity_limits_concurrent_sequences():
    free = 0.9 * 80e9 - QWEN7B.weight_bytes
    assert cost.kv_capacity_tokens(QWEN7B, H100, 1, 0.9) == pytest.approx(free / QWEN7B.kv_bytes_per_token)
    assert cost.concurrent_sequences(QWEN7B, H100, 1, 0.9, 256, 1000) == 256
    assert cost.concurrent_sequences(QWEN7B, H100, 1, 0.9, 256, 8000) == int(free / QWEN7B.kv_bytes_per_token / 8000)


def test_the_scalar_stretch_matches_the_array_segments():
    rng = np.random.default_rng(0)
    for _ in range(200):
        steps, active = int(rng.integers(0, 5000)), int(rng.integers(1, 2048))
        offset = float(rng.integers(0, 4_000_000))
        seconds, compute = cost.decode_segment_seconds(0, steps, active, offset, QWEN7B, H100, C, tp=2)
        stretch, stretch_compute = cost.decode_stretch(steps, active, offset, QWEN7B, H100, C, tp=2)
        assert stretch == pytest.approx(float(seconds), rel=1e-12, abs=1e-15)
        assert stretch_compute == int(compute)


def test_measured_engine_costs_replace_the_formulas_in_every_decode_and_prefill_price():
    fitted = replace(QWEN7B, engine=EngineFit(step_s=0.004, token_s=5e-4, prefill_token_s=2e-5), time_scale=2.0)
    # a step: (fixed + per-sequence) x the model's time scale, whatever the KV; the fixed part alone is step_s
    assert cost.decode_step_seconds(10, 1e6, fitted, H100, C) == pytest.approx(2.0 * (0.004 + 10 * 5e-4))
    assert cost.decode_step_seconds(1, np.array([1.0, 2.0]), fitted, H100, C).shape == (2,)
    assert cost.step_fixed_seconds(fitted, C) == pytest.approx(0.008)
    assert float(cost.prefill_seconds(1000, fitted, H100, C)) == pytest.approx(2.0 * 1000 * 2e-5)
    # the segment and the stretch sums agree with the step by step sum
    seconds, _ = cost.decode_segment_seconds(3, 40, 7, 500, fitted, H100, C)
    assert float(seconds) == pytest.approx(37 * 2.0 * (0.004 + 7 * 5e-4))
    assert cost.decode_stretch_seconds(37, 7, 500, fitted, H100, C) == pytest.approx(float(seconds))
