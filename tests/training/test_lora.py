"""A LoRA policy under FSDP2 (world size 1, gloo): only the adapters train and are saved, the reference is
the base with the adapters off, the engine's merged weights give the trainer's log-probs, and the
state resumes exactly through DCP."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.errors import ConfigError
from gcore_rl.models.loading import load_causal_lm
from gcore_rl.models.lora import LoraSettings, apply_lora, base_name, check_lora_targets
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.rollout.backends import EngineConfig, EngineSource, build_engine
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.training.actor import TrainConfig, compute_logprobs
from gcore_rl.training.policy_trainer import PolicyTrainer
from gcore_rl.training.trainer_checkpoint import TrainerCheckpointer
from tests.training.test_policy_trainer import _batch, _snapshot, _update, assert_same_trainer_state

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=3)
LORA = LoraSettings(enabled=True, rank=4, alpha=8.0)
TRAIN = {"lr": 5e-2, "warmup_steps": 2, "mini_batches": 2, "micro_batch_size": 3}

pytestmark = pytest.mark.usefixtures("process_group")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), SMALL)


def _trainer(model_dir, lora: LoraSettings = LORA, kl_coef: float = 0.1) -> PolicyTrainer:
    return PolicyTrainer.build(model_dir, dtype="float32", attn_implementation="sdpa", reference_path=None,
                               train=TrainConfig(**TRAIN), algo=AlgoConfig(kl_coef=kl_coef), logprob_temperature=1.0,
                               device=CPU, bf16=False, lora=lora)


def test_only_the_adapters_train_and_the_reference_is_the_base(model_dir, tokenizer):
    trainer = _trainer(model_dir)
    base = load_causal_lm(model_dir)
    trained = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    frozen_before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if not p.requires_grad}

    batch = _batch(tokenizer, seed=0)
    _update(trainer, batch)
    assert trainer.reference is trainer.model  # no second copy of the weights
    for name, p in trainer.model.named_parameters():
        if name in frozen_before:
            assert torch.equal(p.detach(), frozen_before[name]), name

    # the reference's log-probs are the base model's, also after the adapters moved: to fp32 round-off, as the
    # trainer's forward runs under FSDP2 (the same peft model without it gives the base's bit for bit; with it the
    # two differed by 4.8e-7 on a fresh install of 2026-12-07, at the commit that had passed bit for bit the day before)
    fresh = _batch(tokenizer, seed=1)
    expected = compute_logprobs(base, fresh, 1.0, 64, CPU)
    torch.testing.assert_close(trainer.reference_logprobs(fresh), expected, rtol=0, atol=2e-6)
    moved = float((trainer.actor.compute_logprobs(fresh) - expected).abs().max())
    assert moved > 1e-3, "the update left the policy where the base is: the comparison would be vacuous"


def test_the_engine_with_merged_weights_scores_as_the_trainer(model_dir, tokenizer):
    """Merged weights carry the base model's names; an engine that loads them gives the trainer's log-probs
    (fp32, within 1e-5), after one update and after a second sync."""
    trainer = _trainer(model_dir)
    engine = GenerationEngine(load_causal_lm(model_dir), tokenizer.eos_token_id, tokenizer.pad_token_id)
    base_names = {name for name, _ in load_causal_lm(model_dir).named_parameters()}
    for seed in (0, 1):
        _update(trainer, _batch(tokenizer, seed=seed))
        merged = list(trainer.full_weights())
        assert {name for name, _ in merged} == base_names
        engine.load_weights(merged, version=seed + 1)
        check = _batch(tokenizer, seed=7)
        ours = trainer.actor.compute_logprobs(check)
        theirs = compute_logprobs(engine.model, check, 1.0, 64, CPU)
        assert float((ours - theirs).abs().max()) < 1e-5


def test_an_engine_that_applies_the_adapters_gets_only_them(model_dir, tokenizer, tmp_path):
    """`model.lora.sync=adapters`: the engine keeps its base and applies the adapters it is sent; it scores as the
    trainer does (fp32, within 1e-5), the sync moves a fraction of the merged bytes, and the engine saves the
    merged model."""
    settings = LoraSettings(enabled=True, rank=4, alpha=8.0, sync="adapters")
    trainer = _trainer(model_dir, settings)
    source = EngineSource(str(model_dir), CPU, tokenizer.eos_token_id, tokenizer.pad_token_id, lora=settings)
    engine = build_engine(EngineConfig(), source)
    for seed in (0, 1):
        _update(trainer, _batch(tokenizer, seed=seed))
        sent = list(trainer.sync_weights())
        assert sent and all(".lora_A." in name or ".lora_B." in name for name, _ in sent)
        assert engine.load_weights(sent, version=seed + 1) == len(sent)
        check = _batch(tokenizer, seed=7)
        ours = trainer.actor.compute_logprobs(check)
        assert float((ours - compute_logprobs(engine.model, check, 1.0, 64, CPU)).abs().max()) < 1e-5
    merged_bytes = sum(t.numel() * t.element_size() for _, t in trainer.full_weights())
    assert sum(t.numel() * t.element_size() for _, t in sent) * 2 < merged_bytes
    engine.save_pretrained(tmp_path / "final")
    saved = load_causal_lm(tmp_path / "final")
    assert {name for name, _ in saved.named_parameters()} == {name for name, _ in load_causal_lm(model_dir).named_parameters()}
    assert float((compute_logprobs(saved, check, 1.0, 64, CPU) - ours).abs().max()) < 1e-5


def test_the_state_is_the_adapters_and_resumes_exactly_through_dcp(model_dir, tokenizer, tmp_path):
    first = _trainer(model_dir)
    _update(first, _batch(tokenizer, seed=0))
    state = first.state_dict()
    assert state["model"] and all(".lora_A." in name or ".lora_B." in name for name in state["model"])
    assert set(state["optimizer"]["state"]) == set(state["model"])
    full = _trainer(model_dir, lora=LoraSettings()).state_dict()
    adapters = sum(t.numel() for t in state["model"].values())
    assert adapters * 5 < sum(t.numel() for t in full["model"].values())

    checkpointer = TrainerCheckpointer("blocking")
    checkpointer.save(first, tmp_path, "trainer", "trainer.json")
    checkpointer.wait()
    resumed = _trainer(model_dir)
    TrainerCheckpointer().load(resumed, tmp_path, "trainer", "trainer.json")
    assert_same_trainer_state(first, resumed)
    stats = [_update(t, _batch(tokenizer, seed=1)) for t in (first, resumed)]
    assert stats[0] == stats[1]
    assert_same_trainer_state(first, resumed)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first.full_weights(), resumed.full_weights(), strict=True))
    unresumed = _trainer(model_dir)
    _update(unresumed, _batch(tokenizer, seed=1))
    ours, theirs = _snapshot(first), _snapshot(unresumed)
    assert any(not torch.equal(ours[name], theirs[name]) for name in ours)
    checkpointer.close()


def test_export_writes_the_merged_model(model_dir, tokenizer, tmp_path):
    trainer = _trainer(model_dir)
    _update(trainer, _batch(tokenizer, seed=0))
    out = trainer.export(tmp_path / "merged", tokenizer)
    exported = load_causal_lm(out)
    check = _batch(tokenizer, seed=4)
    expected = trainer.actor.compute_logprobs(check)
    assert float((compute_logprobs(exported, check, 1.0, 64, CPU) - expected).abs().max()) < 1e-5


def test_targets_that_match_nothing_are_refused_by_key(model_dir):
    wrong = LoraSettings(enabled=True, target_modules=["qkv_proj"])
    with pytest.raises(ConfigError, match=r"model.lora.target_modules.*qkv_proj.*match no module"):
        check_lora_targets(model_dir, wrong)
    check_lora_targets(model_dir, LoraSettings(enabled=True, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ConfigError, match="match no module"):
        apply_lora(load_causal_lm(model_dir), wrong)


def test_base_names_are_the_base_models():
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert base_name("base_model.model.lm_head.weight") == "lm_head.weight"
