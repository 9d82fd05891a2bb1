"""`train.activation_checkpointing` (issue 21, item 3): same gradients, blocks recomputed in the backward."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.distributed import destroy_process_group, free_port, init_process_group
from gcore_rl.models.tiny import TinyModelConfig, build_tiny_model
from gcore_rl.training.fsdp import shard_model
from gcore_rl.training.logprobs import token_logprobs

CPU = torch.device("cpu")


@pytest.fixture
def group():
    init_process_group(0, 1, free_port(), CPU)
    yield
    destroy_process_group()


def _gradients_and_block_calls(checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                                             intermediate_size=64, seed=3), 40, 0, 1)
    calls = []
    # the MLP runs inside the checkpointed forward (the block's own hooks stay outside it); a pre-hook, because
    # the recompute stops as soon as it has the tensors the backward needs, before the MLP returns
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    model = shard_model(model, activation_checkpointing=checkpointing)
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    logprobs, _ = token_logprobs(model, ids, mask, first_scored=5)
    (logprobs[:, 5:] * mask[:, 5:]).sum().backward()
    return {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}, len(calls)


def test_checkpointed_blocks_give_the_same_gradients_and_run_twice(group):
    plain, plain_calls = _gradients_and_block_calls(False)
    checkpointed, checkpointed_calls = _gradients_and_block_calls(True)
    assert plain_calls == 3 and checkpointed_calls == 6  # each block's MLP again in the backward
    assert plain.keys() == checkpointed.keys()  # no wrapper renames a parameter
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
