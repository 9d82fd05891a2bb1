"""PolicyTrainer under FSDP2 (world size 1, gloo): exact resume from its state_dict (also through
DCP), export as a Hugging Face folder, and what prepare fills in."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.models.loading import load_causal_lm, load_tokenizer
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.records import Completion, TokenBatch, build_token_batch
from gcore_rl.training.actor import TrainConfig, compute_logprobs, full_tensor
from gcore_rl.training.policy_trainer import PolicyTrainer
from gcore_rl.training.trainer_checkpoint import TrainerCheckpointer, writes_in_background

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=3)
# several optimiser steps per update under a warm-up, so the step count and the schedule both matter
MULTI_STEP = {"lr": 1e-2, "warmup_steps": 3, "mini_batches": 2, "micro_batch_size": 3}


pytestmark = pytest.mark.usefixtures("process_group")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), SMALL)



def _trainer(model_dir, *, kl_coef: float = 0.0, **train) -> PolicyTrainer:
    return PolicyTrainer.build(model_dir, dtype="float32", attn_implementation="sdpa", reference_path=None,
                               train=TrainConfig(**train), algo=AlgoConfig(kl_coef=kl_coef), logprob_temperature=1.0,
                               device=CPU, bf16=False)


def _batch(tokenizer, seed: int, rows: int = 6) -> TokenBatch:
    """Rows of ragged prompts and random completions with random advantages (a fresh object each call)."""
    gen = torch.Generator().manual_seed(seed)
    completions = []
    for i in range(rows):
        prompt = tokenizer.encode(f"{5 * i + seed}+{3 * i}=" + "x" * (i % 2), add_special_tokens=False)
        tokens = torch.randint(3, len(tokenizer), (2 + (i * 3 + seed) % 5,), generator=gen).tolist()
        completions.append(Completion(i, prompt, tokens, [0.0] * len(tokens), "length"))
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    batch.advantages = torch.randn(rows, generator=gen)
    return batch


def _update(trainer: PolicyTrainer, batch: TokenBatch) -> dict[str, float]:
    return trainer.update(batch, trainer.prepare(batch))


def _snapshot(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Full parameters and optimiser state tensors, by name."""
    state = trainer.state_dict()
    flat = {f"model/{name}": full_tensor(value).detach().clone() for name, value in state["model"].items()}
    for name, per_param in state["optimizer"]["state"].items():
        for key, value in per_param.items():
            flat[f"optimizer/{name}/{key}"] = full_tensor(value).detach().clone()
    return flat


def assert_same_trainer_state(first: PolicyTrainer, second: PolicyTrainer) -> None:
    a, b = _snapshot(first), _snapshot(second)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert first.optimiser_steps == second.optimiser_steps
    assert first.actor.scheduler.state_dict() == second.actor.scheduler.state_dict()
    assert first.actor.optimizer.param_groups[0]["lr"] == second.actor.optimizer.param_groups[0]["lr"]


# ---------------------------------------------------------------------------------------------- resume


def test_loaded_state_dict_resumes_exactly(model_dir, tokenizer):
    first = _trainer(model_dir, **MULTI_STEP)
    _update(first, _batch(tokenizer, seed=0))
    resumed = _trainer(model_dir, **MULTI_STEP)
    resumed.load_state_dict(first.state_dict())
    assert resumed.optimiser_steps == first.optimiser_steps == 2
    assert_same_trainer_state(first, resumed)

    stats_first = _update(first, _batch(tokenizer, seed=1))
    stats_resumed = _update(resumed, _batch(tokenizer, seed=1))
    assert stats_resumed == stats_first
    assert_same_trainer_state(first, resumed)
    assert first.optimiser_steps == 4
    assert first.actor.optimizer.param_groups[0]["lr"] == pytest.approx(MULTI_STEP["lr"])  # past the warm-up

    # without the loaded state the same second update lands elsewhere: the comparison is not vacuous
    unresumed = _trainer(model_dir, **MULTI_STEP)
    _update(unresumed, _batch(tokenizer, seed=1))
    ours, theirs = _snapshot(first), _snapshot(unresumed)
    assert any(not torch.equal(ours[name], theirs[name]) for name in ours if name.startswith("model/"))


def test_state_dict_round_trips_through_dcp(model_dir, tokenizer, tmp_path):
    first = _trainer(model_dir, **MULTI_STEP)
    _update(first, _batch(tokenizer, seed=0))
    dcp.save(first.state_dict(), checkpoint_id=tmp_path / "checkpoint")

    resumed = _trainer(model_dir, **MULTI_STEP)
    state = resumed.state_dict()  # the structure to load into (sharded like this trainer)
    dcp.load(state, checkpoint_id=tmp_path / "checkpoint")
    resumed.load_state_dict(state)
    assert resumed.optimiser_steps == 2
    assert_same_trainer_state(first, resumed)

    _update(first, _batch(tokenizer, seed=1))
    _update(resumed, _batch(tokenizer, seed=1))
    assert_same_trainer_state(first, resumed)


@pytest.mark.parametrize("mode", ["background", "blocking", "auto"])
def test_async_save_keeps_the_state_of_its_moment_while_training_goes_on(model_dir, tokenizer, tmp_path, mode):
    """`TrainerCheckpointer.save` stages the state, so an update during the write does not leak into it;
    the non-tensor state is JSON, and a load resumes exactly. Whichever thread writes (this tiny model's
    state is far under 64 MiB: `auto` writes in line)."""
    first = _trainer(model_dir, **MULTI_STEP)
    _update(first, _batch(tokenizer, seed=0))
    saved = _trainer(model_dir, **MULTI_STEP)
    saved.load_state_dict(first.state_dict())  # the state at the moment of the save
    checkpointer = TrainerCheckpointer(mode)
    checkpointer.save(first, tmp_path, "trainer", "trainer.json")
    assert checkpointer.last_in_background == (mode == "background")
    _update(first, _batch(tokenizer, seed=1))  # training goes on while the write runs
    checkpointer.wait()
    rest = json.loads((tmp_path / "trainer.json").read_text())
    assert rest["optimiser_steps"] == 2 and rest["scheduler"]["last_epoch"] == 2

    resumed = _trainer(model_dir, **MULTI_STEP)
    TrainerCheckpointer().load(resumed, tmp_path, "trainer", "trainer.json")
    assert_same_trainer_state(saved, resumed)
    _update(saved, _batch(tokenizer, seed=1))
    _update(resumed, _batch(tokenizer, seed=1))
    assert_same_trainer_state(first, resumed)

    # the next save reuses the host buffers of the first; each checkpoint keeps the state of its moment
    checkpointer.save(first, tmp_path / "second", "trainer", "trainer.json")
    _update(first, _batch(tokenizer, seed=2))
    checkpointer.wait()
    again = _trainer(model_dir, **MULTI_STEP)
    TrainerCheckpointer().load(again, tmp_path / "second", "trainer", "trainer.json")
    assert_same_trainer_state(resumed, again)
    checkpointer.close()


def test_checkpoints_of_small_states_are_written_in_line():
    """Under `auto` the writer thread takes states of 64 MiB or more (global shapes, so every rank decides
    alike); the other modes are what they say."""
    def meta(*shape: int) -> torch.Tensor:  # shapes and dtypes without memory
        return torch.empty(*shape, device="meta")

    small = [meta(12, 128, 128), meta(8, 384, 128), meta(4, 128)]  # the demo model's size
    large = [meta(24, 896, 4864), meta(48, 896, 4864)]  # a 0.5B model's MLP: gigabytes
    assert not writes_in_background("auto", small) and writes_in_background("auto", large)
    assert writes_in_background("auto", [meta(16, 1024, 1024)])  # exactly the threshold (float32: 64 MiB)
    assert not writes_in_background("auto", [meta(16 * 1024 * 1024 - 1)]) and not writes_in_background("auto", [])
    assert writes_in_background("background", small) and not writes_in_background("blocking", large)


def test_state_dict_of_a_fresh_trainer_is_that_of_a_fresh_optimiser(model_dir, tokenizer):
    """torch fills an empty optimiser state with a zero-gradient step; it must not count as AdamW's first."""
    asked = _trainer(model_dir, **MULTI_STEP)
    state = asked.state_dict()
    assert all(float(per_param["step"]) == 0.0 for per_param in state["optimizer"]["state"].values())
    loaded = _trainer(model_dir, **MULTI_STEP)
    loaded.load_state_dict(state)
    untouched = _trainer(model_dir, **MULTI_STEP)
    for trainer in (asked, loaded, untouched):
        _update(trainer, _batch(tokenizer, seed=2))
    assert_same_trainer_state(untouched, asked)
    assert_same_trainer_state(untouched, loaded)


# ---------------------------------------------------------------------------------------------- export


def test_export_reloads_with_the_trained_weights(model_dir, tokenizer, tmp_path):
    trainer = _trainer(model_dir, lr=1e-2)
    _update(trainer, _batch(tokenizer, seed=0))
    out = trainer.export(tmp_path / "export", tokenizer)

    exported = load_causal_lm(out)
    original = load_causal_lm(model_dir)
    ids = _batch(tokenizer, seed=5).input_ids
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(ids).logits
        _assert_logits_close(exported(ids).logits, expected)
        moved = float((original(ids).logits - expected).abs().max())
    assert moved > 1e-3, "the update did not change the model; the export check would be vacuous"
    reloaded = load_tokenizer(out)
    assert reloaded.encode("12+34= x", add_special_tokens=False) == tokenizer.encode("12+34= x", add_special_tokens=False)


def _assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- prepare


def test_prepare_fills_old_logprobs_of_the_current_weights_for_a_multi_step_update(model_dir, tokenizer):
    trainer = _trainer(model_dir, lr=1e-2, ppo_epochs=2, micro_batch_size=4)
    _update(trainer, _batch(tokenizer, seed=0))  # weights that differ from the folder's
    batch = _batch(tokenizer, seed=1)
    batch.rollout_logprobs = torch.full(batch.input_ids.shape, -3.0) * batch.response_mask
    batch.staleness = torch.tensor([0, 1, 0, 0, 2, 0])
    current = compute_logprobs(trainer.model, batch, 1.0, 4, CPU)  # the trainer's passes: bit for bit the same

    assert trainer.prepare_passes == 1
    trainer_logprobs = trainer.prepare(batch)
    assert torch.equal(trainer_logprobs, current)
    stale = batch.staleness > 0
    assert torch.equal(batch.old_logprobs[~stale], current[~stale])
    assert torch.equal(batch.old_logprobs[stale], batch.rollout_logprobs[stale])  # the behaviour policy's
    assert batch.ref_logprobs is None and trainer.reference is None


def test_update_reports_the_engine_gap_on_fresh_rows(model_dir, tokenizer):
    trainer = _trainer(model_dir, lr=1e-2, ppo_epochs=2)
    batch = _batch(tokenizer, seed=1)
    current = compute_logprobs(trainer.model, batch, 1.0, 64, CPU)
    offset = torch.tensor([0.01, 0.5, 0.02, 0.0, 0.5, 0.0]).unsqueeze(-1)  # the stale rows are far off
    batch.rollout_logprobs = (current + offset) * batch.response_mask
    batch.staleness = torch.tensor([0, 1, 0, 0, 2, 0])
    with pytest.raises(ValueError, match="trainer log-probs"):
        trainer.update(batch)
    stats = _update(trainer, batch)
    assert stats["rollout/logprob_gap_max"] == pytest.approx(0.02, abs=1e-6)


def test_single_pass_update_leaves_old_logprobs_to_its_own_forward(model_dir, tokenizer):
    trainer = _trainer(model_dir, lr=1e-2)
    batch = _batch(tokenizer, seed=1)
    assert trainer.single_pass and trainer.prepare_passes == 0
    assert trainer.prepare(batch) is None
    assert batch.old_logprobs is None and batch.ref_logprobs is None
    stats = trainer.update(batch)
    assert trainer.optimiser_steps == 1
    assert stats["rollout/logprob_gap_max"] > 0  # the engine's log-probs of this batch are all 0


def test_a_trust_region_runs_the_old_logprob_pass_even_for_one_optimiser_step(model_dir, tokenizer):
    """`train.max_kl` measures each step against the old log-probs: one optimiser step is no longer a single pass,
    and its update reports the trust region's work."""
    trainer = _trainer(model_dir, lr=1e-2, max_kl=1e-4)
    batch = _batch(tokenizer, seed=1)
    assert not trainer.single_pass and trainer.prepare_passes == 1
    stats = trainer.update(batch, trainer.prepare(batch))
    assert stats["kl_probe_max"] > 1e-4 and stats["kl_backtracks"] >= 1


def test_reference_logprobs_are_filled_exactly_when_kl_is_on(model_dir, tokenizer):
    trainer = _trainer(model_dir, kl_coef=0.05, lr=1e-2)
    assert trainer.reference is not None and trainer.prepare_passes == 1
    initial = compute_logprobs(load_causal_lm(model_dir), _batch(tokenizer, seed=1), 1.0, 64, CPU)

    batch = _batch(tokenizer, seed=1)
    trainer.prepare(batch)
    assert batch.old_logprobs is None
    torch.testing.assert_close(batch.ref_logprobs, initial, rtol=0, atol=1e-6)
    stats = trainer.update(batch)
    assert "kl" in stats

    # the reference stays frozen while the policy moves
    later = _batch(tokenizer, seed=1)
    trainer.prepare(later)
    assert torch.equal(later.ref_logprobs, batch.ref_logprobs)
    assert float((compute_logprobs(trainer.model, later, 1.0, 64, CPU) - initial).abs().max()) > 1e-4
