"""The trainer memory model (`gcore_rl.costmodel.memory`) against values computed by hand.

The toy shape: 2 layers, hidden 8, 2 query heads and 1 key/value head of width 4, MLP 16, vocabulary 32,
tied embeddings, no biases (llama). Its linear layers per decoder layer (in × out): q 8×8, k 8×4, v 8×4,
o 8×8, gate 8×16, up 8×16, down 16×8 = 576 weights, + 2 norms of 8 = 592; 2 layers = 1,184; + the final
norm 8 + the embedding 32 × 8 = 256: 1,448 parameters, 264 of them outside the layers.
"""

from __future__ import annotations

import pytest

from gcore_rl.costmodel.memory import (
    CHUNK_POSITIONS,
    TrainerSetup,
    activation_bytes_per_token,
    head_bytes,
    lora_params,
    placement_fit,
    root_params,
    trainer_memory,
)
from gcore_rl.costmodel.models import MODELS, ModelSpec
from gcore_rl.errors import ConfigError

TOY = ModelSpec.from_hf_config({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 32,
                                "tie_word_embeddings": True, "model_type": "llama"}, name="toy")


def test_the_toy_shape_counts_as_by_hand():
    assert (TOY.params, TOY.intermediate) == (1448, 16)
    assert root_params(TOY) == 264


def test_lora_adapters_are_rank_times_in_plus_out_per_linear():
    # rank 2 × (16 + 12 + 12 + 16 + 24 + 24 + 24) per layer, 2 layers
    assert lora_params(TOY, 2) == 2 * 2 * 128
    assert lora_params(TOY, 2, ("q_proj", "v_proj")) == 2 * 2 * (16 + 12)
    # peft's count for Qwen2.5-7B, all-linear, rank 16 ("trainable params: 40,370,176"), and the 8.8 M of docs/memory.md
    assert lora_params(MODELS["Qwen2.5-7B"], 16) == 40_370_176
    assert lora_params(MODELS["Qwen2.5-0.5B"], 16) == 8_798_208


def test_activations_per_token_follow_the_tensor_count():
    # per layer 6·8 (norms) + 5·8 (attention) + 4·16 (MLP) = 152 elements; 2 layers + 3·8 outside
    assert activation_bytes_per_token(TOY, TrainerSetup(micro_batch_tokens=1)) == (2 * 152 + 24) * 4
    # checkpointed: each layer's input (8) + one layer recomputed (152) + 24, in bf16
    ckpt = TrainerSetup(micro_batch_tokens=1, activation_checkpointing=True, activation_bytes=2)
    assert activation_bytes_per_token(TOY, ckpt) == (2 * 8 + 152 + 24) * 2
    # LoRA adds its rank-wide intermediate per adapted linear (7 × 2), kept scores 2 heads × 5 positions
    assert activation_bytes_per_token(TOY, TrainerSetup(micro_batch_tokens=1, lora_rank=2)) == (2 * 166 + 24) * 4
    assert activation_bytes_per_token(TOY, TrainerSetup(micro_batch_tokens=1, attention_scores_length=5)) == (
        (2 * 162 + 24) * 4)


def test_the_head_is_the_full_logits_and_their_gradient_or_three_chunks():
    assert head_bytes(TOY, TrainerSetup(micro_batch_tokens=10, chunked_head=False)) == 10 * 32 * (4 + 4)
    assert head_bytes(TOY, TrainerSetup(micro_batch_tokens=10, head_tokens=6, chunked_head=False,
                                        activation_bytes=2)) == 6 * 32 * (2 + 4)
    assert head_bytes(TOY, TrainerSetup(micro_batch_tokens=10)) == 3 * 10 * 32 * 4  # one chunk of 10 positions
    assert head_bytes(TOY, TrainerSetup(micro_batch_tokens=4096)) == 3 * CHUNK_POSITIONS * 32 * 4


def test_full_fine_tuning_peaks_at_the_backward_start():
    memory = trainer_memory(TOY, TrainerSetup(micro_batch_tokens=10, chunked_head=False))
    assert (memory.weights, memory.gradients, memory.moments) == (1448 * 4, 1448 * 4, 1448 * 8)
    assert (memory.root_gradients, memory.gathered) == (264 * 4, (264 + 2 * 576) * 4)  # one shard gathers too
    assert memory.activations == 10 * 328 * 4
    # weights + moments + gathers + (activations + logits and their gradient + the embedding's gradient)
    assert memory.update_peak == 5792 + 11584 + 5664 + (13120 + 2560 + 1056)


def test_sharding_divides_the_state_and_adds_the_gathers():
    memory = trainer_memory(TOY, TrainerSetup(micro_batch_tokens=10, shards=4, gather_bytes=2,
                                              foreach_optimizer=True))
    assert (memory.weights, memory.gradients, memory.moments) == (1448, 1448, 2896)
    assert memory.gathered == (264 + 2 * 576) * 2  # the root block stays gathered, two layers at a time
    assert memory.optimizer_step == 1448


def test_lora_trains_only_the_adapters():
    memory = trainer_memory(TOY, TrainerSetup(micro_batch_tokens=10, lora_rank=2))
    assert memory.weights == (1448 + 512) * 4  # the frozen base and the adapters
    assert (memory.gradients, memory.moments, memory.root_gradients) == (512 * 4, 512 * 8, 0.0)
    bf16_base = trainer_memory(TOY, TrainerSetup(micro_batch_tokens=10, lora_rank=2, frozen_bytes=2))
    assert bf16_base.weights == 1448 * 2 + 512 * 4  # the base in bf16, the adapters in fp32
    full = trainer_memory(TOY, TrainerSetup(micro_batch_tokens=10, frozen_bytes=2))
    assert full.weights == 1448 * 4  # without LoRA nothing is frozen


def test_offload_leaves_the_weights_or_nothing_during_the_rollout():
    memory = trainer_memory(TOY, TrainerSetup(micro_batch_tokens=10, process_bytes=100))
    assert memory.rollout_resident("none") == 100 + 1448 * 4 + 1448 * 8
    assert memory.rollout_resident("optimizer") == 100 + 1448 * 4
    assert memory.rollout_resident("all") == 100


def test_a_placement_fits_when_the_update_and_the_engine_kv_fit():
    setup = TrainerSetup(micro_batch_tokens=10, process_bytes=100)
    peak = trainer_memory(TOY, setup).update_peak
    # TOY's KV is 2 · 2 layers · 1 head · 4 · 2 bytes = 32 bytes per token, its bf16 weights 2,896 bytes
    roomy = placement_fit(TOY, device_bytes=peak / 0.9, setup=setup, engine_tp=1, colocated=False, min_kv_tokens=1)
    assert roomy.update_fits and roomy.kv_tokens == pytest.approx((peak - 2896) / 32)
    colocated = placement_fit(TOY, device_bytes=peak / 0.9, setup=setup, engine_tp=1, colocated=True,
                              offload="optimizer", min_kv_tokens=1)
    assert colocated.kv_tokens == pytest.approx((peak - 100 - 1448 * 4 - 2896) / 32)
    assert not placement_fit(TOY, device_bytes=peak, setup=setup, engine_tp=1, colocated=False,
                             min_kv_tokens=1e9).fits


def test_bad_setups_name_their_key():
    with pytest.raises(ConfigError, match="shards"):
        trainer_memory(TOY, TrainerSetup(micro_batch_tokens=1, shards=0))
    with pytest.raises(ConfigError, match="frozen_bytes"):
        trainer_memory(TOY, TrainerSetup(micro_batch_tokens=1, frozen_bytes=-2))
    with pytest.raises(ConfigError, match="intermediate"):
        lora_params(ModelSpec("x", params=1, layers=1, hidden=8, kv_heads=1, head_dim=4, vocab=8), 2)


def test_the_model_chunks_as_the_trainer_does():
    from gcore_rl.training import chunked_head

    assert CHUNK_POSITIONS == chunked_head.CHUNK_POSITIONS
