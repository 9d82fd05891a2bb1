"""Ulysses sequence parallelism on 2 gloo processes equals the single-process computation (issue 21, item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_helpers import run_processes

from gcore_rl.distributed import destroy_process_group, init_process_group
from gcore_rl.models.tiny import TinyModelConfig, build_tiny_model
from gcore_rl.training.sequence_parallel import check_divides, sequence_chunk, use_ulysses

CPU = torch.device("cpu")
SHAPE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=5)
VOCAB, LENGTH, WORLD = 40, 16, 2


def _model():
    model = build_tiny_model(SHAPE, VOCAB, 0, 1)
    model.config._attn_implementation = "sdpa"
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=gen)  # two sequences of equal length
    weights = torch.randn(2, LENGTH, VOCAB, generator=gen)  # a loss that touches every logit
    return ids, weights


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world, port, CPU)
    try:
        group = dist.group.WORLD
        model = use_ulysses(_model(), group)
        ids, weights = _inputs()
        chunk, positions = sequence_chunk(ids, group)
        logits = model(input_ids=chunk, position_ids=positions, use_cache=False).logits
        span = slice(rank * (LENGTH // world), (rank + 1) * (LENGTH // world))
        (logits * weights[:, span]).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        for grad in grads.values():  # each rank holds its share of the gradient
            dist.all_reduce(grad)
        torch.save({"logits": logits.detach(), "grads": grads}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_process_group()


def test_ulysses_logits_and_gradients_equal_the_single_process_ones(tmp_path):
    run_processes(_worker, (str(tmp_path),), WORLD, 120, "sequence-parallel")
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    model = _model()
    ids, weights = _inputs()
    logits = model(input_ids=ids, use_cache=False).logits
    (logits * weights).sum().backward()
    torch.testing.assert_close(torch.cat([r["logits"] for r in results], dim=1), logits.detach(), rtol=0, atol=1e-5)
    for name, param in model.named_parameters():
        for result in results:
            torch.testing.assert_close(result["grads"][name], param.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_a_degree_that_does_not_divide_the_heads_is_named():
    with pytest.raises(ValueError, match=r"degree of 4 must divide .* key/value heads \(2\)"):
        check_divides(_model().config.to_dict(), 4)
