"""Trainer offload under FSDP2 (world size 1, gloo): the state really moves (fresh storage, `copy=True`, as a GPU
run moves it to host memory) and training goes on exactly as if it had never left."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.models.lora import LoraSettings
from gcore_rl.training.offload import TrainerOffload, local
from tests.training.test_lora import TRAIN, model_dir  # noqa: F401 - the module's tiny model
from tests.training.test_lora import _trainer as _lora_trainer
from tests.training.test_policy_trainer import _batch, _update, assert_same_trainer_state

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("process_group")


def _seeded(build):
    """`build()` from the same random state (peft draws each adapter's A at random)."""
    torch.manual_seed(0)
    return build()


def _pointers(trainer, keep: list) -> dict[str, set[int]]:
    """Where the parameters and AdamW moments are stored; `keep` holds the tensors, so no storage is freed and
    reused by a later allocation while the test compares addresses."""
    params = [local(p) for p in trainer.model.parameters()]
    moments = [local(v) for state in trainer.actor.optimizer.state.values() for key, v in state.items() if key != "step"]
    keep.extend(params + moments)
    return {"params": {t.untyped_storage().data_ptr() for t in params},
            "moments": {t.untyped_storage().data_ptr() for t in moments}}


@pytest.mark.parametrize("level, lora", [("all", False), ("optimizer", False), ("all", True)])
def test_offloaded_state_comes_back_and_training_goes_on_exactly(model_dir, tokenizer, level, lora):  # noqa: F811
    settings = LoraSettings(enabled=lora, rank=4, alpha=8.0)
    moving, staying = (_seeded(lambda: _lora_trainer(model_dir, settings)) for _ in range(2))
    offload = TrainerOffload(level, CPU, copy=True)
    for seed in (0, 1, 2):
        for trainer in (moving, staying):
            _update(trainer, _batch(tokenizer, seed=seed))
        keep: list[torch.Tensor] = []
        before = _pointers(moving, keep)
        moved = offload.offload(moving.offload_parts())
        assert offload.offloaded and offload.offload(moving.offload_parts()) == 0  # idempotent
        after = _pointers(moving, keep)
        assert after["moments"].isdisjoint(before["moments"])
        if level == "all":
            assert after["params"].isdisjoint(before["params"])
        else:
            assert after["params"] == before["params"]
        trained = sum(local(p).numel() * 4 for p in moving.model.parameters() if p.requires_grad)
        expected = 2 * trained + (sum(local(p).numel() * 4 for p in moving.model.parameters()) if level == "all" else 0)
        assert moved >= expected
        assert offload.reload(moving.offload_parts()) == moved and not offload.offloaded
        assert offload.reload(moving.offload_parts()) == 0
    assert_same_trainer_state(moving, staying)
    check = _batch(tokenizer, seed=9)
    assert torch.equal(moving.actor.compute_logprobs(check), staying.actor.compute_logprobs(check))
    assert TRAIN["mini_batches"] == 2  # several optimiser steps per update: the moved moments were used


def test_nothing_moves_without_offload(model_dir, tokenizer):  # noqa: F811
    trainer = _lora_trainer(model_dir, LoraSettings())
    _update(trainer, _batch(tokenizer, seed=0))
    offload = TrainerOffload("none", CPU, copy=True)
    keep: list[torch.Tensor] = []
    before = _pointers(trainer, keep)
    assert offload.offload(trainer.offload_parts()) == 0 and not offload.offloaded
    assert _pointers(trainer, keep) == before
