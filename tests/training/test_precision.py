"""Mixed precision beyond CUDA: a bf16 trainer on a CPU device (`train.bf16_cpu`) and the engine's dtype as a
setting of its own (`engine.dtype`); the gap between them is what `mismatch/*` measures."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.models.loading import load_causal_lm
from gcore_rl.rollout.backends import EngineConfig, EngineSource, build_engine, engine_dtype
from gcore_rl.training.actor import TrainConfig, compute_logprobs
from gcore_rl.training.policy_trainer import PolicyTrainer
from tests.training.test_lora import model_dir  # noqa: F401 - the module's tiny model
from tests.training.test_policy_trainer import _batch, _update

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("process_group")


def _trainer(model_dir, bf16: bool) -> PolicyTrainer:  # noqa: F811
    train = TrainConfig(lr=1e-2, bf16_cpu=bf16)
    return PolicyTrainer.build(model_dir, dtype="float32", attn_implementation="sdpa", reference_path=None, train=train,
                               algo=AlgoConfig(kl_coef=0.0), logprob_temperature=1.0, device=CPU,
                               bf16=train.bf16_on(CPU))


def test_a_bf16_trainer_on_a_cpu_keeps_fp32_master_weights(model_dir, tokenizer):  # noqa: F811
    assert not TrainConfig().bf16_on(CPU) and TrainConfig().bf16_on(torch.device("cuda"))
    assert not TrainConfig(bf16=False, bf16_cpu=True).bf16_on(CPU)
    full, mixed = _trainer(model_dir, False), _trainer(model_dir, True)
    batch = _batch(tokenizer, seed=0)
    gap = float((full.actor.compute_logprobs(batch) - mixed.actor.compute_logprobs(batch)).abs().max())
    assert 1e-5 < gap < 0.05  # bf16 rounding: visible, small
    stats = _update(mixed, _batch(tokenizer, seed=1))
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())


def test_the_engine_dtype_is_its_own_setting(model_dir, tokenizer):  # noqa: F811
    assert engine_dtype(EngineConfig(), "float32") == "float32"
    assert engine_dtype(EngineConfig(dtype="bfloat16"), "float32") == "bfloat16"
    source = EngineSource(str(model_dir), CPU, tokenizer.eos_token_id, tokenizer.pad_token_id,
                          engine_dtype(EngineConfig(dtype="bfloat16"), "float32"))
    engine = build_engine(EngineConfig(dtype="bfloat16"), source)
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    batch = _batch(tokenizer, seed=2)
    fp32 = compute_logprobs(load_causal_lm(model_dir), batch, 1.0, 64, CPU)
    gap = float((compute_logprobs(engine.model, batch, 1.0, 64, CPU) - fp32).abs().max())
    assert 1e-4 < gap < 0.2
