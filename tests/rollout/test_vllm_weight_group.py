"""`engine.vllm.weight_sync=group` without vLLM: the engine's side (`vllm_weight_group.WeightGroup`) and the workers'
side (`vllm_ext/gcore_vllm_weights.py`) over a real gloo group, the server's `/collective_rpc` played by a
function that calls the extension's methods on a stand-in worker."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.rollout.vllm_ext.gcore_vllm_weights import (
    WeightGroupExtension,
    byte_sizes,
    chunk_plan,
    pack,
    unpack,
)
from gcore_rl.rollout.vllm_server import ServerError, free_port
from gcore_rl.rollout.vllm_weight_group import WeightGroup


class Worker(WeightGroupExtension):
    """What the extension needs of vLLM's worker: a rank and `reload_weights`."""

    rank = 0

    def __init__(self):
        self.reloaded: list[list[tuple[str, torch.Tensor]]] = []

    def reload_weights(self, weights_iterator):
        self.reloaded.append([(name, tensor.clone()) for name, tensor in weights_iterator])


def _rpc(worker: Worker):
    def post(path: str, body: dict) -> dict:
        assert path == "/collective_rpc"
        return {"results": [getattr(worker, body["method"])(**body["kwargs"])]}
    return post


def test_chunks_group_consecutive_tensors_up_to_the_limit():
    assert chunk_plan([10, 20, 50, 5, 200, 1], limit=60) == [[0, 1], [2, 3], [4], [5]]
    assert chunk_plan([], limit=60) == []


def test_pack_and_unpack_keep_every_dtype_and_shape():
    tensors = [torch.randn(3, 4), torch.arange(5), torch.randn(2, dtype=torch.bfloat16), torch.ones(0)]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    shapes = [list(t.shape) for t in tensors]
    assert byte_sizes(dtypes, shapes) == [48, 40, 4, 0]
    for original, back in zip(tensors, unpack(pack(tensors), dtypes, shapes), strict=True):
        assert back.dtype == original.dtype and torch.equal(back, original)


def test_an_update_reaches_the_worker_over_the_group_in_chunks():
    worker = Worker()
    group = WeightGroup(_rpc(worker), free_port(), timeout_s=30, chunk_bytes=64)  # several chunks; one tensor larger
    update = {"embed": torch.randn(4, 8), "norm": torch.ones(3), "steps": torch.arange(7), "head": torch.randn(2, 2)}
    group.send(update)
    group.send({"norm": torch.zeros(3)})
    first, second = worker.reloaded
    assert [name for name, _ in first] == list(update)
    for (name, got), want in zip(first, update.values(), strict=True):
        assert torch.equal(got, want), name
    assert second[0][0] == "norm" and torch.equal(second[0][1], torch.zeros(3))


def test_a_refused_join_raises_at_once():
    def refuse(path: str, body: dict) -> dict:
        raise ServerError("vLLM server /collective_rpc answered 400: no method gcore_join_weight_group")

    with pytest.raises(ServerError, match="gcore_join_weight_group"):
        WeightGroup(refuse, free_port(), timeout_s=5)
